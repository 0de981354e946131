"""Statistics over seeds: the mean of one number per seed and its 95% Student t interval; the paired
difference of two runs (per seed, then over seeds), whether its interval excludes 0, and roughly how many
seeds would tell. No scipy: t comes from a table."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

# Two-sided 95% critical values of Student's t (its 0.975 quantile) by degrees of freedom: the standard table,
# e.g. NIST/SEMATECH e-Handbook of Statistical Methods, section 1.3.6.7.2, rounded to 3 decimals.
# tests/test_compare.py recomputes each one by integrating the t density.
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
       11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
       20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048,
       29: 2.045, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980}
MAX_SEEDS_ESTIMATE = 1000  # seeds_needed looks no further


def t95(df: int) -> float:
    """The two-sided 95% critical value of Student's t with `df` >= 1 degrees of freedom. Between tabulated
    values (30 < df) that of the next smaller tabulated df: slightly too large, so intervals err wide (at most
    ~1%; the limit for df -> infinity is 1.960, df > 120 gets 1.980)."""
    if df < 1:
        raise ValueError(f"Student's t needs at least 1 degree of freedom, got {df}.")
    return T95[max(d for d in T95 if d <= df)]


@dataclass(frozen=True)
class Estimate:
    """One number per seed (a final KL, an accuracy, a mean bias, ...): their mean over seeds and its 95%
    interval, mean ± t95(n - 1) * sd / sqrt(n), with sd the sample standard deviation over the n seeds
    (n - 1 in its denominator). With one seed there is no interval (sd and half_width are None)."""

    values: tuple[float, ...]  # one per seed

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        """The mean over seeds; NaN without values."""
        return statistics.fmean(self.values) if self.values else math.nan

    @property
    def sd(self) -> float | None:
        """The sample standard deviation over seeds (n - 1 in the denominator); None with fewer than 2."""
        return statistics.stdev(self.values) if self.n >= 2 else None

    @property
    def half_width(self) -> float | None:
        """Half the width of the 95% interval of the mean, in the values' unit; None with fewer than 2 seeds."""
        return None if self.sd is None else t95(self.n - 1) * self.sd / math.sqrt(self.n)


def paired_differences(values: dict[int, float], reference: dict[int, float]) -> Estimate:
    """The paired difference of two runs over seeds: `values[s] - reference[s]` for every seed s that both
    have (in seed order), as an Estimate. Runs with the same seed see the same prompts and, with
    `rollout.paired_noise`, the same sampling noise, so the per-seed difference cancels what the seed does
    to both; its interval is that of the mean difference (a paired t-interval)."""
    return Estimate(tuple(values[s] - reference[s] for s in sorted(values.keys() & reference.keys())))


def excludes_zero(difference: Estimate) -> bool:
    """Whether a paired difference is resolved: it has a 95% interval and the interval excludes 0,
    |mean| > half_width (a paired t-test at 5%, two-sided). Differences equal for every seed (sd 0) are
    resolved unless they are all 0."""
    return difference.half_width is not None and abs(difference.mean) > difference.half_width


def seeds_needed(difference: Estimate) -> int | None:
    """Roughly how many seeds would resolve a paired difference if its mean and sd stayed as observed: the
    smallest n >= 2 with t95(n - 1) * sd / sqrt(n) < |mean| (the rule of excludes_zero with n seeds).
    None when it cannot be told: fewer than 2 seeds (no spread) or a mean of 0; MAX_SEEDS_ESTIMATE + 1 when
    more than MAX_SEEDS_ESTIMATE seeds would be needed."""
    if difference.sd is None or difference.mean == 0:
        return None
    for n in range(2, MAX_SEEDS_ESTIMATE + 1):
        if t95(n - 1) * difference.sd / math.sqrt(n) < abs(difference.mean):
            return n
    return MAX_SEEDS_ESTIMATE + 1
