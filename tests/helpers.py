"""Constants and helpers shared by the tests (fixtures are in conftest.py)."""

import os
import threading

import pytest
import torch

from rlhf.embedded import EmbeddedConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The embedded default at test size: a 1-layer, 32-wide Qwen2 and 64 + 16 problems, 5 warm-start steps.
TINY_EMBEDDED = EmbeddedConfig(num_train=64, num_val=16, hidden_size=32, intermediate_size=64, num_layers=1,
                               num_heads=2, num_kv_heads=1, sft_steps=5, sft_batch_size=8)


def embedded_overrides(embedded: EmbeddedConfig = TINY_EMBEDDED) -> list[str]:
    """`task.options.*` overrides that make train.py build `embedded` itself (the notebook uses the same)."""
    return [f"task.options.{key}={value}" for key, value in vars(embedded).items()
            if value != getattr(EmbeddedConfig, key)]


def tiny_overrides(artifacts, output_dir, *extra) -> list[str]:
    """train.py overrides for a seconds-long run on the tiny model and files of `artifacts`."""
    return [
        f"model.path={artifacts.model_dir}", f"data.train_files={artifacts.train_file}",
        f"data.val_files={artifacts.val_file}", "data.max_response_length=16", "data.max_prompt_length=96",
        "data.train_batch_size=8", "data.val_batch_size=8", "data.max_val_samples=8",
        "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size=2", "actor.lr=1e-3", "critic.lr=1e-3",
        "rollout.log_prob_micro_batch_size=4", "trainer.total_steps=2", "trainer.test_freq=0",
        f"trainer.output_dir={output_dir}", "trainer.project_name=test", *extra,
    ]


NOT_COMPARED = ("timing_s/", "perf/throughput")  # wall-clock measurements


def assert_same_rows(rows, expected):
    """metrics.jsonl rows: the same steps in order (no duplicate, none missing), the same keys, the same values
    to float precision (wall-clock measurements aside)."""
    assert [r["step"] for r in rows] == [r["step"] for r in expected]
    for row, want in zip(rows, expected):
        assert set(row) == set(want), (row["step"], set(row) ^ set(want))
        for key, value in want.items():
            if not key.startswith(NOT_COMPARED):
                assert row[key] == pytest.approx(value, rel=1e-6, abs=1e-12), (row["step"], key)


def tiny_qwen2(vocab_size: int = 512, seed: int = 0, **config):
    """A random 2-layer, 32-wide Qwen2ForCausalLM in eval mode, initialised from `seed`; `config` sets further
    Qwen2Config fields (token ids, tied embeddings, the init scale)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                        max_position_embeddings=128, **config)).eval()


def sample(model, prompt_ids, prompt_mask, params, stop_ids, pad_token_id, generator=None, keep_logprobs=False,
           reference=False):
    """(tokens, log-probs) of rlhf.decode's static-cache loop, or with `reference` of its reference loop, called
    as rlhf.rollout.generate calls them."""
    from rlhf import decode
    from rlhf.rollout import next_token

    def pick(logits):
        return next_token(logits, params, generator)

    how = decode.Decoding(params.max_new_tokens, pick, params.temperature, stop_ids, pad_token_id, generator,
                          keep_logprobs)
    loop = decode.reference_decode if reference else decode.decode
    return loop(model, prompt_ids, prompt_mask, how)


def in_processes(fn, shards):
    """Run fn(shard, reduce_sum) in one thread per shard, with reduce_sum summing over the threads: the
    cross-process reduction of N processes, in one test process. Returns each thread's result."""
    barrier, slots, results = threading.Barrier(len(shards)), [None] * len(shards), [None] * len(shards)

    def worker(rank):
        def reduce_sum(tensor):
            slots[rank] = tensor.clone()
            barrier.wait()
            total = sum(slots)
            barrier.wait()
            return total

        results[rank] = fn(shards[rank], reduce_sum)

    threads = [threading.Thread(target=worker, args=(rank,)) for rank in range(len(shards))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def nudge(values, sign: int, eps: float = 1e-9):
    """`values` moved by a relative `sign * eps`, up and down in turn along the entries; a distribution (entries
    >= 0 summing to 1 along the last dimension) stays one. Anything but a tensor is returned as it is.

    A report printed from exact computations is the same on every machine when it is the same for inputs
    nudged both ways: a float-order difference between machines (~1e-16 relative per operation, ~1e-13 through
    a converged solver) is ~1e4 times smaller than the nudge, so a printed digit it could flip would sit so
    close to a rounding boundary that the nudge flips it too."""
    if not isinstance(values, torch.Tensor):
        return values
    pattern = 1 - 2 * (torch.arange(values.numel()) % 2).reshape(values.shape).to(values.dtype)
    moved = values * (1 + sign * eps * pattern)
    if (values >= 0).all() and torch.allclose(values.sum(-1), torch.ones((), dtype=values.dtype), atol=1e-12):
        moved = moved / moved.sum(-1, keepdim=True)
    return moved
