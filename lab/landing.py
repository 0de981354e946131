"""Where a run on a synthetic task (lab/synthetic.py) stands against the theory, exactly, every step.

    landing = Landing.for_run(cfg, actor, tokenizer, reward_fn, row)    # once, before the first update
    metrics.update(landing.metrics(actor))                             # every step: theory/*
    landing.write(os.path.join(out_dir, "theory.json"), actor)         # at the end

The policy is read off the actor's logits (lab.synthetic.policy: the bandit's pi, the tree's joint pi(a, b)),
so every number is exact, no sampling. The candidates, at the run's own KL coefficient:
- `fixed_point`: where the analysis says this run's estimator x placement x advantage estimator lands
  (lab.theory.fixed_points, with the trainer's advantage model: GRPO's std, Dr. GRPO's (n - 1) / n, ...);
- `reverse_optimum`: argmax E[r] - beta KL(pi || ref) (over the whole sequence for the tree);
- `forward_optimum`: argmax E[r] - beta KL(ref || pi) (over the joint for the tree);
- `argmax`: no regularisation;
- the tree also has `token_level_optimum` and `token_level_forward_optimum`: each token optimising its own
  regularised objective, which is what a KL loss reaches (docs/kl.md, 'Over a sequence').
The reward on every arm (every pair for the tree) comes from the configured reward function, called as the
trainer calls it, so a user's own reward gets its fixed point too. pi_ref is the actor before its first update
(the reference model's weights).

train.py imports this module for every run; the analysis, lab.theory, is imported inside the functions that
only a synthetic run calls, so that a GSM8K run never loads it.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

import torch

from lab import synthetic


def run_kl(cfg) -> tuple[str | None, str | None, float]:
    """(estimator, placement, beta) of a run: the one KL it trains with, (None, None, beta) without a KL; beta is
    the coefficient of whichever KL is on (the loss's when none is, for the candidates). Raises ValueError for a
    run with KL in both places, which the analysis does not model."""
    a, ac = cfg.algorithm, cfg.actor
    if a.use_kl_in_reward and ac.use_kl_loss:
        raise ValueError("the fixed points model one KL placement: set algorithm.use_kl_in_reward or "
                         "actor.use_kl_loss, not both, on a synthetic task")
    if a.use_kl_in_reward:
        return a.kl_penalty, "reward", a.kl_ctrl.kl_coef
    if ac.use_kl_loss and ac.kl_loss_off_policy_correction:
        # corrected (rho in the graph for k1, k3's gradient taken as k3+'s), k1's and k3's loss has the expected
        # gradient of KL(pi || ref) at every mini-batch, which k2 in the loss has on-policy (rlhf.kl's docstring)
        return "k2", "loss", ac.kl_loss_coef
    if ac.use_kl_loss:
        return ac.kl_loss_type, "loss", ac.kl_loss_coef
    return None, None, ac.kl_loss_coef


def arm_rewards(reward_score, task: str, vocab_size: int, prompt_ids: list[int], fields: dict) -> torch.Tensor:
    """The reward of every response, float64: (V,) for the bandit, (V, V) for the tree. `reward_score(
    prompt_ids, completion_ids, fields) -> (B,)` is the trainer's scoring of a batch (one row's fields, repeated)."""
    if task == "bandit":
        completions = [[t] for t in range(vocab_size)]
    else:
        completions = [[a, b] for a in range(vocab_size) for b in range(vocab_size)]
    rows = {key: [value] * len(completions) for key, value in fields.items()}
    scores = reward_score([prompt_ids] * len(completions), completions, rows)
    return torch.as_tensor(scores, dtype=torch.float64).reshape((vocab_size,) * synthetic.response_length(task))


def start_landing(cfg, accelerator, run) -> "Landing | None":
    """The run's Landing on a synthetic task (None otherwise), from `run` (rlhf.setup.Setup) as setup built it:
    its actor is pi_ref (built before any checkpoint is loaded), its reward the configured one, called on every
    response with the first training row's prompt and fields."""
    if synthetic.task_of(cfg) is None:
        return None
    from rlhf import rewards

    actor = accelerator.unwrap_model(run.models[0])
    row = run.train_set[0]
    fields = {key: value for key, value in row.items() if key not in rewards.PROMPT_COLUMNS}

    def reward_score(prompt_ids, completion_ids, fields):
        prompts = run.tokenizer.batch_decode(prompt_ids)
        return rewards.score(run.reward, run.tokenizer, prompts, completion_ids, fields)

    table = arm_rewards(reward_score, synthetic.task_of(cfg), actor.config.vocab_size, row["input_ids"], fields)
    return Landing.for_run(cfg, actor, table)


def fixed_point(task: str, ref: torch.Tensor, rewards: torch.Tensor, beta: float, estimator: str | None,
                placement: str | None, advantage: str, n: int | None,
                start: torch.Tensor | None = None) -> torch.Tensor:
    """Where the analysis says a run lands, shaped as ref ((V,), or the tree's joint (V, V)): the solver of
    lab.theory.fixed_points from pi_ref, or from the policy `start` (same shape) when given; the argmax without
    a KL (estimator None). advantage and n are the solver's advantage model."""
    from lab.theory.fixed_points import bandit_fixed_point, tree_fixed_point
    from lab.theory.optima import argmax_optimum

    if estimator is None:
        return argmax_optimum(ref.flatten(), rewards.flatten(), beta).view_as(ref)
    adv = dict(advantage=advantage, n=n)
    if task == "bandit":
        return bandit_fixed_point(ref, rewards, beta, estimator, placement, **adv, start=start)
    first = ref.sum(-1)
    begin = None
    if start is not None:  # a prefix the policy never takes keeps the reference's conditional (no direction there)
        start_first = start.sum(-1)
        begin = (start_first, torch.where(start_first[:, None] > 0, start / start_first[:, None], ref / first[:, None]))
    point_first, point_second = tree_fixed_point(first, ref / first[:, None], rewards, beta, estimator, placement,
                                                 **adv, start=begin)
    return point_first[:, None] * point_second


def fixed_point_from(record: dict, start: torch.Tensor) -> torch.Tensor:
    """fixed_point for the run that wrote `record` (theory.json), from the policy `start`: where the analysed
    dynamics go from there."""
    as_tensor = lambda key: torch.tensor(record[key], dtype=torch.float64)  # noqa: E731
    return fixed_point(record["task"], as_tensor("ref"), as_tensor("rewards"), record["beta"], **record["solver"],
                       start=start)


def _kl(p: torch.Tensor, q: torch.Tensor) -> float:
    return torch.where(p > 0, p * (p.log() - q.log()), 0.0).sum().item()


@dataclass
class Landing:
    """A synthetic run's pi_ref, rewards and candidate points, as joint distributions over responses."""

    task: str
    temperature: float
    ref: torch.Tensor  # (V,) or the tree's joint (V, V)
    rewards: torch.Tensor  # same shape
    beta: float
    label: str  # what `fixed_point` is: e.g. "k3 in the loss, rloo (n = 8)"
    solver: dict  # fixed_point's estimator, placement, advantage and n for this run
    candidates: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> distribution, same shape

    @classmethod
    def for_run(cls, cfg, actor, rewards: torch.Tensor) -> "Landing":
        """The candidates of this run's config, pi_ref read off `actor` (before its first update)."""
        from lab.theory.advantage_models import advantage_model
        from lab.theory.optima import (
            argmax_optimum,
            forward_kl_optimum,
            reverse_kl_optimum,
            sequence_optimum,
            token_level_optimum,
        )

        task, temperature = synthetic.task_of(cfg), cfg.rollout.temperature
        ref = synthetic.policy(actor, task, temperature)
        estimator, placement, beta = run_kl(cfg)
        a = cfg.algorithm
        model = advantage_model(a.adv_estimator, a.norm_adv_by_std_in_grpo, cfg.rollout.n)
        # RLOO's leave-one-out baseline is unbiased: its expected gradient is the exact one for any n
        # (tests/test_fixed_points.py checks the enumeration reaches the same point), so the solver skips the
        # enumeration over groups, which costs seconds on the tree.
        adv = dict(advantage="exact", n=None) if model.advantage == "rloo" else dict(advantage=model.advantage, n=model.n)
        solver = dict(estimator=estimator, placement=placement, **adv)
        candidates = {"fixed_point": fixed_point(task, ref, rewards, beta, **solver)}
        if task == "bandit":
            candidates["reverse_optimum"] = reverse_kl_optimum(ref, rewards, beta)
            candidates["forward_optimum"] = forward_kl_optimum(ref, rewards, beta)
            candidates["argmax"] = argmax_optimum(ref, rewards, beta)
        else:
            first = ref.sum(-1)
            second = ref / first[:, None]
            joint = lambda pair: pair[0][:, None] * pair[1]  # noqa: E731
            candidates["reverse_optimum"] = joint(sequence_optimum(first, second, rewards, beta))
            candidates["forward_optimum"] = forward_kl_optimum(ref.flatten(), rewards.flatten(), beta).view_as(ref)
            candidates["argmax"] = argmax_optimum(ref.flatten(), rewards.flatten(), beta).view_as(ref)
            candidates["token_level_optimum"] = joint(token_level_optimum(first, second, rewards, beta))
            candidates["token_level_forward_optimum"] = joint(
                token_level_optimum(first, second, rewards, beta, forward_kl_optimum))
        ac = cfg.actor
        where = "no KL" if estimator is None else f"{estimator} in the {placement}"
        if placement == "loss" and ac.kl_loss_off_policy_correction:
            where = f"{ac.kl_loss_type} in the loss, corrected (as k2 on-policy)"
        label = f"{where}, {a.adv_estimator}" + (f" (n = {cfg.rollout.n})" if a.adv_estimator != "gae" else "")
        return cls(task, temperature, ref, rewards, beta, label, solver, candidates)

    def metrics(self, actor) -> dict[str, float]:
        """theory/tv_to_<candidate> for each candidate, theory/kl (KL(pi || ref)), theory/kl_forward
        (KL(ref || pi)) and theory/expected_reward, of the actor's policy now."""
        from lab.theory.optima import tv

        pi = synthetic.policy(actor, self.task, self.temperature)
        out = {f"theory/tv_to_{name}": tv(pi, point) for name, point in self.candidates.items()}
        out["theory/kl"] = _kl(pi, self.ref)
        out["theory/kl_forward"] = _kl(self.ref, pi)
        out["theory/expected_reward"] = (pi * self.rewards).sum().item()
        return out

    def finish(self, output_dir: str, actor) -> dict:
        """`write` to <output_dir>/theory.json: the end of a run (rlhf.tasks.Task.step_metrics)."""
        return self.write(os.path.join(output_dir, "theory.json"), actor)

    def write(self, path: str, actor) -> dict:
        """theory.json: the task, beta, what the fixed point is and the solver's settings for it, pi_ref, the
        rewards, the final policy and each candidate as probabilities (nested lists), and the final metrics.
        Returns what it wrote."""
        pi = synthetic.policy(actor, self.task, self.temperature)
        record = {"task": self.task, "beta": self.beta, "fixed_point": self.label, "solver": self.solver,
                  "ref": self.ref.tolist(), "rewards": self.rewards.tolist(), "policy": pi.tolist(),
                  "candidates": {name: point.tolist() for name, point in self.candidates.items()},
                  "metrics": {k: v for k, v in self.metrics(actor).items() if math.isfinite(v)}}
        with open(path, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)
        return record
