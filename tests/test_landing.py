"""The trainer lands where the theory says, on the synthetic tasks (rlhf/landing.py, rlhf/synthetic.py).

What Landing computes (the rewards of every arm through the configured reward function, the candidates, the
distances), and then one train.py run per claim family: k1 in the reward -> the reverse-KL optimum, k3 in the
loss -> the forward-KL optimum, k3+ in the loss -> the reverse one, k1 in the loss -> the argmax, and on the
tree k1 in the reward -> the sequence-level optimum, a KL loss -> the token-level one. A change to the trainer
that changes what is learned moves where a run lands.
"""

import json
import os
import uuid

import pytest
import torch
from accelerate import Accelerator

import train
from rlhf import synthetic
from rlhf.config import load_config
from rlhf.kl import fixed_points as fp
from rlhf.landing import Landing, start_landing
from rlhf.setup import setup
from rlhf.tracking import read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")
CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


def task_config(task, tmp_path, *overrides):
    return load_config(os.path.join(CONFIGS, f"{task}.yaml"),
                       [f"trainer.output_dir={tmp_path}/run", f"trainer.cache_dir={tmp_path.parent}/synthetic-cache",
                        "trainer.logger=none", *overrides])


def test_the_theory_uses_the_configured_reward(tmp_path, monkeypatch):
    """A user's reward (here: 1 for arm a2, else 0) is what Landing evaluates on every arm, and the fixed point
    of k1 in the reward is then the reverse-KL optimum of that reward."""
    monkeypatch.syspath_prepend(str(tmp_path))
    name = f"reward_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(
        "def only_a2(completions, completion_ids, **fields):\n"
        "    return [1.0 if ids == [3] else 0.0 for ids in completion_ids]\n")
    cfg = task_config("bandit", tmp_path, f"reward.function={name}:only_a2", "algorithm.use_kl_in_reward=true")
    run = setup(cfg, Accelerator(cpu=True))
    landing = start_landing(cfg, Accelerator(cpu=True), run)
    expected = torch.zeros(7, dtype=torch.float64)
    expected[3] = 1.0
    assert torch.equal(landing.rewards, expected)
    ref = synthetic.policy(run.models[0], "bandit")
    assert torch.equal(landing.ref, ref)
    rev = fp.reverse_kl_optimum(ref, expected, 0.3)
    assert fp.tv(landing.candidates["fixed_point"], rev) < 1e-10
    metrics = landing.metrics(run.models[0])  # the actor is still pi_ref
    assert metrics["theory/tv_to_reverse_optimum"] == pytest.approx(fp.tv(ref, rev), abs=1e-12)
    assert metrics["theory/kl"] == pytest.approx(0.0, abs=1e-12)
    assert metrics["theory/expected_reward"] == pytest.approx(ref[3].item(), abs=1e-12)


def test_the_fixed_point_follows_the_advantage_estimator(tmp_path):
    """k3+ in the loss: RLOO's fixed point is the reverse-KL optimum at the coefficient, Dr. GRPO's that at
    beta * n / (n - 1) (its group mean includes the sample itself), and Landing says which it assumes."""
    rloo = task_config("bandit", tmp_path, "actor.use_kl_loss=true", "actor.kl_loss_type=k3+")
    drgrpo = task_config("bandit", tmp_path, "actor.use_kl_loss=true", "actor.kl_loss_type=k3+",
                         "algorithm.adv_estimator=grpo", "algorithm.norm_adv_by_std_in_grpo=false")
    points = {}
    for label, cfg in (("rloo", rloo), ("drgrpo", drgrpo)):
        run = setup(cfg, Accelerator(cpu=True))
        landing = start_landing(cfg, Accelerator(cpu=True), run)
        points[label] = landing
    ref, rewards = points["rloo"].ref, points["rloo"].rewards
    assert fp.tv(points["rloo"].candidates["fixed_point"], fp.reverse_kl_optimum(ref, rewards, 0.3)) < 1e-9
    assert fp.tv(points["drgrpo"].candidates["fixed_point"], fp.reverse_kl_optimum(ref, rewards, 0.3 * 8 / 7)) < 1e-9
    assert points["rloo"].label == "k3+ in the loss, rloo (n = 8)"
    assert points["drgrpo"].label == "k3+ in the loss, grpo (n = 8)"


def landed(task, tmp_path, *overrides):
    """Train `task` with `overrides`; returns (theory.json, the metrics rows)."""
    cfg = task_config(task, tmp_path, *overrides)
    train.main(cfg)
    with open(os.path.join(cfg.trainer.output_dir, "theory.json"), encoding="utf-8") as f:
        record = json.load(f)
    return record, read_metrics(os.path.join(cfg.trainer.output_dir, "metrics.jsonl"))
