"""End to end, in-process: train.py's main() on a tiny local model and GSM8K-schema JSONL.

The model and data are written to disk first and loaded back by path, which is the hub code path.
"""

import glob
import json
import math
import os
import time
from types import SimpleNamespace

import pytest
import torch

from helpers import embedded_overrides, tiny_overrides

import rlhf.setup
import rlhf.step
import train
from rlhf.config import load_config
from rlhf.tracking import read_metrics

VERL_METRICS = [
    "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/grad_norm",
    "critic/vf_loss", "critic/vf_clipfrac", "critic/score/mean", "critic/rewards/mean",
    "critic/vf_explained_var", "response_length/mean", "response_length/clip_ratio",
    "timing_s/gen", "timing_s/ref", "timing_s/values", "timing_s/update_actor", "timing_s/update_critic",
    "timing_s/step", "perf/throughput",
]
KL_PANEL = ["kl/k1", "kl/k2", "kl/k3", "kl/abs", "kl/full"]


def run(artifacts, output_dir, *extra):
    cfg = load_config(None, tiny_overrides(artifacts, output_dir, *extra))
    train.main(cfg)
    return cfg, read_metrics(os.path.join(output_dir, "metrics.jsonl"))


def weights(model):
    return torch.cat([p.detach().flatten().float() for p in model.parameters()])


@pytest.mark.parametrize("placement", ["reward", "loss_k3+", "both_full"])
def test_end_to_end_placements(artifacts, tmp_path, placement, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    extra = {
        "reward": ["algorithm.use_kl_in_reward=true", "algorithm.kl_penalty=k1", "actor.use_kl_loss=false"],
        "loss_k3+": ["algorithm.use_kl_in_reward=false", "actor.use_kl_loss=true", "actor.kl_loss_type=k3+"],
        "both_full": ["algorithm.use_kl_in_reward=true", "algorithm.kl_penalty=full", "actor.use_kl_loss=true",
                      "actor.kl_loss_type=full", "algorithm.kl_ctrl.type=adaptive"],
    }[placement]
    out = str(tmp_path / "run")
    cfg, rows = run(artifacts, out, *extra)

    assert [r["step"] for r in rows] == [0, 1, 2]
    assert set(rows[0]) == {"step", "val/accuracy", "val/greedy_clip_ratio", "val/greedy_strict_accuracy",
                            "val/greedy_flexible_accuracy", "val/greedy_no_answer_rate"}
    assert "val/accuracy" in rows[-1]
    for row in rows[1:]:
        for key in VERL_METRICS + KL_PANEL:
            assert key in row and row[key] is not None and math.isfinite(row[key]), (key, row.get(key))
        assert ("actor/kl_loss" in row) == cfg.actor.use_kl_loss
        assert ("actor/kl_coef" in row) == cfg.actor.use_kl_loss
        assert ("actor/reward_kl_penalty" in row) == cfg.algorithm.use_kl_in_reward
        assert ("actor/reward_kl_penalty_coeff" in row) == cfg.algorithm.use_kl_in_reward
        # Exact KL is never negative; k3 and abs are per-sample non-negative.
        assert row["kl/full"] >= 0 and row["kl/k3"] >= 0 and row["kl/abs"] >= row["kl/k1"]
    if placement == "both_full":  # the reward penalty is the exact KL itself
        assert rows[1]["actor/reward_kl_penalty"] == pytest.approx(rows[1]["kl/full"], rel=1e-5)

    # The config was saved, and wandb wrote an offline run with the metrics.
    assert os.path.exists(os.path.join(out, "config.yaml"))
    # wandb >= 0.2x has no Python reader for offline runs: the history records in the run's .wandb file
    # carry each metric's name and its JSON value, so look for them there.
    run_files = glob.glob(os.path.join(out, "wandb", "offline-run-*", "run-*.wandb"))
    assert len(run_files) == 1, os.listdir(os.path.join(out, "wandb"))
    # wandb-core may still be flushing the file when finish() returns: poll (bounded) before judging.
    expected = [key.encode() for key in VERL_METRICS + KL_PANEL + ["val/accuracy"]]
    deadline = time.monotonic() + 60
    while True:
        content = open(run_files[0], "rb").read()
        missing = [key for key in expected if key not in content]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not missing


PARTS_REWARD = """
def parity(completions, ground_truth, **fields):
    return [float(int(truth) % 2 == 0) for truth in ground_truth]

def bonus(completions, **fields):
    return [1.0] * len(completions)
"""


def test_a_reward_of_named_parts_logs_each_part_and_shows_it_in_the_samples(artifacts, tmp_path, monkeypatch):
    """reward.functions with reward.weights: the score is the weighted sum of the parts, each part is logged per
    step and shown in every sample row; correctness (val/accuracy, a sample's `correct`) is the first part's
    alone: the constant bonus lifts every score to at least 1 (reward.correct_threshold) without counting as
    right. The parts are the parity of the reference answer (known, mixed 0 and 1) and a constant."""
    (tmp_path / "parts_reward.py").write_text(PARTS_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = str(tmp_path / "run")
    _, rows = run(artifacts, out, "reward.functions=[parts_reward:parity,parts_reward:bonus]",
                  "reward.weights=[2.0,1.0]", "trainer.logger=none", "trainer.log_samples=4",
                  "trainer.log_samples_freq=1")
    for row in rows[1:]:
        assert row["reward/bonus/mean"] == 1.0 and 0 < row["reward/parity/mean"] < 1
        assert row["critic/score/mean"] == pytest.approx(2 * row["reward/parity/mean"] + 1.0)
    assert 0 < rows[0]["val/accuracy"] < 1  # the parity share, not the bonus's 1
    samples = [json.loads(line) for line in open(os.path.join(out, "samples.jsonl"))]
    assert [(r["step"], r["split"]) for r in samples] == [
        (step, split) for step, split in [(0, "val"), (1, "train"), (2, "train"), (2, "val")] for _ in range(4)]
    for sample in samples:
        assert set(sample) == {"step", "split", "prompt", "response", "reward", "reward/parity", "reward/bonus",
                               "correct", "length", "cut"}
        assert sample["reward"] == 2 * sample["reward/parity"] + 1.0
        assert sample["correct"] == (sample["reward/parity"] == 1.0)
        assert sample["prompt"].endswith("assistant\n") and 0 < sample["length"] <= 16
        assert not sample["cut"] or sample["length"] == 16  # cut: at data.max_response_length
    assert {s["correct"] for s in samples} == {True, False}


def test_a_run_does_not_depend_on_whether_the_embedded_cache_existed(tmp_path, monkeypatch):
    """The same config twice: first building the embedded cache (which draws random numbers), then reading
    it. Every logged number of the two runs agrees (timings aside)."""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    rows = []
    for name in ("cold", "warm"):
        embedded = SimpleNamespace(model_dir="embedded", train_file="embedded", val_file="embedded")
        train.main(load_config(None, tiny_overrides(embedded, str(tmp_path / name), *embedded_overrides(),
                                                    f"trainer.cache_dir={tmp_path / 'cache'}", "trainer.logger=none")))
        rows.append([{k: v for k, v in row.items() if not k.startswith(("timing_s", "perf"))}
                     for row in read_metrics(tmp_path / name / "metrics.jsonl")])
    # exact: the same code on the same shapes in one process (the cache is built on one thread and the caller's
    # thread count restored, so both runs train on the same number of threads)
    assert len(rows[0]) == 3 and rows[0] == rows[1]


def test_reference_is_frozen_during_training(artifacts, tmp_path, monkeypatch):
    """Wrap main()'s model loading to keep handles on the live actor and reference."""
    seen = {}
    original = rlhf.setup.prepare_data_and_models

    def spy(cfg, accelerator):
        out = original(cfg, accelerator)
        seen["actor"], seen["ref"] = out[3], out[5]
        seen["actor_start"], seen["ref_start"] = weights(out[3]), weights(out[5])
        return out

    monkeypatch.setattr(rlhf.setup, "prepare_data_and_models", spy)
    # An untrained model scores 0 and starts equal to the reference (all KL terms 0): the entropy bonus
    # is what gives the actor a gradient here.
    run(artifacts, str(tmp_path / "run"), "trainer.logger=none", "actor.use_kl_loss=true",
        "actor.kl_loss_type=k2", "actor.entropy_coeff=0.1")
    assert torch.equal(weights(seen["ref"]), seen["ref_start"])
    assert not any(p.requires_grad for p in seen["ref"].parameters())  # no gradient is ever kept for it
    assert not torch.equal(weights(seen["actor"]), seen["actor_start"])


def test_bf16_autocast_makes_no_float32_copy_of_the_logits(artifacts, tmp_path, monkeypatch):
    """trainer.mixed_precision=bf16 over float32 weights, as the GPU recipe: the logits stay bfloat16, and
    float32 is made a chunk of rows at a time (rlhf.core_algos.LOGITS_CHUNK_ROWS, here 64; kl.full_kl's 256).
    A micro-batch has 8 x 65 rows of logits, so a float32 copy of it, or float32 logits from a forward outside
    autocast, would show up as more than 256 rows."""
    from accelerate.state import AcceleratorState
    from transformers import AutoConfig

    from rlhf import core_algos
    from rlhf.tracking import Float32LogitsWatch

    monkeypatch.setattr(core_algos, "LOGITS_CHUNK_ROWS", 64)
    AcceleratorState._reset_state(True)  # mixed precision is fixed once per process; other tests run without
    try:
        with Float32LogitsWatch(AutoConfig.from_pretrained(artifacts.model_dir).vocab_size) as watch:
            _, rows = run(artifacts, str(tmp_path / "run"), "trainer.mixed_precision=bf16", "trainer.logger=none",
                          "data.max_response_length=64", "actor.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size=8",
                          "rollout.log_prob_micro_batch_size=8", "algorithm.use_kl_in_reward=true",
                          "actor.use_kl_loss=true", "actor.kl_loss_type=full")
    finally:
        AcceleratorState._reset_state(True)
    assert watch.rows == 256, (watch.rows, watch.shape, watch.op)  # full_kl's chunks, and nothing larger
    assert all(math.isfinite(rows[-1][key]) for key in KL_PANEL + ["actor/pg_loss", "actor/kl_loss"])


CRITIC_METRICS = ["critic/vf_loss", "critic/vf_clipfrac", "critic/vf_explained_var", "critic/grad_norm",
                  "timing_s/values", "timing_s/update_critic"]


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_critic_free_estimators_run_resume_and_refuse_another_estimators_checkpoint(artifacts, tmp_path, estimator,
                                                                                   capsys):
    """No critic is built, logged or checkpointed; resuming from step 1 reproduces step 2 of the uninterrupted
    run; a gae run refuses the checkpoint, before any model loads, naming both estimators."""
    extra = [f"algorithm.adv_estimator={estimator}", "rollout.n=2", "actor.use_kl_loss=true", "actor.kl_loss_type=k3+",
             "algorithm.use_kl_in_reward=false", "trainer.logger=none", "trainer.save_freq=1", "trainer.max_ckpt_to_keep=5"]
    out = str(tmp_path / "full")
    _, rows = run(artifacts, out, *extra)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows[1:]:
        assert not [key for key in CRITIC_METRICS if key in row]
        assert row["critic/advantages/min"] <= row["critic/advantages/mean"] <= row["critic/advantages/max"]
        assert 0.0 <= row["critic/groups_with_equal_scores"] <= 1.0 and math.isfinite(row["actor/kl_loss"])
    step_1 = os.path.join(out, "checkpoints", "step_1")
    assert sorted(f for f in os.listdir(step_1) if "model" in f or "optimizer" in f) == ["model.safetensors",
                                                                                        "optimizer.bin"]

    resumed = str(tmp_path / "resumed")
    _, again = run(artifacts, resumed, *extra, f"trainer.resume_from={step_1}")
    assert again[-1]["step"] == 2
    for key, value in rows[-1].items():
        if not key.startswith(("timing_s/", "perf/")):
            assert again[-1][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key

    code = train.cli(tiny_overrides(artifacts, str(tmp_path / "gae"), "trainer.logger=none",
                                    f"trainer.resume_from={step_1}"))
    err = capsys.readouterr().err
    assert code == 2 and f"algorithm.adv_estimator={estimator}" in err and "algorithm.adv_estimator=gae" in err



@pytest.mark.parametrize("paired", [True, False])
def test_paired_noise_seeds_each_steps_sampling_by_seed_step_and_process(artifacts, tmp_path, monkeypatch, paired):
    """rollout.paired_noise: every step's sampling noise comes from paired_noise_generator(seed, step, process
    index), which the sampler really draws from (the responses change when the generator's seed does)."""
    from rlhf.rollout import paired_noise_generator

    calls, used = [], []

    def recording(seed, step, process_index, device):
        calls.append((seed, step, process_index))
        return paired_noise_generator(seed, step, process_index, device)

    real_sample = rlhf.step.generate

    def sample(*args, **kwargs):
        seq = real_sample(*args, **kwargs)
        used.append(seq.response_ids.clone())
        return seq

    monkeypatch.setattr(rlhf.step, "paired_noise_generator", recording)
    monkeypatch.setattr(rlhf.step, "generate", sample)
    run(artifacts, str(tmp_path / "a"), f"rollout.paired_noise={str(paired).lower()}", "trainer.logger=none",
        "trainer.seed=7")
    assert calls == ([(7, 1, 0), (7, 2, 0)] if paired else [])
    if paired:  # the same steps again, with step 2's noise seeded like step 1's: step 2's samples change
        first = used[:]
        calls.clear(), used.clear()
        monkeypatch.setattr(rlhf.step, "paired_noise_generator",
                            lambda seed, step, process_index, device: paired_noise_generator(seed, 1, process_index, device))
        run(artifacts, str(tmp_path / "b"), "rollout.paired_noise=true", "trainer.logger=none", "trainer.seed=7")
        assert torch.equal(used[0], first[0]) and not torch.equal(used[1], first[1])
