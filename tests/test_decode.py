"""The static-cache decoder (rlhf.decode.decode) against the reference loop (rlhf.decode.reference_decode):
the same tokens, the same log-probs and the same random state afterwards, under the same noise."""

import functools

import pytest
import torch
from helpers import sample, tiny_qwen2
from transformers import DynamicCache

from rlhf import decode
from rlhf.rollout import SamplingParams, generate, left_pad, next_token, paired_noise_generator

EOS, PAD = 1, 0


def both(model, prompt_ids, prompt_mask, params, stop_ids, seeded: str, autocast: bool = False):
    """{reference, static}: (tokens, log-probs, 3 draws of the noise source made after the decoding)."""
    out = {}
    for side in ("reference", "static"):
        generator = paired_noise_generator(7, 3, 0, "cpu") if seeded == "generator" else None
        torch.manual_seed(11)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            tokens, logprobs = sample(model, prompt_ids, prompt_mask, params, stop_ids, PAD, generator,
                                      keep_logprobs=True, reference=side == "reference")
        out[side] = tokens, logprobs, torch.rand(3, generator=generator)
    return out


def assert_same(out):
    (tokens, logprobs, after), (tokens2, logprobs2, after2) = out["reference"], out["static"]
    assert torch.equal(tokens, tokens2)
    assert torch.allclose(logprobs, logprobs2, rtol=0, atol=1e-6)  # the same ops: equal here, rounding elsewhere
    assert torch.equal(after, after2)  # the noise source left where the reference loop leaves it


@pytest.mark.parametrize("params", [
    SamplingParams(max_new_tokens=21, temperature=0.7),
    SamplingParams(max_new_tokens=21, temperature=1.3, top_k=9, top_p=0.9),
    SamplingParams(max_new_tokens=21, greedy=True),
])
@pytest.mark.parametrize("seeded", ["generator", "global"])
@pytest.mark.parametrize("stop_ids", [(EOS,), (EOS, 5), None])
def test_static_decoder_equals_the_reference_loop(params, seeded, stop_ids):
    """A 64-token model, padded prompts of four lengths: every sampling mode, both noise sources, one or two
    stop ids or none (ignore_eos)."""
    model = tiny_qwen2(64, seed=1, pad_token_id=PAD, eos_token_id=EOS, tie_word_embeddings=True)
    prompt_ids, prompt_mask = left_pad([[5, 6, 7, 8, 9, 10], [3, 4], [11, 12, 13], [2, 3, 4, 5]] * 3, PAD)
    assert_same(both(model, prompt_ids, prompt_mask, params, stop_ids, seeded))


def test_static_decoder_stops_and_rewinds_the_noise_as_the_reference_does():
    """A 6-token model stops early (EOS is one token in six): every row ends before max_new_tokens at many
    different steps, inside a checked window and inside the last, unchecked one; each time the tokens, the
    log-probs and the global random state after decoding equal the reference's."""
    model = tiny_qwen2(6, seed=1, pad_token_id=PAD, eos_token_id=EOS, tie_word_embeddings=True)
    prompt_ids, prompt_mask = left_pad([[5, 4, 3], [2], [3, 4]], PAD)
    stopped_at = set()
    for seed in range(12):
        for max_new_tokens in (13, 30):
            params = SamplingParams(max_new_tokens=max_new_tokens)
            out = {}
            for side in ("reference", "static"):
                torch.manual_seed(seed)
                with torch.inference_mode():
                    tokens, logprobs = sample(model, prompt_ids, prompt_mask, params, (EOS,), PAD,
                                              keep_logprobs=True, reference=side == "reference")
                out[side] = tokens, logprobs, torch.rand(3)
            assert_same(out)
            length = int((out["reference"][0] != PAD).sum(dim=1).max())
            if length < max_new_tokens:
                stopped_at.add((length - 1) // decode.STOP_CHECK_EVERY)
    assert {0, 1} <= stopped_at  # stops in the first and second window of STOP_CHECK_EVERY tokens


def test_static_decoder_equals_the_reference_loop_under_bf16_autocast():
    """Under autocast the cache holds what the model gave it (float32 keys after the rotary embedding)."""
    model = tiny_qwen2(64, seed=3, pad_token_id=PAD, eos_token_id=EOS, tie_word_embeddings=True)
    prompt_ids, prompt_mask = left_pad([[5, 6, 7], [3, 4, 9, 9, 9], [11]], PAD)
    assert_same(both(model, prompt_ids, prompt_mask, SamplingParams(max_new_tokens=12), (EOS,), "generator",
                     autocast=True))


def test_unpadded_prompts_decode_the_same():
    """Prompts of one length: no attention mask at all, as transformers passes none."""
    model = tiny_qwen2(64, seed=4, pad_token_id=PAD, eos_token_id=EOS, tie_word_embeddings=True)
    prompt_ids = torch.randint(2, 64, (5, 7), generator=torch.Generator().manual_seed(0))
    assert_same(both(model, prompt_ids, torch.ones_like(prompt_ids), SamplingParams(max_new_tokens=10), (EOS,),
                     "global"))


def forward_calls(model, **kwargs) -> int:
    """How many times `generate` calls the model's own forward."""
    calls = [0]
    handle = model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    tokenizer = type("Tok", (), {"pad_token_id": PAD, "eos_token_id": EOS})
    prompt_ids, prompt_mask = left_pad([[5, 6], [7]], PAD)
    try:
        generate(model, tokenizer, prompt_ids, prompt_mask, SamplingParams(max_new_tokens=9, ignore_eos=True), **kwargs)
    finally:
        handle.remove()
    return calls[0]


def test_generate_uses_the_static_decoder_where_it_applies():
    """Supported: one forward of the model (the prompts'), the later tokens through rlhf.decode's step. Not
    supported (eager attention), or a stop rule of several processes: the reference loop, a forward per token."""
    model = tiny_qwen2(64, seed=1, pad_token_id=PAD, eos_token_id=EOS)
    assert decode.unsupported(model) is None
    assert forward_calls(model) == 1
    assert forward_calls(model, all_finished=lambda finished: bool(finished.all())) == 9
    eager = tiny_qwen2(64, seed=1, pad_token_id=PAD, eos_token_id=EOS, attn_implementation="eager")
    assert "'eager'" in decode.unsupported(eager)
    assert forward_calls(eager) == 9


def test_other_architectures_are_named_as_unsupported():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16))
    assert "GPT2LMHeadModel is not one of Qwen2ForCausalLM, LlamaForCausalLM" == decode.unsupported(model)


def test_llama_decodes_the_same():
    """Llama's layers (SmolLM2's kind: no q/k/v bias, its own rotary module) through the same step."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=PAD,
                                         eos_token_id=EOS, bos_token_id=None, max_position_embeddings=128)).eval()
    assert decode.unsupported(model) is None
    prompt_ids, prompt_mask = left_pad([[5, 6, 7, 8], [3, 4], [11, 12, 13]], PAD)
    assert_same(both(model, prompt_ids, prompt_mask, SamplingParams(max_new_tokens=15), (EOS,), "generator"))


@pytest.mark.slow
def test_compiled_step_agrees_with_the_reference_loop():
    """torch.compile's step (static shapes: attention over the whole cache, masked) on the CPU: ~30 s to compile
    on the project's 2-core machine. Greedy tokens equal; log-probs equal up to float rounding (the attention's
    reductions run over more, masked, positions)."""
    from rlhf.rollout import next_token

    model = tiny_qwen2(64, seed=1, pad_token_id=PAD, eos_token_id=EOS, tie_word_embeddings=True)
    prompt_ids, prompt_mask = left_pad([[5, 6, 7, 8, 9, 10], [3, 4], [11, 12, 13]], PAD)
    params = SamplingParams(max_new_tokens=20, greedy=True)
    with torch.inference_mode():
        tokens, logprobs = sample(model, prompt_ids, prompt_mask, params, (EOS,), PAD, keep_logprobs=True,
                                  reference=True)
        how = decode.Decoding(20, lambda l: next_token(l, params), 1.0, (EOS,), PAD, keep_logprobs=True)
        compiled, compiled_logprobs = decode.decode(model, prompt_ids, prompt_mask, how,
                                                    step_type=decode.CompiledTokenStep)
    assert torch.equal(tokens, compiled)
    assert torch.allclose(logprobs, compiled_logprobs, atol=1e-5)


@pytest.mark.parametrize("reference", [True, False])
def test_gradient_checkpointing_leaves_decoding_unchanged(reference):
    """rlhf.setup checkpoints layers by setting their own training flag; transformers before 5.2x then drops the
    KV cache in those layers even without gradients (5.17 does), which would leave the decoding without its past.
    generate turns the flag off while it decodes: the same tokens as the model without checkpointing."""
    import copy

    from rlhf.setup import enable_gradient_checkpointing

    # an untied, large-init model (tests/test_rollout.py's greedy one), whose tokens depend on their context
    model = tiny_qwen2(64, seed=2, pad_token_id=PAD, tie_word_embeddings=False, initializer_range=0.5)
    checkpointed = copy.deepcopy(model)
    enable_gradient_checkpointing(checkpointed)
    prompt_ids, prompt_mask = left_pad([[5, 6, 7, 8], [3, 4], [11, 12, 13]], PAD)
    tokenizer = type("Tok", (), {"pad_token_id": PAD, "eos_token_id": EOS})
    params = SamplingParams(max_new_tokens=12, greedy=True)
    rule = (lambda finished: bool(finished.all())) if reference else None  # a custom rule takes the reference loop
    plain = generate(model, tokenizer, prompt_ids, prompt_mask, params, all_finished=rule).response_ids
    ours = generate(checkpointed, tokenizer, prompt_ids, prompt_mask, params, all_finished=rule).response_ids
    assert torch.equal(plain, ours)
    assert all(layer.training for layer in checkpointed.model.layers)  # the flag is back for the update


@pytest.mark.parametrize("values", ["own", "float32"])
def test_compiled_step_under_autocast_takes_either_cache_dtype(values, monkeypatch):
    """Under bf16 autocast the compiled step writes its bf16 values into the cache in place, whatever dtype the
    prompt's cache gave it: bf16 on transformers 5.2x, float32 on 5.17 ("float32" makes the cache so here, as
    5.17 does). Compiled with the CPU's aot_eager backend (dynamo's graph, the eager kernels: seconds, not the
    inductor's ~30 s); the greedy tokens are the eager step's."""
    import functools

    from rlhf.rollout import next_token

    if values == "float32":
        build = decode.StaticCache.__init__

        def float32_values(self, prompt_cache, length, batch_size):
            build(self, prompt_cache, length, batch_size)
            self.values = [v.float() for v in self.values]

        monkeypatch.setattr(decode.StaticCache, "__init__", float32_values)
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    model = tiny_qwen2(64, seed=1, pad_token_id=PAD, eos_token_id=EOS, tie_word_embeddings=True)
    prompt_ids, prompt_mask = left_pad([[5, 6, 7, 8, 9, 10], [3, 4], [11, 12, 13]], PAD)
    params = SamplingParams(max_new_tokens=12, greedy=True)
    runs = {}
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for compiled in (False, True):
            how = decode.Decoding(12, lambda l: next_token(l, params), 1.0, (EOS,), PAD, keep_logprobs=True)
            runs[compiled] = decode.decode(model, prompt_ids, prompt_mask, how,
                                           step_type=decode.CompiledTokenStep if compiled else decode.TokenStep)
    assert torch.equal(runs[False][0], runs[True][0])
    assert torch.allclose(runs[False][1], runs[True][1], atol=0.05)  # bf16 matmuls over the masked, longer cache


@pytest.mark.parametrize("policy, threshold, expected", [
    ("PASSIVE", decode.ONE_THREAD_BELOW, 1),  # sleeping threads, small work: one thread
    ("passive", decode.ONE_THREAD_BELOW, 1),  # OpenMP reads the policy case-insensitively
    (None, decode.ONE_THREAD_BELOW, 2),  # the default policy spins: sharing pays, nothing changes
    ("ACTIVE", decode.ONE_THREAD_BELOW, 2),
    ("PASSIVE", "at", 2),  # batch x parameters exactly at the threshold: not below it
    ("PASSIVE", "just above", 1),
])
def test_decoding_takes_one_thread_where_sleeping_threads_would_cost_more(policy, threshold, expected, monkeypatch):
    """generate's decoding runs on one thread only under OMP_WAIT_POLICY=PASSIVE and below the work threshold (both
    sides of it), the thread count is set back afterwards, and the tokens are the same as with two threads."""
    model = tiny_qwen2(64, seed=1, pad_token_id=PAD, eos_token_id=EOS, tie_word_embeddings=True)
    work = 4 * sum(p.numel() for p in model.parameters())  # 4 prompts
    if threshold == "at":
        monkeypatch.setattr(decode, "ONE_THREAD_BELOW", work)
    elif threshold == "just above":
        monkeypatch.setattr(decode, "ONE_THREAD_BELOW", work + 1)
    if policy is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", policy)
    prompt_ids, prompt_mask = left_pad([[5, 6, 7], [3, 4], [11, 12, 13, 2], [2]], PAD)
    tokenizer, params = type("Tok", (), {"pad_token_id": PAD, "eos_token_id": EOS}), SamplingParams(9, ignore_eos=True, keep_logprobs=True)
    seen = []
    hook = model.get_output_embeddings().register_forward_pre_hook(lambda *_: seen.append(torch.get_num_threads()))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = generate(model, tokenizer, prompt_ids, prompt_mask, params,
                       generator=paired_noise_generator(7, 3, 0, "cpu"))
        assert torch.get_num_threads() == 2  # set back
    finally:
        torch.set_num_threads(before)
        hook.remove()
    assert seen == [expected] * 9  # the prompts' pass and every token's step
    monkeypatch.setattr(decode, "ONE_THREAD_BELOW", 0)  # never: the tokens as two threads draw them
    torch.set_num_threads(2)
    try:
        two = generate(model, tokenizer, prompt_ids, prompt_mask, params,
                       generator=paired_noise_generator(7, 3, 0, "cpu"))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(out.response_ids, two.response_ids)


@pytest.mark.parametrize("loop", ["static", "reference"])
@pytest.mark.parametrize("kept", ["none", "empty"])
def test_both_loops_refuse_a_prompt_pass_that_keeps_no_kv_cache(loop, kept, monkeypatch):
    """A prompt pass that gives back no KV cache, or an empty one (what gradient checkpointing in train mode leaves),
    stops either loop with the reason, instead of decoding every later token without its past."""
    model = tiny_qwen2(64, seed=1, pad_token_id=PAD, eos_token_id=EOS)
    name, forward = decode.kv_cache_name(model), model.forward

    @functools.wraps(forward)
    def dropping(*args, **kwargs):
        out = forward(*args, **kwargs)
        out[name] = None if kept == "none" else DynamicCache()
        return out

    prompt_ids, prompt_mask = left_pad([[5, 6, 7], [3, 4]], PAD)
    params = SamplingParams(max_new_tokens=4, greedy=True)
    with torch.inference_mode():
        tokens, _ = sample(model, prompt_ids, prompt_mask, params, (EOS,), PAD, reference=loop == "reference")
        assert tokens.shape == (2, 4)  # the same model decodes with its cache kept
        monkeypatch.setattr(model, "forward", dropping)
        with pytest.raises(RuntimeError, match="returned no KV cache; generation needs use_cache=True"):
            sample(model, prompt_ids, prompt_mask, params, (EOS,), PAD, reference=loop == "reference")


@pytest.mark.parametrize("autocast", [False, True])
def test_a_prompt_pass_in_sub_batches_decodes_the_same(autocast):
    """The prompts' forward in sub-batches of 1, 2, 5 (not dividing the 12 prompts: a short last one) and 12: the
    same tokens and log-probs as the whole batch at once, with the global random state left where it leaves it;
    the sub-batches of 5 include one without padding (transformers then passes SDPA no mask). The default is the
    whole batch in one forward."""
    model = tiny_qwen2(64, seed=2, pad_token_id=PAD, eos_token_id=EOS, tie_word_embeddings=False,
                       initializer_range=0.5)  # tokens that depend on their context
    prompts = [[5, 6, 7, 8, 9, 10], [3, 4], [11, 12, 13], [2, 3, 4, 5]] * 2 + [[7, 8, 9, 10, 11, 12]] * 4
    prompt_ids, prompt_mask = left_pad(prompts, PAD)
    params = SamplingParams(max_new_tokens=16, temperature=0.9)
    calls = []
    handle = model.register_forward_pre_hook(lambda _, args, kwargs: calls.append(len(kwargs["input_ids"])),
                                             with_kwargs=True)
    runs = {}
    for size in (None, 1, 2, 5, 12):
        torch.manual_seed(11)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            how = decode.Decoding(16, functools.partial(next_token, params=params), params.temperature, (EOS,), PAD,
                                  keep_logprobs=True, prefill_batch_size=size)
            runs[size] = (*decode.decode(model, prompt_ids, prompt_mask, how), torch.rand(3))
        assert calls == ([12] if size is None else [min(size, 12 - i) for i in range(0, 12, size)]), size
        calls.clear()
    handle.remove()
    for size, (tokens, logprobs, after) in runs.items():
        assert torch.equal(tokens, runs[None][0]), size
        assert torch.allclose(logprobs, runs[None][1], rtol=0, atol=1e-5), size
        assert torch.equal(after, runs[None][2])
    assert len({tuple(t.tolist()) for t in runs[None][0]}) > 4  # the rows' tokens differ: a row mixed up would show



def test_the_evaluation_runs_its_prompt_pass_in_sub_batches_and_logs_the_same(artifacts, tmp_path, monkeypatch):
    """data.val_prefill_batch_size reaches the prompt pass of the greedy evaluation (8 problems) and of the sampled
    one (2 answers each: 16 prompts), not the rollout's; every logged number is what the whole batch gives."""
    import os

    import train
    from helpers import assert_same_rows, tiny_overrides

    from rlhf.config import load_config
    from rlhf.tracking import read_metrics

    seen, prefill = [], decode.prefill

    def spy(model, prompt_ids, prompt_mask, position_ids, length, prefill_batch_size=None):
        seen.append((len(prompt_ids), prefill_batch_size))
        return prefill(model, prompt_ids, prompt_mask, position_ids, length, prefill_batch_size)

    monkeypatch.setattr(decode, "prefill", spy)
    runs = {}
    for size in (None, 3):
        out = str(tmp_path / str(size))
        extra = [] if size is None else [f"data.val_prefill_batch_size={size}"]
        train.main(load_config(None, tiny_overrides(artifacts, out, "trainer.val_samples=2", "trainer.logger=none",
                                                    *extra)))
        runs[size] = read_metrics(os.path.join(out, "metrics.jsonl"))
    assert {(8, 3), (16, 3), (8, None)} == set(seen) - {(16, None)}  # evaluation: 3 at a time; the rollout: all
    assert_same_rows(runs[3], runs[None])
