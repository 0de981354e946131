"""The learning-rate schedules of actor and critic (`*.lr_scheduler_type`, `*.lr_warmup_steps`,
`*.min_lr_ratio`): the closed form, the lr the trainer logs and updates with at each PPO step, bad values
refused, the constant default training exactly as a plain optimizer, and an exact resume."""

import math
import os

import pytest
import torch
from helpers import NOT_COMPARED, assert_same_rows, tiny_overrides
from safetensors.torch import load_file

import rlhf.setup
import rlhf.step
import train
from rlhf.config import ConfigError, load_config, warnings_for
from rlhf.setup import build_lr_schedulers, lr_factor
from rlhf.tracking import read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")
LR = 1e-3  # tiny_overrides' actor.lr and critic.lr
# The tiny model scores 0 and starts equal to the reference: the entropy bonus gives the actor a gradient from
# step 1, and the KL it then has gives the critic non-zero returns, so both models' weights move.
MOVING = ("actor.entropy_coeff=0.01", "actor.use_kl_loss=true", "actor.kl_loss_type=k3+")


def run(artifacts, output_dir, *extra) -> list[dict]:
    train.main(load_config(None, tiny_overrides(artifacts, str(output_dir), "trainer.logger=none", *MOVING, *extra)))
    return read_metrics(os.path.join(output_dir, "metrics.jsonl"))


def test_lr_factor_is_the_closed_form():
    """Warmup k / W from step 1 (step W at the full lr), then the decay from the full lr at step W + 1 towards
    the floor, which it would reach one step after the last."""
    total, warmup, floor = 10, 2, 0.1
    for kind in ("constant", "linear", "cosine"):
        assert [lr_factor(k, total, kind, warmup, floor) for k in (1, 2, 3)] == [0.5, 1.0, 1.0]
    assert [lr_factor(k, total, "constant", warmup, floor) for k in range(3, 11)] == [1.0] * 8
    for k in range(3, 11):
        p = (k - 1 - warmup) / (total - warmup)
        assert lr_factor(k, total, "linear", warmup, floor) == pytest.approx(floor + (1 - floor) * (1 - p), abs=1e-15)
        assert lr_factor(k, total, "cosine", warmup, floor) == pytest.approx(
            floor + (1 - floor) * (1 + math.cos(math.pi * p)) / 2, abs=1e-15)
    assert lr_factor(10, total, "linear", warmup, floor) == pytest.approx(0.2125)  # p = 7/8: 0.1 + 0.9 / 8
    assert lr_factor(10, total, "cosine", warmup) == pytest.approx((1 + math.cos(7 * math.pi / 8)) / 2)  # 0.038
    assert [lr_factor(k, 4, "linear") for k in range(1, 6)] == [1.0, 0.75, 0.5, 0.25, 0.0]
    assert [lr_factor(k, 4, "cosine", 0, 0.2) for k in (1, 3, 5)] == pytest.approx([1.0, 0.6, 0.2])
    assert lr_factor(1, 1, "cosine") == 1.0 and [lr_factor(k, 3, "linear", 3) for k in (1, 2, 3)] == [1 / 3, 2 / 3, 1]


def test_the_schedulers_step_the_optimizers_lr_through_the_closed_form():
    """build_lr_schedulers on plain optimizers: before each step's update the optimizer holds lr x lr_factor."""
    cfg = load_config(None, ["trainer.total_steps=6", "actor.lr=0.5", "actor.lr_scheduler_type=cosine",
                             "actor.lr_warmup_steps=2", "critic.lr=0.25", "critic.lr_scheduler_type=linear",
                             "critic.min_lr_ratio=0.2"])
    opts = [torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr) for lr in (0.5, 0.25)]
    schedulers = build_lr_schedulers(cfg, *opts)
    seen = []
    for _ in range(6):
        seen.append([opt.param_groups[0]["lr"] for opt in opts])
        for opt, scheduler in zip(opts, schedulers):
            opt.step()
            scheduler.step()
    expected = [[0.5 * lr_factor(k, 6, "cosine", 2), 0.25 * lr_factor(k, 6, "linear", 0, 0.2)] for k in range(1, 7)]
    assert [lr for lrs in seen for lr in lrs] == pytest.approx([lr for lrs in expected for lr in lrs], rel=1e-15)
    assert build_lr_schedulers(cfg, opts[0], None)[1] is None


def test_each_step_logs_the_lr_its_updates_used(artifacts, tmp_path, monkeypatch):
    """actor cosine with warmup, critic linear with a floor, 4 steps: actor/lr and critic/lr follow the closed
    form and are what the optimizers held during that step's updates. Without a critic, no critic/lr."""
    used, original = [], rlhf.step.ppo_update

    def spy(cfg, plan, accelerator, run, *args):
        used.append([opt.param_groups[0]["lr"] for opt in run.optimizers if opt is not None])
        return original(cfg, plan, accelerator, run, *args)

    monkeypatch.setattr(rlhf.step, "ppo_update", spy)
    rows = run(artifacts, tmp_path / "gae", "trainer.total_steps=4", "actor.lr_scheduler_type=cosine",
               "actor.lr_warmup_steps=1", "actor.min_lr_ratio=0.1", "critic.lr_scheduler_type=linear",
               "critic.min_lr_ratio=0.5")
    assert len(used) == 4
    for row, lrs in zip(rows[1:], used):  # the lr the optimizers held when each step's updates began
        k = row["step"]
        assert row["actor/lr"] == pytest.approx(LR * lr_factor(k, 4, "cosine", 1, 0.1), rel=1e-12)
        assert row["critic/lr"] == pytest.approx(LR * lr_factor(k, 4, "linear", 0, 0.5), rel=1e-12)
        assert [row["actor/lr"], row["critic/lr"]] == lrs
    assert len({row["actor/lr"] for row in rows[1:]}) == 3 and len({row["critic/lr"] for row in rows[1:]}) == 4

    rows = run(artifacts, tmp_path / "grpo", "trainer.total_steps=1", "algorithm.adv_estimator=grpo", "rollout.n=2")
    assert rows[1]["actor/lr"] == LR and "critic/lr" not in rows[1] and used[-1] == [LR]


class NoSchedule:
    """Stands for no scheduler at all: nothing touches the optimizer's lr, as with a plain optimizer."""

    def __init__(self, opt):
        self.opt = opt

    def get_last_lr(self):
        return [group["lr"] for group in self.opt.param_groups]

    def step(self):
        pass

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def test_the_constant_default_trains_exactly_as_a_plain_optimizer(artifacts, tmp_path, monkeypatch):
    """3 steps with the default schedules and 3 with no scheduler touching the optimizers: the same weights
    of actor and critic, bit for bit, and the same logged numbers. (A linear schedule changes the weights, so
    the comparison sees the lr.)"""

    def weights_and_rows(name, *extra):
        rows = run(artifacts, tmp_path / name, "trainer.total_steps=3", "actor.ppo_epochs=2", *extra)
        saved = tmp_path / name / "checkpoints" / "step_3"
        return [load_file(saved / f) for f in ("model.safetensors", "model_1.safetensors")], rows

    default, default_rows = weights_and_rows("default")
    linear, _ = weights_and_rows("linear", "actor.lr_scheduler_type=linear", "critic.lr_scheduler_type=linear")
    with monkeypatch.context() as patch:
        patch.setattr(rlhf.setup, "build_lr_schedulers",
                      lambda cfg, actor_opt, critic_opt: (NoSchedule(actor_opt), NoSchedule(critic_opt)))
        plain, plain_rows = weights_and_rows("plain")
    for ours, theirs in zip(default, plain):
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    for ours, theirs in zip(default, linear):
        assert not all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert [{k: v for k, v in row.items() if not k.startswith(NOT_COMPARED)} for row in default_rows] == [
        {k: v for k, v in row.items() if not k.startswith(NOT_COMPARED)} for row in plain_rows]
    assert [row["actor/lr"] for row in default_rows[1:]] == [LR] * 3


def test_resume_restores_the_schedules_exactly(artifacts, tmp_path):
    """4 steps saving each, then a run resumed from step 2's checkpoint: steps 3 and 4 repeat the
    uninterrupted run (actor/lr and critic/lr, every other logged number, and the final weights)."""
    extra = ("trainer.total_steps=4", "trainer.save_freq=1", "trainer.max_ckpt_to_keep=5", "actor.ppo_epochs=2",
             "actor.lr_scheduler_type=cosine", "actor.lr_warmup_steps=1", "actor.min_lr_ratio=0.1",
             "critic.lr_scheduler_type=linear", "critic.lr_warmup_steps=2")
    full = run(artifacts, tmp_path / "full", *extra)
    step_2 = tmp_path / "full" / "checkpoints" / "step_2"
    assert {"custom_checkpoint_1.pkl", "custom_checkpoint_2.pkl"} <= set(os.listdir(step_2))  # the two schedules
    resumed = run(artifacts, tmp_path / "resumed", *extra, f"trainer.resume_from={step_2}")
    assert_same_rows(resumed, full[3:])
    assert [row["actor/lr"] for row in resumed] == [full[3]["actor/lr"], full[4]["actor/lr"]]
    assert resumed[0]["actor/lr"] == pytest.approx(LR * lr_factor(3, 4, "cosine", 1, 0.1), rel=1e-12)
    for name in ("model.safetensors", "model_1.safetensors"):
        ours, theirs = (load_file(tmp_path / d / "checkpoints" / "step_4" / name) for d in ("resumed", "full"))
        assert all(torch.equal(ours[k], theirs[k]) for k in ours), name


@pytest.mark.parametrize("overrides, needles", [
    (["actor.lr_scheduler_type=exponential"], ["'actor.lr_scheduler_type'", "'exponential'",
                                               "valid choices: constant, linear, cosine"]),
    (["critic.lr_scheduler_type=warmup_cosine"], ["'critic.lr_scheduler_type'", "constant, linear, cosine"]),
    (["actor.lr_warmup_steps=-1"], ["'actor.lr_warmup_steps'", ">= 0", "-1"]),
    (["trainer.total_steps=10", "critic.lr_warmup_steps=11"],
     ["critic.lr_warmup_steps=11", "trainer.total_steps=10", "at most 10"]),
    (["actor.min_lr_ratio=1.5"], ["'actor.min_lr_ratio'", "[0, 1]", "1.5"]),
    (["critic.min_lr_ratio=-0.1"], ["'critic.min_lr_ratio'", "[0, 1]", "-0.1"]),
    (["actor.lr_warmup_steps=2.5"], ["'actor.lr_warmup_steps'", "expects int"]),
])
def test_bad_schedule_settings_are_refused_with_the_valid_choices(overrides, needles):
    with pytest.raises(ConfigError) as refused:
        load_config(None, overrides)
    for needle in needles:
        assert needle in str(refused.value), (needle, str(refused.value))


def test_a_floor_without_a_decay_warns():
    assert any("actor.min_lr_ratio=0.1 with actor.lr_scheduler_type=constant" in w
               for w in warnings_for(load_config(None, ["actor.min_lr_ratio=0.1"])))
    assert warnings_for(load_config(None, ["actor.min_lr_ratio=0.1", "actor.lr_scheduler_type=cosine",
                                           "trainer.total_steps=10", "actor.lr_warmup_steps=10"])) == []
