"""Sampled evaluation on held-out problems: pass@k and maj@k from n responses per problem.

    pass_at_k(n, c, k)          # Chen et al. 2021's unbiased estimator of P(one of k samples is right)
    majority_vote(answers)      # maj@n: the first response giving the most frequent final answer
    sampled_scores(correct, answers, sizes)   # one problem's pass@k for each k, then maj@n

The trainer's `evaluate` draws `trainer.val_samples` responses per problem at the sampling temperature and
logs `val/pass@k` for k = 1, 2, 4, ... up to n and `val/maj@n`, next to greedy `val/accuracy`. Whether a
response is right and what its final answer is come from the run's reward (rlhf.rewards.RewardFn:
`is_correct`, `answers`). pass@k minus pass@1 is the headroom RL can turn into pass@1: answers the policy
already finds, but not reliably.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """The unbiased pass@k of one problem from `num_samples` responses of which `num_correct` are right:
    1 - C(n - c, k) / C(n, k), the chance that k responses drawn without replacement from the n hold at least
    one right one (Chen et al. 2021, arXiv:2107.03374, eq. 1). Needs 1 <= k <= n."""
    if not 1 <= k <= num_samples:
        raise ValueError(f"pass@k needs 1 <= k <= num_samples, got k={k}, num_samples={num_samples}")
    if not 0 <= num_correct <= num_samples:
        raise ValueError(f"num_correct must be in [0, {num_samples}], got {num_correct}")
    if num_samples - num_correct < k:
        return 1.0
    return 1.0 - math.comb(num_samples - num_correct, k) / math.comb(num_samples, k)


def pass_at_k_sizes(num_samples: int) -> list[int]:
    """The k reported for n samples: the powers of two below n, and n itself (n = 8: 1, 2, 4, 8)."""
    return sorted({2**i for i in range(num_samples.bit_length()) if 2**i < num_samples} | {num_samples})


def majority_vote(answers: list[Hashable | None]) -> int | None:
    """The index of the first response that gives the most frequent final answer (answers compared with ==,
    so GSM8K's decimal values "5" and "5.00" vote together); responses without an answer (None) do not vote;
    a tie goes to the answer given first. None if nobody answered."""
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return None
    top = max(votes.values())
    return next(i for i, a in enumerate(answers) if a is not None and votes[a] == top)


def sampled_scores(correct: list[bool], answers: list[Hashable | None], sizes: list[int]) -> list[float]:
    """pass@k for each k in `sizes`, then maj@n, of one problem's n sampled responses, from whether each is
    right and its final answer: maj@n is 1 when a response giving the majority answer is right."""
    majority = majority_vote(answers)
    maj = 0.0 if majority is None else float(correct[majority])
    return [pass_at_k(len(correct), sum(correct), k) for k in sizes] + [maj]
