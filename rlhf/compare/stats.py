"""Statistics over seeds: the mean of one number per seed, its 95% Student t interval, and whether two such
means differ beyond their intervals (and roughly how many seeds would tell). No scipy: t comes from a table."""

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
MAX_SEEDS_ESTIMATE = 1000  # seeds_to_resolve looks no further


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


def resolved(a: Estimate, b: Estimate) -> bool:
    """Whether the difference of the means of a and b is resolved: both have a 95% interval and the two
    intervals do not overlap, |mean_a - mean_b| > half_width_a + half_width_b."""
    if a.half_width is None or b.half_width is None:
        return False
    return abs(a.mean - b.mean) > a.half_width + b.half_width


def seeds_to_resolve(a: Estimate, b: Estimate) -> int | None:
    """Roughly how many seeds per run would resolve the difference of a and b if its size and the two runs'
    sample sds stayed as observed: the smallest n >= 2 with t95(n - 1) * (sd_a + sd_b) / sqrt(n) < |mean_a -
    mean_b| (the rule of `resolved` with n seeds on both sides; = 2 t sd / sqrt(n) with sd their mean).
    None when it cannot be told: a run with fewer than 2 seeds (no spread) or equal means;
    MAX_SEEDS_ESTIMATE + 1 when more than MAX_SEEDS_ESTIMATE seeds would be needed."""
    if a.sd is None or b.sd is None or a.mean == b.mean:
        return None
    difference, spread = abs(a.mean - b.mean), a.sd + b.sd
    for n in range(2, MAX_SEEDS_ESTIMATE + 1):
        if t95(n - 1) * spread / math.sqrt(n) < difference:
            return n
    return MAX_SEEDS_ESTIMATE + 1
