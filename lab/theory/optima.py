"""The analytic optima the fixed points are compared with, and which one each estimator x placement reaches.

Each optimum takes (ref_probs, rewards, beta) and works over the last dim, rows independent: the reverse-KL,
forward-KL and TV optima, the argmax, the stationary points of a nonnegative estimator in the reward
(`reward_stationary_point`), the tree's sequence-level and token-level optima, and the points the advantage
estimators move a KL loss to (`whitened_optimum`, `samuelson_point`). docs/kl.md, 'Where each estimator
converges' and 'Where the advantage estimator moves the fixed point', derives them. `PREDICTED` and the
`predicted_*` functions say which point a setting of fixed_points.py should reach; `tv` and `kl` measure how
far it is.
"""

import math

import torch

from rlhf.kl.estimators import canonical
from lab.theory.advantage_models import WHITEN_EPS, AdvantageModel
from lab.theory.fixed_points import token_penalty


def reverse_kl_optimum(ref_probs: torch.Tensor, rewards: torch.Tensor, beta: float) -> torch.Tensor:
    """argmax_pi E_pi[r] - beta KL(pi || ref): pi proportional to ref * exp(r / beta)."""
    return torch.softmax(ref_probs.log() + rewards / beta, -1)


def _bisect(fn, lo: torch.Tensor, hi: torch.Tensor, iterations: int = 100) -> torch.Tensor:
    """The root of fn, increasing on [lo, hi] with fn(lo) <= 0 <= fn(hi), elementwise."""
    for _ in range(iterations):
        mid = (lo + hi) / 2
        up = fn(mid) > 0
        lo, hi = torch.where(up, lo, mid), torch.where(up, mid, hi)
    return (lo + hi) / 2


def forward_kl_optimum(ref_probs: torch.Tensor, rewards: torch.Tensor, beta: float) -> torch.Tensor:
    """argmax_pi E_pi[r] - beta KL(ref || pi): pi_x = beta ref_x / (lam - r_x), lam in (max r, max r + beta] such
    that the pi_x sum to 1 (the stationarity r_x + beta ref_x / pi_x = lam)."""
    top = rewards.max(-1, keepdim=True).values
    mass = lambda lam: 1.0 - (beta * ref_probs / (lam - rewards)).sum(-1, keepdim=True)  # increasing in lam
    lam = _bisect(mass, top + 1e-300 + 1e-15 * top.abs(), top + beta)
    return beta * ref_probs / (lam - rewards)


def _corner(ref_probs: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """All the mass on the best-scoring tokens, shared among tied ones in ref's proportions (the flow keeps
    their ratio)."""
    best = torch.where(scores == scores.max(-1, keepdim=True).values, ref_probs, 0.0)
    return best / best.sum(-1, keepdim=True)


def argmax_optimum(ref_probs: torch.Tensor, rewards: torch.Tensor, beta: float) -> torch.Tensor:
    """argmax_pi E_pi[r], no regularisation: the best token (beta is unused)."""
    return _corner(ref_probs, rewards)


def tv_optimum(ref_probs: torch.Tensor, rewards: torch.Tensor, beta: float) -> torch.Tensor:
    """argmax_pi E_pi[r] - 2 beta TV(pi, ref), a linear programme: moving mass from x to the best token gains
    r* - r_x at a cost of 2 beta, so every token with r* - r_x > 2 beta gives it all its mass, the rest keep
    ref's (unique unless some r* - r_x == 2 beta or the best token is tied)."""
    best = rewards == rewards.max(-1, keepdim=True).values
    best = best & (best.cumsum(-1) == 1)  # the first best token
    kept = torch.where(rewards.max(-1, keepdim=True).values - rewards <= 2 * beta, ref_probs, 0.0)
    kept = torch.where(best, 0.0, kept)
    return torch.where(best, 1.0 - kept.sum(-1, keepdim=True), kept)


def _k3_inverse(y: torch.Tensor) -> torch.Tensor:
    """The d >= 0 with exp(-d) - 1 + d = y >= 0 (d = y + 1 + W_0(-exp(-1 - y)), Lambert W), by Newton from
    sqrt(2 y) + y / 3, close to the root for small and large y (residual ~1e-9 relative, the float64 floor)."""
    d = (2 * y).sqrt() + y / 3
    for _ in range(8):
        d = d - (torch.expm1(-d) + d - y) / -torch.expm1(-d)
    return torch.where(y > 0, d, 0.0)


# The increasing branch (d >= 0) of each nonnegative estimator's inverse, d = k^-1(y); `X+` has X's value.
_INVERSE = {"k2": lambda y: (2 * y).sqrt(), "k3": _k3_inverse, "abs": lambda y: y}


def reward_stationary_point(
    ref_probs: torch.Tensor, rewards: torch.Tensor, beta: float, estimator: str, support: torch.Tensor
) -> torch.Tensor:
    """The stationary point of a nonnegative estimator (k2, k3, abs or their `+`) in the reward on `support`
    (bool, (K,)), with every supported token above ref: r_x - beta k(d_x) = c there, d_x = k^-1((r_x - c)/beta)
    on the increasing branch, c fixed by normalisation; 0 off the support. Raises ValueError if none exists."""
    inverse = _INVERSE[canonical(estimator).rstrip("+")]

    def probs(c):
        y = ((rewards - c) / beta).clamp_min(0.0)
        return torch.where(support, ref_probs * inverse(y).exp(), 0.0)

    if not torch.isfinite(rewards[support]).all():
        raise ValueError("rewards on the support must be finite")
    top = rewards[support].min()  # c <= every supported reward, so that every y >= 0
    if probs(top).sum() > 1 + 1e-12:
        raise ValueError("no stationary point with every supported token above ref on this support")
    low = top - beta
    while probs(low).sum() < 1:  # terminates: the mass grows without bound as c falls
        low = top - 2 * (top - low)
    c = _bisect(lambda c: 1.0 - probs(c).sum(), low, top)  # mass decreases in c
    return probs(c)


def sequence_optimum(ref_first, ref_second, rewards, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """pi*(a, b) proportional to ref(a, b) exp(R(a, b) / beta), as (first (A,), second (A, A)): the second
    token's conditional is the bandit optimum, the first token's weights each a by exp(V_soft(a) / beta) with
    V_soft(a) = beta log sum_b ref(b|a) exp(R(a, b)/beta) = E_{pi*(.|a)}[R] - beta KL(pi*(.|a) || ref(.|a))."""
    soft_values = beta * torch.logsumexp(ref_second.log() + rewards / beta, -1)
    return reverse_kl_optimum(ref_first, soft_values, beta), reverse_kl_optimum(ref_second, rewards, beta)


def token_level_optimum(ref_first, ref_second, rewards, beta: float, optimum=reverse_kl_optimum):
    """Each token optimising its own regularised objective, as a KL loss does: second = optimum(ref(.|a), R(a, .)),
    first = optimum(ref_first, V) with V(a) = E_{second(.|a)}[R(a, .)], the second token's KL left out."""
    second = optimum(ref_second, rewards, beta)
    return optimum(ref_first, (second * rewards).sum(-1), beta), second



def _tilted(ref_probs: torch.Tensor, rewards: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """pi_t proportional to ref exp(t r) for each t (T,) -> (T, K), and std_{pi_t}(r) (T,)."""
    # r - max r: no large logits, so that ref's ratios among the best arms survive a large t exactly
    pi = torch.softmax(ref_probs.log() + t[:, None] * (rewards - rewards.max()), -1)
    return pi, (pi * (rewards - (pi * rewards).sum(-1, keepdim=True)) ** 2).sum(-1).sqrt()


def tilt_peak(ref_probs: torch.Tensor, rewards: torch.Tensor) -> float:
    """max over t >= 0 of t std_{pi_t}(r), pi_t proportional to ref exp(t r) (on a grid of t up to 1e3 / the
    rewards' range, fine enough for 3 decimals): a KL loss meets whitened advantages inside the simplex only
    where beta times it reaches 1 (whitened_optimum)."""
    t = torch.linspace(0, 1e3 / (rewards.max() - rewards.min()).item(), 200_001, dtype=torch.float64)
    return (t * _tilted(ref_probs, rewards, t)[1]).max().item()


def whitened_optimum(ref_probs: torch.Tensor, rewards: torch.Tensor, beta: float) -> torch.Tensor:
    """Where a KL loss with k2's gradient (k2, every X+, full) stops against whitened advantages, gae's
    c (r - E_pi r) with c = 1 / sqrt(std_pi(r)^2 + 1e-8) (and grpo's as n grows, less Samuelson's bound): the
    stationarity c (r_x - E r) = beta (d_x - E d) makes pi = pi_t, proportional to ref exp(t r), with
    t beta sqrt(std_{pi_t}(r)^2 + 1e-8) = 1, the reverse-KL optimum at beta_eff = beta sqrt(std^2 + 1e-8) of
    itself. From ref the flow stops at the smallest such t. If beta tilt_peak < 1 the only root is the
    whitening eps's, t ~ 1e4 / beta: the argmax, to float precision."""
    grid = torch.logspace(-3, 7, 4001, dtype=torch.float64)
    gap = lambda t: t * beta * (_tilted(ref_probs, rewards, t)[1] ** 2 + WHITEN_EPS).sqrt() - 1  # < 0 at t = 0
    first = int((gap(grid) > 0).nonzero()[0])  # the grid ends past 1e4 / beta: a root always lies below it
    low, high = grid[first - 1: first] if first else grid[:1] * 0, grid[first: first + 1]
    t = _bisect(gap, low, high)
    return _tilted(ref_probs, rewards, t)[0][0]


def samuelson_point(ref_probs: torch.Tensor, rewards: torch.Tensor, beta: float, n: int) -> torch.Tensor:
    """Where a KL loss with k2's gradient stops against grpo's std-normalised advantages, near the best arm:
    there a group holding another arm y is almost surely y among n - 1 best samples, whose standardised score
    is -(n - 1) / sqrt(n) (the most negative any of n scores can be, Samuelson's bound) whatever r_y, while the
    best arm's advantage goes to 0; against the loss's pull beta (d_y - d_best) every arm below the best reward
    stops at d_y - d_best = -(n - 1) / (beta sqrt(n)), the best ones keep ref's ratios. An approximation, exact
    as pi_y -> 0 (the groups with two other arms neglected); docs/kl.md quantifies it."""
    top = rewards == rewards.max(-1, keepdim=True).values
    return torch.softmax(ref_probs.log() - torch.where(top, 0.0, (n - 1) / (beta * math.sqrt(n))), -1)


# The analytic optimum each estimator x placement reaches where it has one (the rest: reward_stationary_point).
PREDICTED = {("k1", "reward"): reverse_kl_optimum, ("k1+", "reward"): reverse_kl_optimum,
             ("k1", "loss"): argmax_optimum, ("full", "reward"): argmax_optimum,
             ("k3", "loss"): forward_kl_optimum, ("abs", "loss"): tv_optimum}
PREDICTED.update({(name, "loss"): reverse_kl_optimum for name in ("k2", "k1+", "k3+", "abs+", "full")})
OPTIMUM_NAMES = {reverse_kl_optimum: "reverse KL", forward_kl_optimum: "forward KL", tv_optimum: "TV",
                 argmax_optimum: "argmax"}


def tv(p: torch.Tensor, q: torch.Tensor) -> float:
    """Total variation sum |p - q| / 2 over all entries."""
    return 0.5 * (p - q).abs().sum().item()


def kl(p: torch.Tensor, q: torch.Tensor) -> float:
    """KL(p || q) with 0 log 0 = 0. Never negative: for p = q the sum is float noise of either sign (machine-
    dependent), which would print as -0.000 on some machines."""
    return max(torch.where(p > 0, p * (p.log() - q.log()), 0.0).sum().item(), 0.0)


def predicted_bandit(ref_probs, rewards, beta: float, estimator: str, placement: str, probs: torch.Tensor):
    """(label, the analytic point) for a bandit row; for k2, k3, abs in the reward, the stationary point on
    the support `probs` reached (tokens above 1e-10)."""
    if (estimator, placement) in PREDICTED:
        optimum = PREDICTED[estimator, placement]
        return f"{OPTIMUM_NAMES[optimum]} optimum", optimum(ref_probs, rewards, beta)
    support = probs > 1e-10
    arms = ",".join(str(i) for i in support.nonzero().flatten().tolist())
    return f"stationary on {{{arms}}}", reward_stationary_point(ref_probs, rewards, beta, estimator, support)


def predicted_tree(ex: dict, estimator: str, placement: str, second_reached: torch.Tensor, first_reached):
    """(label, (first, second)) predicted for a tree row: the sequence optimum for k1 in the reward, a
    token-level optimum for a KL loss and `full` in the reward, per-state stationary points otherwise."""
    ref1, ref2, rewards, beta = ex["ref_first"], ex["ref_second"], ex["rewards"], ex["beta"]
    if estimator in ("k1", "k1+") and placement == "reward":
        return "sequence", sequence_optimum(ref1, ref2, rewards, beta)
    if placement == "loss":
        optimum = PREDICTED[estimator, placement]
        return f"token-level {OPTIMUM_NAMES[optimum]}", token_level_optimum(
            ref1, ref2, rewards, beta, optimum)
    if estimator == "full":  # each token's own penalty is constant; the first sees the second's state KL
        second = _corner(ref2, rewards)
        state_kl = torch.where(second > 0, second * (second.log() - ref2.log()), 0.0).sum(-1)
        return "corners", (_corner(ref1, (second * rewards).sum(-1) - beta * state_kl), second)
    second = torch.stack([reward_stationary_point(ref2[a], rewards[a], beta, estimator, second_reached[a] > 1e-10)
                          for a in range(len(ref1))])
    penalty = token_penalty(second.clamp_min(1e-300).log(), ref2, estimator, "reward")
    values = torch.where(second > 0, second * (rewards - beta * penalty), 0.0).sum(-1)
    first = reward_stationary_point(ref1, values, beta, estimator, first_reached > 1e-10)
    return "stationary per state", (first, second)


def predicted_with_advantage(ref_probs, rewards, beta: float, estimator: str, placement: str,
                             model: AdvantageModel) -> tuple[str, torch.Tensor | None]:
    """(label, the point derived for a row) on a bandit, or ("-", None) where none is derived (k3 with grpo or
    gae, whose clamp decides): PREDICTED's optimum at beta in the reward whatever the estimator, and in the loss
    at beta for exact and rloo, at beta n/(n-1) for drgrpo; for grpo and gae with a k2-gradient loss,
    samuelson_point and whitened_optimum."""
    optimum = PREDICTED.get((estimator, placement))
    k2_gradient = placement == "loss" and optimum is reverse_kl_optimum
    if placement == "reward" or model.advantage in ("exact", "rloo"):
        return f"{OPTIMUM_NAMES[optimum]} optimum, beta", optimum(ref_probs, rewards, beta)
    if model.advantage == "drgrpo":
        scaled = beta * model.n / (model.n - 1)
        return f"{OPTIMUM_NAMES[optimum]} optimum, beta n/(n-1) = {scaled:.3f}", optimum(ref_probs, rewards, scaled)
    if k2_gradient and model.advantage == "grpo":
        return "Samuelson's bound", samuelson_point(ref_probs, rewards, beta, model.n)
    if k2_gradient and model.advantage == "gae":
        return "whitened optimum", whitened_optimum(ref_probs, rewards, beta)
    return "-", None
