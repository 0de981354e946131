"""The claims a training comparison can show, each judged from paired differences over seeds.

docs/kl.md works out, exactly, which gradient each estimator x placement gives and where training by it
settles. A short, noisy training run can show some of that; this module lists what, and judges each claim
from the runs of a comparison:

    (a) k2, k3+, full and k3 in the loss hold the exact KL below no KL
    (b) k1 in the loss does not: its difference to no KL is small next to theirs
    (c) k1 in the reward holds it below no KL
    (d) k3 in the reward against k1 in the reward and against no KL (measured, no direction assumed: its
        bandit fixed point is the argmax, as without a KL, docs/kl.md "Where each estimator converges")
    (e) k2 and k3+ in the loss give the same run (every logged number at every step of every seed)
    crossover: k3 in the loss against k3+, in the forward and in the reverse KL: measured, no direction
        assumed. Which one holds which KL lower at the fixed point depends on the reward and the reference:
        with a 0/1 reward both optima keep the reference's ratios within each reward class, so whichever
        moves more mass to the rewarded tokens has more of both KLs (docs/kl.md, "The habit a forward KL
        keeps"); and a short run's per-token KL is over every token, not the states the analysis solves.

The number per seed is a KL averaged over the run's last LAST_STEPS steps (less noisy than one step's
batch); a difference is paired: run minus reference for each seed both have, then its mean over seeds and
95% t-interval (stats.paired_differences). It is resolved when the interval excludes 0, in the predicted
direction; *contradicted* when it excludes 0 in the other.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlhf.stats import MAX_SEEDS_ESTIMATE, Estimate, excludes_zero, paired_differences, seeds_needed

if TYPE_CHECKING:  # annotations only
    from lab.compare.runs import Group, Run

LAST_STEPS = 5  # each seed's KL: the mean over its last 5 steps
REVERSE, FORWARD = "kl/full", "kl/full_forward"  # exact KL(pi || ref) and KL(ref || pi), nats per token
REFERENCE = "no-kl"
HOLDERS = ("loss:k2", "loss:k3+", "loss:full", "loss:k3")  # claim (a): the losses with a KL gradient
# (e): the logged numbers that may differ between k2 and k3+ in the loss: the KL loss's own value (k3+ keeps
# k3's), and the clocks.
NOT_COMPARED = ("actor/kl_loss", "timing_s/", "perf/")


@dataclass(frozen=True)
class Claim:
    """One claim as measured: what it says, the difference it is judged on, the effect, the verdict."""

    name: str  # "(a)", "(b)", ..., "crossover"
    text: str  # what it claims, in words
    measure: str  # the difference measured, e.g. "kl/full: loss:k2 − no-kl"
    effect: str  # the measured effect: paired mean ± 95% half-width (seeds), or what was compared
    verdict: str  # "resolved", "not resolved (~N seeds)", "contradicted", "measured: lower", "not measured (why)"
    difference: Estimate | None = None  # the paired difference, where the claim is one


def late(key: str) -> Callable[[Run], float | None]:
    """A run -> the mean of `key` over its last LAST_STEPS steps (the claims' number per seed)."""
    return lambda run: run.late(key, LAST_STEPS)


def paired(groups: dict[str, Group], run: str, reference: str, key: str, number=None) -> Estimate:
    """The paired difference run − reference of `number(run)` (default: `late(key)`) over their common seeds."""
    number = number or late(key)
    return paired_differences(groups[run].per_seed(number), groups[reference].per_seed(number))


def effect_text(difference: Estimate, spec: str = "+.3f") -> str:
    """`-0.850 ± 0.210 (3 seeds)`; `+0.010 (1 seed)` without an interval."""
    if difference.n == 0:
        return "n/a (no common seeds)"
    mean = format(difference.mean, spec)
    if difference.half_width is None:
        return f"{mean} (1 seed)"
    return f"{mean} ± {format(difference.half_width, spec.lstrip('+'))} ({difference.n} seeds)"


def unresolved(difference: Estimate) -> str:
    """`not resolved (~N seeds)` with the seeds seeds_needed estimates from the paired spread."""
    if difference.n < 2:
        return "not resolved (1 seed: no interval)"
    needed = seeds_needed(difference)
    if needed is None:
        return "not resolved (no difference)"
    return f"not resolved (~{needed} seeds)" if needed <= MAX_SEEDS_ESTIMATE else f"not resolved (>{MAX_SEEDS_ESTIMATE} seeds)"


def verdict(difference: Estimate, expected: int | None) -> str:
    """The verdict on a paired difference predicted to be negative (expected -1), positive (+1), or measured
    without a prediction (None: `measured: lower` / `measured: higher` when resolved)."""
    if not excludes_zero(difference):
        return unresolved(difference)
    sign = 1 if difference.mean > 0 else -1
    if expected is None:
        return "measured: higher" if sign > 0 else "measured: lower"
    return "resolved" if sign == expected else "contradicted"


def _missing(groups: dict[str, Group], labels: tuple[str, ...], key: str) -> str | None:
    """Why a claim cannot be measured (a run absent, or `key` never logged), else None."""
    absent = [label for label in labels if label not in groups]
    if absent:
        return f"not measured (no {', '.join(absent)} run)"
    if any(late(key)(run) is None for label in labels for run in groups[label].runs):
        return f"not measured (no {key} logged)"
    return None


def difference_claim(groups: dict[str, Group], name: str, text: str, run: str, reference: str, key: str,
                     expected: int | None, number=None, when: str = "") -> Claim:
    """A claim that `run` − `reference` of `key` is negative (expected -1), positive (+1) or, with None, just
    measured; per seed `number(run)` (default: `late(key)`), `when` saying which value it is in the measure."""
    measure = f"{key}{when}: {run} − {reference}"
    missing = _missing(groups, (run, reference), key)
    if missing:
        return Claim(name, text, measure, "n/a", missing)
    difference = paired(groups, run, reference, key, number)
    return Claim(name, text, measure, effect_text(difference), verdict(difference, expected), difference)


def small_claim(groups: dict[str, Group]) -> Claim:
    """(b): k1 in the loss does not hold the exact KL down as (a)'s losses do. Its own difference to no KL is
    the effect, with its size as a fraction of the smallest of theirs; resolved when k1 in the loss ends
    above each of (a)'s runs (every paired interval k1 − that run above 0), said with where it ends against
    no KL when that resolves too; contradicted when it ends below one of them."""
    text = "k1 in the loss does not hold the exact KL below no KL: its difference is small next to (a)'s"
    measure = f"{REVERSE}: loss:k1 − no-kl; and loss:k1 − each of (a)"
    holders = tuple(label for label in HOLDERS if label in groups)
    missing = _missing(groups, ("loss:k1", REFERENCE), REVERSE) or (None if holders else "not measured (no (a) run)")
    if missing:
        return Claim("(b)", text, measure, "n/a", missing)
    own = paired(groups, "loss:k1", REFERENCE, REVERSE)
    theirs = {label: paired(groups, label, REFERENCE, REVERSE).mean for label in holders}
    smallest = min(theirs, key=lambda label: abs(theirs[label]))
    share = abs(own.mean) / abs(theirs[smallest]) if theirs[smallest] else float("inf")
    effect = f"{effect_text(own)}; {share:.0%} of (a)'s smallest ({smallest}: {theirs[smallest]:+.3f})"
    above = [paired(groups, "loss:k1", label, REVERSE) for label in holders]  # predicted > 0
    pending = [d for d in above if not (excludes_zero(d) and d.mean > 0)]
    if any(excludes_zero(d) and d.mean < 0 for d in above):
        result = "contradicted"
    elif not pending:  # and where k1 in the loss itself ends, when that resolves
        result = "resolved"
        if excludes_zero(own) and own.mean < 0:
            result += ": below no KL, by less than (a)'s runs"
        elif excludes_zero(own):
            result += ": above no KL" + (", by more than (a)'s smallest difference: not small" if share > 1 else "")
    else:  # the seeds the hardest of the pending differences needs (None: it would never resolve)
        result = unresolved(max(pending, key=lambda d: seeds_needed(d) or MAX_SEEDS_ESTIMATE + 2))
    return Claim("(b)", text, measure, effect, result, own)


def identical_claim(groups: dict[str, Group], a: str = "loss:k2", b: str = "loss:k3+") -> Claim:
    """(e): runs `a` and `b` log the same numbers, step by step, seed by seed (all but NOT_COMPARED).
    Resolved when every value is equal; contradicted with the first difference found."""
    text = "k2 and k3+ in the loss give the same run (identical per-sample gradients)"
    measure = f"every logged number of {a} and {b}, step by step, seed by seed"
    if a not in groups or b not in groups:
        return Claim("(e)", text, measure, "n/a", f"not measured (no {a if a not in groups else b} run)")
    runs_a, runs_b = ({run.seed: run for run in groups[label].runs} for label in (a, b))
    seeds = sorted(runs_a.keys() & runs_b.keys())
    compared = 0
    for seed in seeds:
        rows_a, rows_b = runs_a[seed].rows, runs_b[seed].rows
        if len(rows_a) != len(rows_b):
            return Claim("(e)", text, measure, f"seed {seed}: {len(rows_a)} against {len(rows_b)} logged steps",
                         "contradicted")
        for row_a, row_b in zip(rows_a, rows_b):
            keys = [k for k in row_a.keys() | row_b.keys() if not k.startswith(NOT_COMPARED)]
            for key in sorted(keys):
                if row_a.get(key) != row_b.get(key):
                    return Claim("(e)", text, measure, f"seed {seed}, step {row_a.get('step')}: {key} "
                                 f"{row_a.get(key)!r} against {row_b.get(key)!r}", "contradicted")
            compared += len(keys)
    if not seeds:
        return Claim("(e)", text, measure, "n/a", "not measured (no common seeds)")
    steps = len(runs_a[seeds[0]].rows)
    seeds_text = f"{len(seeds)} seed" + ("s" if len(seeds) > 1 else "")
    return Claim("(e)", text, measure, f"{compared} values equal ({seeds_text} × {steps} logged steps)", "resolved")


def claims(groups: list[Group]) -> list[Claim]:
    """Every claim, in the order of the module docstring, judged on `groups` (a comparison's runs)."""
    by_label = {group.label: group for group in groups}

    def below(name: str, text: str, run: str, reference: str = REFERENCE, key: str = REVERSE,
              expected: int | None = -1) -> Claim:
        return difference_claim(by_label, name, text, run, reference, key, expected)

    names = {"loss:k2": "k2", "loss:k3+": "k3+", "loss:full": "full", "loss:k3": "k3"}
    out = [below("(a)", f"{names[run]} in the loss holds the exact KL below no KL", run) for run in HOLDERS]
    out.append(small_claim(by_label))
    out.append(below("(c)", "k1 in the reward holds the exact KL below no KL", "reward:k1"))
    out.append(below("(d)", "k3 in the reward against k1 in the reward (fixed points: the argmax against the "
                            "reverse-KL optimum)", "reward:k3", "reward:k1", expected=None))
    out.append(below("(d)", "k3 in the reward against no KL (fixed points: the argmax for both)", "reward:k3",
                     expected=None))
    out.append(identical_claim(by_label))
    out.append(below("crossover", "k3 in the loss against k3+, forward KL (no direction derived for this reward)",
                     "loss:k3", "loss:k3+", FORWARD, expected=None))
    out.append(below("crossover", "k3+ against k3 in the loss, reverse KL (no direction derived for this reward)",
                     "loss:k3+", "loss:k3", REVERSE, expected=None))
    return out


def claims_table(results: list[Claim]) -> str:
    """Markdown: one row per claim: claim, measured difference, effect, verdict."""
    lines = ["| claim | measured (per seed: mean of the last steps) | effect (paired, mean ± 95% CI) | verdict |",
             "|---|---|---|---|"]
    for claim in results:
        lines.append(f"| {claim.name} {claim.text} | {claim.measure} | {claim.effect} | **{claim.verdict}** |")
    return "\n".join(lines)
