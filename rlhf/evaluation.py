"""Sampled evaluation on held-out problems: pass@k and maj@k from n responses per problem.

    counts = [sum(scores of problem i's n responses) for i in problems]
    pass_at_k(n, c, k)          # Chen et al. 2021's unbiased estimator of P(one of k samples is right)
    majority_answer(answers)    # maj@n: the most frequent final answer, scored like any response

The trainer's `evaluate` draws `trainer.val_samples` responses per problem at the sampling temperature and
logs `val/pass@k` for k = 1, 2, 4, ... up to n and `val/maj@n`, next to greedy `val/accuracy`. pass@k minus
pass@1 is the headroom RL can turn into pass@1: answers the policy already finds, but not reliably.
"""

from __future__ import annotations

import math
from collections import Counter
from decimal import Decimal


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


def majority_answer(answers: list[str | None]) -> str | None:
    """The most frequent final answer, compared as decimal values ("5" and "5.00" vote together); responses
    without an answer (None) do not vote; a tie goes to the answer given first. None if nobody answered."""
    votes = Counter(Decimal(a) for a in answers if a is not None)
    if not votes:
        return None
    top = max(votes.values())
    first = next(Decimal(a) for a in answers if a is not None and votes[Decimal(a)] == top)
    return str(first)


def sampled_scores(texts: list[str], ground_truth: str, method: str, sizes: list[int]) -> list[float]:
    """pass@k for each k in `sizes`, then maj@n, of one problem's n sampled responses `texts`."""
    from rlhf.rewards.gsm8k import compute_score, extract_solution

    num_correct = sum(compute_score(text, ground_truth, method) == 1.0 for text in texts)
    majority = majority_answer([extract_solution(text, method) for text in texts])
    maj = 0.0 if majority is None else compute_score(f"#### {majority}", ground_truth)
    return [pass_at_k(len(texts), num_correct, k) for k in sizes] + [maj]
