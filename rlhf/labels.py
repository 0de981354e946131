"""Run labels: where a run's KL goes and which estimator, as text (`reward:k1`, `loss:k3+`, `no-kl`).

Both directions live here. A config -> its label: kl_tags and run_label, which train.py uses for its wandb
tags and the report for grouping the runs it reads back. A label -> the trainer overrides that make such a
run: parse_kl_tag and kl_overrides, which the grid uses. A label names each place the KL is on, joined by
" + " when there are two:

    reward:<estimator>           algorithm.use_kl_in_reward, algorithm.kl_penalty=<estimator>
    loss:<estimator>             actor.use_kl_loss, actor.kl_loss_type=<estimator>
    loss-corrected:<estimator>   the same KL loss, with actor.kl_loss_off_policy_correction
    no-kl                        neither
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlhf.kl import check_estimator

if TYPE_CHECKING:  # annotations only
    from rlhf.config import Config

PLACEMENTS = ("reward", "loss", "loss-corrected")


def kl_tags(cfg: Config) -> list[str]:
    """Where the KL is and which estimator, e.g. ["reward:k1", "loss:k3+"], or ["no-kl"]: the run's wandb
    tags, and joined by " + " its label in lab.compare and the sweep. A KL loss with the off-policy
    correction is `loss-corrected:<estimator>`."""
    tags = []
    if cfg.algorithm.use_kl_in_reward:
        tags.append(f"reward:{cfg.algorithm.kl_penalty}")
    if cfg.actor.use_kl_loss:
        placement = "loss-corrected" if cfg.actor.kl_loss_off_policy_correction else "loss"
        tags.append(f"{placement}:{cfg.actor.kl_loss_type}")
    return tags or ["no-kl"]


def run_label(cfg: Config) -> str:
    """"reward:k1", "loss:k3+", "reward:k1 + loss:k2" or "no-kl" (see kl_tags)."""
    return " + ".join(kl_tags(cfg))


def parse_kl_tag(tag: str) -> tuple[str, str | None]:
    """`reward:k1`, `loss:k3+`, `loss-corrected:k3` or `no-kl` -> (placement, estimator), ("none", None) for
    `no-kl`. Raises ValueError naming the valid forms, or the valid estimators."""
    if tag == "no-kl":
        return "none", None
    placement, sep, estimator = tag.partition(":")
    if not sep or placement not in PLACEMENTS:
        raise ValueError(f"run {tag!r} is not one of reward:<estimator>, loss:<estimator>, "
                         "loss-corrected:<estimator>, no-kl (e.g. no-kl, reward:k1, reward:k3).")
    check_estimator(estimator, allow_full=True)  # raises with the list of valid names
    return placement, estimator


def kl_overrides(placement: str, estimator: str | None = None) -> list[str]:
    """The trainer overrides that put the KL in `placement` ("none": nowhere) with `estimator`, and nowhere
    else: the inverse of kl_tags, whose result for them is [f"{placement}:{estimator}"] (["no-kl"])."""
    reward, loss = placement == "reward", placement in ("loss", "loss-corrected")
    corrected = placement == "loss-corrected"
    out = [f"algorithm.use_kl_in_reward={str(reward).lower()}", f"actor.use_kl_loss={str(loss).lower()}",
           f"actor.kl_loss_off_policy_correction={str(corrected).lower()}"]
    if reward:
        out.append(f"algorithm.kl_penalty={estimator}")
    if loss:
        out.append(f"actor.kl_loss_type={estimator}")
    return out


def legend_name(label: str) -> str:
    """`reward:k1` -> `KL in reward: k1`; `no-kl` -> `no KL` (the report's and the figure's name of a run)."""
    if label == "no-kl":
        return "no KL"
    return " + ".join(f"KL in {part.replace(':', ': ', 1)}" for part in label.split(" + "))
