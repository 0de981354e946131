"""The trainer's advantage estimators in expectation, for the exact fixed points (lab.theory.fixed_points).

A policy-gradient step weights each sampled arm's grad log pi(x) by its advantage A. What the solver needs
from an estimator is, for every arm x, the expected advantage of a sample that landed on x,
E[A_1 | x_1 = x], since the expected policy gradient is sum_x pi_x E[A_1 | x_1 = x] grad log pi_x (by
symmetry over the group's samples). The models, by name (ADVANTAGES):

- "exact":  A = s_x - E_pi s, the idealised policy gradient (no sampling noise in the baseline);
- "rloo":   s_i minus the mean of the other n - 1 scores of its group (algorithm.adv_estimator=rloo);
- "grpo":   (s_i - group mean) / (group std + 1e-6), the unbiased std (adv_estimator=grpo);
- "drgrpo": s_i - group mean (adv_estimator=grpo with algorithm.norm_adv_by_std_in_grpo=false);
- "gae":    one step with gamma = lambda = 1 and a converged critic V = E_pi s, so A = s - E_pi s, then
            whitened over a batch large enough that its mean and variance are pi's (adv_estimator=gae).

For the group estimators `group_expected_advantages` is exact: x_1 = x and the counts of the other n - 1
samples (i.i.d. from pi) enumerated with their multinomial weights, each group's advantages by
core_algos.group_outcome_advantages' formulas (own_advantages; a group of one keeps its score).
`advantage_model` maps a run's config to a model; docs/kl.md, 'Where the advantage estimator moves the fixed
point', derives what each does.
"""

import math
from dataclasses import dataclass
from functools import lru_cache
from itertools import combinations

import torch

from rlhf import core_algos

ADVANTAGES = ("exact", "rloo", "grpo", "drgrpo", "gae")
GROUP_ADVANTAGES = ("rloo", "grpo", "drgrpo")
GROUP_STD_EPS = 1e-6  # added to the group's std by core_algos.group_outcome_advantages (its eps)
WHITEN_EPS = 1e-8  # added to the batch's variance by core_algos.masked_whiten (its eps)


def check_advantage(advantage: str, n: int | None) -> None:
    """Raise ValueError unless `advantage` is one of ADVANTAGES with a group size n >= 1 exactly when it is a
    group estimator (exact and gae take none: neither has groups)."""
    if advantage not in ADVANTAGES:
        raise ValueError(f"unknown advantage model {advantage!r}; valid: {', '.join(ADVANTAGES)}")
    if advantage in GROUP_ADVANTAGES:
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"advantage {advantage!r} needs the group size n, an int >= 1, got {n!r}")
    elif n is not None:
        raise ValueError(f"advantage {advantage!r} has no groups; n must be None, got {n!r}")


@dataclass(frozen=True)
class AdvantageModel:
    """The advantage estimator a fixed point assumes: `advantage` one of ADVANTAGES, `n` the group size of the
    group estimators (None for exact and gae). Checked on construction."""

    advantage: str = "exact"
    n: int | None = None

    def __post_init__(self):
        check_advantage(self.advantage, self.n)

    @property
    def label(self) -> str:
        """How the report names it: 'grpo, n=8', 'gae', 'exact'."""
        return self.advantage if self.n is None else f"{self.advantage}, n={self.n}"


def advantage_model(adv_estimator: str, norm_by_std: bool, n: int) -> AdvantageModel:
    """The model of a run's advantages from its config: algorithm.adv_estimator, algorithm.norm_adv_by_std_in_grpo
    and rollout.n. grpo is "grpo" or, without the std, "drgrpo"; rloo ignores norm_by_std and gae ignores both
    (it whitens over the whole batch), as the trainer does. Raises ValueError for an estimator the trainer does
    not have or this module does not model."""
    core_algos.check_adv_estimator(adv_estimator)
    if adv_estimator == "gae":
        return AdvantageModel("gae")
    if adv_estimator == "grpo":
        return AdvantageModel("grpo" if norm_by_std else "drgrpo", n)
    if adv_estimator == "rloo":
        return AdvantageModel("rloo", n)
    raise ValueError(f"no advantage model for adv_estimator={adv_estimator!r}; modelled: gae, grpo, rloo")


@lru_cache(maxsize=32)
def compositions(total: int, parts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every vector of `parts` nonnegative counts summing to `total`, (M, parts) float64 with
    M = C(total + parts - 1, parts - 1), and each one's log multinomial coefficient log(total! / prod c!) (M,).

    Stars and bars: the positions of parts - 1 bars among total + parts - 1 slots fix the counts between them.
    Cached (the solver asks for the same ones at every step); do not modify the tensors returned.
    """
    slots = total + parts - 1
    rows = [[b - a - 1 for a, b in zip((-1, *bars), (*bars, slots))] for bars in combinations(range(slots), parts - 1)]
    counts = torch.tensor(rows, dtype=torch.float64).reshape(-1, parts)
    log_coefficients = math.lgamma(total + 1) - torch.lgamma(counts + 1).sum(-1)
    return counts, log_coefficients


def own_advantages(others: torch.Tensor, scores: torch.Tensor, advantage: str) -> torch.Tensor:
    """The advantage of a sample on arm x whose group's other samples have counts c: others (M, K) counts c,
    scores (K,) -> (M, K), entry [m, x] for the group c_m + e_x of n = sum c + 1 samples. The formulas of
    core_algos.group_outcome_advantages, with the group written as counts C = c + e_x:

        centred_x = s_x - mean = sum_z C_z (s_x - s_z) / n = sum_z c_z (s_x - s_z) / n
                    (exactly 0 when every sample shares x's score: no rounding of a mean survives)
        grpo:   centred_x / (std + 1e-6), std^2 = sum_{y,z} C_y C_z (s_y - s_z)^2 / (2 n (n - 1)) the unbiased
                variance, also from score differences (= (Q(c) + 2 sum_z c_z (s_x - s_z)^2) / (2 n (n - 1)))
        drgrpo: centred_x;    rloo: n / (n - 1) * centred_x;    a group of one (n = 1): the score s_x itself.
    """
    n = int(others[0].sum().item()) + 1  # every group has the same size
    if n == 1:
        return scores.expand(len(others), -1)
    gaps = scores[:, None] - scores[None, :]  # (K, K): s_x - s_z
    centred = others @ gaps.T / n  # (M, K)
    if advantage == "drgrpo":
        return centred
    if advantage == "rloo":
        return centred * n / (n - 1)
    if advantage != "grpo":
        raise ValueError(f"unknown group advantage estimator {advantage!r}; valid: {', '.join(GROUP_ADVANTAGES)}")
    squares = others @ gaps ** 2  # (M, K): sum_z c_z (s_x - s_z)^2
    pairs = (squares * others).sum(-1, keepdim=True)  # (M, 1): Q(c) = sum_{y,z} c_y c_z (s_y - s_z)^2
    std = ((pairs + 2 * squares) / (2 * n * (n - 1))).sqrt()
    return centred / (std + GROUP_STD_EPS)


def group_expected_advantages(scores: torch.Tensor, logprobs: torch.Tensor, advantage: str, n: int) -> torch.Tensor:
    """E[A_1 | x_1 = x] for every arm x (K,), exactly, for a group of n samples from pi = exp(logprobs) (K,) with
    scores s (K,) and a group estimator of GROUP_ADVANTAGES.

    x_1 = x, and the other n - 1 samples have counts c ~ Multinomial(n - 1, pi): the sum over the C(n + K - 2,
    K - 1) compositions c of own_advantages(c)[x] weighted by P(c). Written as a conditional expectation (not
    E[A_1 1{x_1 = x}] / pi_x), it stays exact where pi_x underflows.
    """
    check_advantage(advantage, n)
    others, log_coefficients = compositions(n - 1, len(scores))  # (M, K), (M,)
    # an arm with pi = 0 (log -inf) gets a finite stand-in, so that its zero counts give 0 * log pi = 0, not NaN
    log_weights = log_coefficients + others @ logprobs.clamp_min(-1e300)  # (M,)
    return log_weights.exp() @ own_advantages(others, scores, advantage)


def whitening_scale(variance: torch.Tensor) -> torch.Tensor:
    """1 / sqrt(variance + 1e-8): what masked_whiten multiplies a batch's centred advantages by, once the batch
    is large enough that its (Bessel-corrected) variance is the population's `variance`."""
    return torch.rsqrt(variance + WHITEN_EPS)
