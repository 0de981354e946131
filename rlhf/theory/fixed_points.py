"""Where training converges for each KL estimator x placement: exact fixed points, by enumeration.

A softmax policy is trained by its exact expected gradient (a sum over the tokens, no sampling) from
pi = pi_ref until it stops moving, on
- a K-armed bandit (`bandit_fixed_point`): reward r_x, coefficient beta;
- a two-step tree (`tree_fixed_point`): a ~ pi(a), then b ~ pi(b | a), reward R(a, b) at the end, the KL
  estimator applied to both tokens.
Placements are the trainer's. "reward": the per-token penalty -beta * k(x), detached, is part of the reward
and reaches each token through its return (gamma = lambda = 1: the first token's return includes the second
token's penalty). "loss": the task reward drives the policy gradient and beta * k(x; theta) is a loss term
whose expected gradient is grad sum_x sg(pi_x) k(x; theta), with kl_penalty's straight-through `+` rule.
Per-token values and derivatives come from kl_penalty (and full_kl for `full`), so the fixed points are those
of the module the trainer runs, clamps included.

The policy-gradient term follows an advantage model (`advantage=`, rlhf.kl.advantage_models): by default the
idealised A_x = r_x - E_pi r ("exact", which RLOO's leave-one-out baseline gives exactly in expectation), or
the trainer's rloo, grpo (divided by the group's std), drgrpo (grpo without the std), each over groups of n
enumerated exactly, or gae (a converged critic, whitened over a large batch). `fixed_point_for_config` and
`tree_fixed_point_for_config` take a run's config values instead (`advantage_model`).

The solver follows the natural gradient (per state, the expected gradient divided by pi, which is the
advantage A_x - E_pi[A]): it has the plain gradient's fixed points (pi_x (A_x - E_pi A) = 0 for all x iff
A_x - E_pi A = 0 wherever pi_x > 0) and the same stable ones, and it reaches corners geometrically, not at the
plain gradient's 1/t. Each token's step halves when its direction flips (an overshoot) and grows while it
does not, no logit moves more than _MAX_MOVE per step, and a token at a kink of its penalty (abs in the loss,
at pi = ref) is held there while the subgradient condition holds (_ascend). Where several stable points exist
(k2, k3, abs in the reward) the one reached depends on the path, and this path is not a network's under
Adam: the tests check what every stable point satisfies. The analytic optima to compare with are below
(`*_optimum`); docs/kl.md, 'Where each estimator converges', derives them, and 'Where the advantage estimator
moves the fixed point' what the advantage models change. `fixed_point_report()` and `advantage_report()` are
printed by `python -m rlhf.kl`.
"""

import math

import torch

from rlhf.kl.advantage_models import (
    GROUP_ADVANTAGES,
    WHITEN_EPS,
    AdvantageModel,
    advantage_model,
    group_expected_advantages,
    whitening_scale,
)
from rlhf.kl.estimators import canonical, check_estimator, kl_penalty, needs_logits
from rlhf.kl.exact import full_kl

# The rows of the report (any name kl_penalty takes, and `full`, is accepted; `k2+` is `k2`).
ESTIMATORS = ("k1", "k2", "k3", "abs", "k1+", "k3+", "abs+", "full")
PLACEMENTS = ("reward", "loss")

_STEP = 0.5  # initial step on the logits, in units of 1/beta (1/beta solves 'reward: k1' in one step)
_MAX_STEP = 1e6  # the longest step, in units of 1/beta (a bound, so that a step times h = 0 stays 0)
_MAX_MOVE = 0.5  # the most any logit moves in one step
# Logits stay within _FLOOR of their state's max: a dying token keeps pi >= ~e^-60 instead of underflowing to 0,
# where the estimators are infinite and the gradient NaN.
_FLOOR = 60.0
MAX_STEPS = 20_000
TOL = 1e-14  # converged when no probability moves by more than this in one step


def token_penalty(logits: torch.Tensor, ref_probs: torch.Tensor, estimator: str, placement: str) -> torch.Tensor:
    """p(x) for every token x, (..., K) -> (..., K): the KL term's share of the advantage, A_x = r_x - beta p(x).

    reward: p = k(x), the estimator's value (the trainer's detached penalty); for `full`, the state's exact KL.
    loss: p = dk(x)/dlogprob(x) from autograd through kl_penalty (`X+`: k2's d), since the loss term's expected
    gradient is pi * (p - E_pi p); for `full`, the exact gradient of full_kl divided by pi.
    """
    logprobs = torch.log_softmax(logits.detach(), dim=-1)
    if needs_logits(estimator):
        leaf = logits.detach().requires_grad_(True)
        kl = full_kl(leaf, ref_probs.log())  # (...)
        if placement == "reward":
            return kl.detach().unsqueeze(-1).expand_as(logits)
        (grad,) = torch.autograd.grad(kl.sum(), leaf)
        return grad / logprobs.exp()
    leaf = logprobs.requires_grad_(True)
    k = kl_penalty(leaf, ref_probs.log(), estimator)
    if placement == "reward":
        return k.detach()
    (dk,) = torch.autograd.grad(k.sum(), leaf)  # elementwise estimator: the per-token derivative
    return dk


def _check(ref_probs: torch.Tensor, beta: float, estimator: str, placement: str) -> None:
    check_estimator(estimator, allow_full=True)
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown placement {placement!r}; valid: {', '.join(PLACEMENTS)}")
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta!r}")
    if not (ref_probs > 0).all() or not torch.allclose(ref_probs.sum(-1), torch.ones((), dtype=ref_probs.dtype)):
        raise ValueError("reference distributions must be positive and sum to 1 over the last dim")


def _one_sided(ref_probs: torch.Tensor, estimator: str, placement: str) -> tuple[torch.Tensor, torch.Tensor]:
    """token_penalty just below and just above pi = ref (d = -/+1e-9), to find kinks there (abs's sign(d))."""
    if needs_logits(estimator):
        zero = torch.zeros_like(ref_probs)
        return zero, zero
    sides = []
    for d in (-1e-9, 1e-9):
        leaf = (ref_probs.log() + d).requires_grad_(True)
        k = kl_penalty(leaf, ref_probs.log(), estimator)
        sides.append(k.detach() if placement == "reward" else torch.autograd.grad(k.sum(), leaf)[0])
    return sides[0], sides[1]


def _pin(z: torch.Tensor, pinned: torch.Tensor, ref_probs: torch.Tensor) -> torch.Tensor:
    """Logits with pi = ref exactly on the pinned tokens, the free tokens' relative odds unchanged."""
    all_pinned = pinned.all(-1, keepdim=True)
    free_mass = torch.where(all_pinned, 1.0, 1.0 - (ref_probs * pinned).sum(-1, keepdim=True))
    log_free = torch.logsumexp(torch.where(pinned, -torch.inf, z), -1, keepdim=True)
    log_free = torch.where(all_pinned, 0.0, log_free)
    return torch.where(pinned, ref_probs.log() + log_free - free_mass.log(), z)


def _start_logits(probs: torch.Tensor) -> torch.Tensor:
    """Logits of `probs` (..., K), each state's max at 0 and none below -_FLOOR (a probability 0 included)."""
    z = probs.log()
    return (z - z.max(-1, keepdim=True).values).clamp_min(-_FLOOR)


def _ascend(advantages, refs: list[torch.Tensor], beta: float, kinks: list, max_steps: int, tol: float,
            measure=None, start: list[torch.Tensor] | None = None):
    """Natural-gradient ascent z += eta * (A - E_pi A) on each state's logits until no probability moves by > tol.

    `advantages(logits) -> [(base, p)]`, one pair per logits tensor, each token's expected advantage being
    A = base - beta * p: base is what the policy-gradient term gives a sample of that token (its reward, or an
    advantage estimator's E[A | token]), p the KL loss's share (or the penalty in the reward). `measure(probs)`
    returns the probabilities whose moves decide convergence (default: every state's own). The ascent starts
    from pi_ref, or from the probabilities `start` (one per tensor of refs). `kinks` holds each tensor's
    _one_sided penalties. Where p jumps at pi = ref (abs in the loss) the flow slides along pi_x = ref_x while
    E_pi[A] over the other tokens stays within the jump (the subgradient condition); plain steps would chatter
    across the kink, so such a token is pinned to ref once it crosses it and freed when the condition fails.
    Returns the probabilities; raises RuntimeError after max_steps.
    """
    logits = [ref.log() for ref in refs] if start is None else [_start_logits(p) for p in start]
    probs = [torch.softmax(z, -1) for z in logits]
    steps = [torch.full_like(z, _STEP / beta) for z in logits]
    previous = [torch.zeros_like(z) for z in logits]
    pinned = [torch.zeros_like(z, dtype=torch.bool) for z in logits]
    kinked = [(below - above).abs() > 1e-6 for below, above in kinks]
    sides = [torch.zeros_like(z) for z in logits]  # sign of d = log pi - log ref at the previous iterate
    # From a start near a corner, a token at the floor moves its probability by ~e^-60 a step even while its logit
    # climbs, which passes for converged: the ascent then runs at least twice the steps a logit needs to climb
    # from the floor at _MAX_MOVE a step.
    min_steps = 0 if start is None else 2 * math.ceil(_FLOOR / _MAX_MOVE)
    for step_index in range(max_steps):
        new_logits, hs = [], []
        for i, (base, p) in enumerate(advantages(logits)):
            (below, above), pi, pin = kinks[i], probs[i], pinned[i]
            for _ in range(2):  # E_pi[A] over the free tokens; again if a token was just freed
                free_pi = torch.where(pin, 0.0, pi)
                free_mass = free_pi.sum(-1, keepdim=True)
                mean = (free_pi * (base - beta * p)).sum(-1, keepdim=True) / free_mass.clamp_min(1e-300)
                # every token pinned (pi = ref): E_pi[A] is free to lie in every token's interval, if they overlap
                low = torch.where(pin, base - beta * above, -torch.inf).max(-1, keepdim=True).values
                high = torch.where(pin, base - beta * below, torch.inf).min(-1, keepdim=True).values
                mean = torch.where(free_mass > 0, mean, (low + high) / 2)
                pin = pin & (base - beta * above <= mean) & (mean <= base - beta * below)
            h = torch.where(pin, 0.0, base - beta * p - mean)
            step = steps[i]
            step[h * previous[i] < 0] *= 0.5  # overshoot: halve this token's step
            step[h * previous[i] > 0] *= 1.2  # same direction again: lengthen it (to _MAX_MOVE a step)
            step.clamp_(max=_MAX_STEP / beta)
            z = logits[i] + (step * h).clamp(-_MAX_MOVE, _MAX_MOVE)
            side = torch.sign(torch.log_softmax(z, -1) - refs[i].log())
            pin = pin | (kinked[i] & (side * sides[i] < 0))
            z = _pin(z, pin, refs[i]) if pin.any() else z
            z = z - z.max(-1, keepdim=True).values
            new_logits.append(z.clamp_min(-_FLOOR))
            hs.append(h)
            pinned[i], sides[i] = pin, torch.where(pin, 0.0, side)  # a pinned token sits on ref: no side
        new_probs = [torch.softmax(z, -1) for z in new_logits]
        seen, before = (new_probs, probs) if measure is None else (measure(new_probs), measure(probs))
        moved = max((p - q).abs().max().item() for p, q in zip(seen, before))
        logits, probs, previous = new_logits, new_probs, hs
        if moved <= tol and step_index >= min_steps:
            return probs
    raise RuntimeError(f"not converged after {max_steps} steps (a probability still moved by {moved:.3g})")


def _model(advantage: str, n: int | None) -> AdvantageModel:
    return AdvantageModel(advantage, n)  # checks the name and the group size


def _bandit_advantages(model: AdvantageModel, logits, rewards, beta: float, penalty, placement: str):
    """(base, p) for _ascend on the bandit, (K,) each: a sample on arm x has expected advantage base_x - beta p_x,
    up to a constant (which the natural gradient drops).

    A group estimator sees the score s = r - beta k (reward) or r (loss), so in the reward the penalty is inside
    base; a KL loss's p is never scaled by the advantage estimator. exact and gae: A = c (s - E_pi s), c = 1 or
    GAE's whitening scale (with s's variance under pi), written as (c r, c k) in the reward.
    """
    if model.advantage in GROUP_ADVANTAGES:
        scores = rewards - beta * penalty if placement == "reward" else rewards
        base = group_expected_advantages(scores, torch.log_softmax(logits, -1), model.advantage, model.n)
        return (base, torch.zeros_like(penalty)) if placement == "reward" else (base, penalty)
    scale = 1.0
    if model.advantage == "gae":
        scores = rewards - beta * penalty if placement == "reward" else rewards
        pi = torch.softmax(logits, -1)
        scale = whitening_scale((pi * (scores - (pi * scores).sum()) ** 2).sum())
    return (scale * rewards, scale * penalty) if placement == "reward" else (scale * rewards, penalty)


def bandit_fixed_point(
    ref_probs: torch.Tensor, rewards: torch.Tensor, beta: float, estimator: str, placement: str,
    max_steps: int = MAX_STEPS, tol: float = TOL, *, advantage: str = "exact", n: int | None = None,
    start: torch.Tensor | None = None,
) -> torch.Tensor:
    """The policy (K,) that training by exact expected gradients reaches from pi_ref on a K-armed bandit.

    ref_probs, rewards: (K,) float64; estimator in ESTIMATORS, placement "reward" or "loss" (module docstring);
    advantage the trainer's advantage estimator (advantage_models.ADVANTAGES, default the idealised
    r_x - E_pi r) and n its group size (rloo, grpo, drgrpo only). A corner is reached to ~1e-14 (a dying
    probability shrinks geometrically until it moves by less than tol). `start` (K,), a policy to start from
    instead of pi_ref: where the same dynamics go from there (from a stable point, nowhere). Raises
    RuntimeError if not converged within max_steps.
    """
    _check(ref_probs, beta, estimator, placement)
    model = _model(advantage, n)

    def advantages(logits):
        (z,) = logits
        return [_bandit_advantages(model, z, rewards, beta, token_penalty(z, ref_probs, estimator, placement),
                                   placement)]

    kinks = [_one_sided(ref_probs, estimator, placement)]
    (probs,) = _ascend(advantages, [ref_probs], beta, kinks, max_steps, tol,
                       start=None if start is None else [start])
    return probs


def _tree_advantages(model: AdvantageModel, z1, z2, ref_first, ref_second, rewards, beta: float, estimator: str,
                     placement: str):
    """[(base, p) for the first token (A,), (base, p) for the second (A, A)], as _bandit_advantages.

    exact and gae work per token, with gamma = lambda = 1 and a converged critic: the first token's advantage
    is its return minus V(root), the second's its return minus V(a), so the first sees the second's penalty in
    the reward and not in the loss; gae scales both by one whitening scale, that of both tokens' advantages
    pooled (a large batch, every sequence two tokens). A group estimator scores the sequence (R minus both
    penalties in the reward), so a joint arm (a, b), with pi(a, b) = pi(a) pi(b | a), gets
    base = E[A_1 | (a_1, b_1) = (a, b)], and the first token E_{b ~ pi(.|a)} of it.
    """
    p1, p2 = (token_penalty(z, ref, estimator, placement) for z, ref in ((z1, ref_first), (z2, ref_second)))
    second_probs = torch.softmax(z2, -1)
    if model.advantage in GROUP_ADVANTAGES:
        scores = rewards - beta * (p1[:, None] + p2) if placement == "reward" else rewards
        joint_logprobs = torch.log_softmax(z1, -1)[:, None] + torch.log_softmax(z2, -1)
        second = group_expected_advantages(scores.flatten(), joint_logprobs.flatten(), model.advantage,
                                           model.n).view_as(rewards)
        first = (second_probs * second).sum(-1)
        if placement == "reward":
            return [(first, torch.zeros_like(p1)), (second, torch.zeros_like(p2))]
        return [(first, p1), (second, p2)]
    # what the first token's return sees of the second: R minus its penalty in the reward, R alone otherwise
    after = rewards - beta * p2 if placement == "reward" else rewards
    first = (second_probs * after).sum(-1)  # (A,)
    scale = 1.0
    if model.advantage == "gae":
        first_probs = torch.softmax(z1, -1)
        own = beta * p1[:, None] if placement == "reward" else 0.0
        first_returns = after - own  # (A, A): G_1 = R - beta (k1 + k2) in the reward, R in the loss
        first_var = (first_probs[:, None] * second_probs * (first_returns - (first_probs * (
            second_probs * first_returns).sum(-1)).sum()) ** 2).sum()
        second_var = (first_probs[:, None] * second_probs * (after - first[:, None]) ** 2).sum()
        scale = whitening_scale((first_var + second_var) / 2)
    if placement == "reward":
        return [(scale * first, scale * p1), (scale * rewards, scale * p2)]
    return [(scale * first, p1), (scale * rewards, p2)]


def tree_fixed_point(
    ref_first: torch.Tensor, ref_second: torch.Tensor, rewards: torch.Tensor, beta: float, estimator: str,
    placement: str, max_steps: int = MAX_STEPS, tol: float = TOL, *, advantage: str = "exact",
    n: int | None = None, start: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(first (A,), second (A, A)) that training reaches from pi_ref on the two-step tree; second[a] is pi(. | a).

    ref_first (A,), ref_second (A, A) with rows summing to 1, rewards R(a, b) (A, A); advantage, n and start
    (here a pair (first, second)) as in bandit_fixed_point (_tree_advantages says what each sees). With the
    default, in the reward, the first token's advantage is its own penalty plus the second token's expected
    return (R minus its penalty); in the loss, it is E_{b ~ pi(.|a)} R(a, b) minus its own KL term only.
    Raises RuntimeError if not converged.
    """
    _check(ref_first, beta, estimator, placement)
    _check(ref_second, beta, estimator, placement)
    model = _model(advantage, n)

    def advantages(logits):
        z1, z2 = logits
        return _tree_advantages(model, z1, z2, ref_first, ref_second, rewards, beta, estimator, placement)

    kinks = [_one_sided(ref, estimator, placement) for ref in (ref_first, ref_second)]
    # grpo's advantages are scale-free: every continuation of a prefix the policy no longer visits is a lone
    # outlier in its group, -(n - 1) / sqrt(n) whatever its score (up to the std's 1e-6), so that state's
    # conditional is left without a direction (training's gradient there is pi(a) times it, 0): converged
    # is then judged on pi(a, b), what training sees.
    measure = (lambda probs: [probs[0][:, None] * probs[1]]) if model.advantage == "grpo" else None
    first, second = _ascend(advantages, [ref_first, ref_second], beta, kinks, max_steps, tol, measure,
                            None if start is None else list(start))
    return first, second


def fixed_point_for_config(
    ref_probs: torch.Tensor, rewards: torch.Tensor, beta: float, estimator: str, placement: str,
    adv_estimator: str, norm_by_std: bool, n: int,
) -> torch.Tensor:
    """bandit_fixed_point (K,) for a run's config: estimator and beta its KL's, placement "reward"
    (algorithm.use_kl_in_reward) or "loss" (actor.use_kl_loss), then algorithm.adv_estimator,
    algorithm.norm_adv_by_std_in_grpo and rollout.n (advantage_model)."""
    model = advantage_model(adv_estimator, norm_by_std, n)
    return bandit_fixed_point(ref_probs, rewards, beta, estimator, placement, advantage=model.advantage, n=model.n)


def tree_fixed_point_for_config(
    ref_first: torch.Tensor, ref_second: torch.Tensor, rewards: torch.Tensor, beta: float, estimator: str,
    placement: str, adv_estimator: str, norm_by_std: bool, n: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """tree_fixed_point (first (A,), second (A, A)) for a run's config, as fixed_point_for_config."""
    model = advantage_model(adv_estimator, norm_by_std, n)
    return tree_fixed_point(ref_first, ref_second, rewards, beta, estimator, placement, advantage=model.advantage,
                            n=model.n)


def tree_plain_flow(
    ref_first: torch.Tensor, ref_second: torch.Tensor, rewards: torch.Tensor, beta: float, estimator: str,
    placement: str, *, advantage: str = "exact", n: int | None = None, lr: float = 0.2, steps: int = 5_000,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(first (A,), second (A, A)) after `steps` steps of plain gradient ascent from pi_ref on tabular logits:
    z += lr * (the expected gradient), the first token's pi(a) (A(a) - E A), the second's pi(a) pi(b | a)
    (A(a, b) - E A(a, .)), each A = base - beta p of tree_fixed_point's advantage model.

    It has tree_fixed_point's fixed points but not its path: a state's conditional moves with the share pi(a)
    of the samples that visit it (the natural gradient moves every state at full speed), so a prefix the policy
    leaves early keeps its reference conditional, and a setting with several stable points may reach another
    of them. A plain-gradient path approaches a corner at 1/t, so this is a point after a finite time, never
    converged there; docs/results.md ('The tree') compares it with the trainer's end points.
    """
    _check(ref_first, beta, estimator, placement)
    _check(ref_second, beta, estimator, placement)
    model = _model(advantage, n)
    z1, z2 = ref_first.log().clamp_min(-_FLOOR), ref_second.log().clamp_min(-_FLOOR)
    for _ in range(steps):
        (base1, p1), (base2, p2) = _tree_advantages(model, z1, z2, ref_first, ref_second, rewards, beta, estimator,
                                                    placement)
        first, second = torch.softmax(z1, -1), torch.softmax(z2, -1)
        a1, a2 = base1 - beta * p1, base2 - beta * p2
        z1 = z1 + lr * first * (a1 - (first * a1).sum())
        z2 = z2 + lr * first[:, None] * second * (a2 - (second * a2).sum(-1, keepdim=True))
    return torch.softmax(z1, -1), torch.softmax(z2, -1)


# ----------------------------------------------------------------------------------------------------------
# The analytic optima (docs/kl.md, 'Where each estimator converges'), over the last dim, rows independent.


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

# ----------------------------------------------------------------------------------------------------------
# The report: docs/kl.md's tables, on one bandit and one tree.

# The highest reward on the least likely arm, so that the optima differ visibly.
BANDIT_EXAMPLE = {"ref_probs": (0.4, 0.3, 0.2, 0.1), "rewards": (0.0, 0.3, 0.6, 1.0), "beta": 0.25}
# After prefix 0, R = 2 needs a token the reference gives 1%; prefix 1 earns about 0.6 whatever follows.
TREE_EXAMPLE = {
    "ref_first": (0.4, 0.35, 0.25),
    "ref_second": ((0.01, 0.59, 0.4), (0.3, 0.4, 0.3), (0.5, 0.3, 0.2)),
    "rewards": ((2.0, 0.0, 0.1), (0.5, 0.6, 0.7), (0.0, 0.2, 0.4)),
    "beta": 0.5,
}

# Six arms, the best reward on the least likely one, for the advantage estimators' table; binary_rewards is the
# same bandit with a 0/1 reward (1 on arms 2, 4 and 5, a third of ref's mass).
BANDIT6_EXAMPLE = {
    "ref_probs": (0.3, 0.25, 0.18, 0.12, 0.1, 0.05),
    "rewards": (0.2, 0.0, 0.5, 0.4, 0.7, 1.0),
    "binary_rewards": (0.0, 0.0, 1.0, 0.0, 1.0, 1.0),
    "beta": 0.3,
}


def example(example: dict) -> dict:
    """BANDIT_EXAMPLE, TREE_EXAMPLE or BANDIT6_EXAMPLE with float64 tensors for its tuples."""
    return {k: v if isinstance(v, float) else torch.tensor(v, dtype=torch.float64) for k, v in example.items()}


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


# Distances at float-noise level (the solver stops at TOL = 1e-14) depend on the CPU, BLAS and thread count, so
# the report prints them as this bound, never as their digits, and the docs quote the report verbatim.
NOISE_BOUND = 1e-12


def _residual(distance: float) -> str:
    """A distance to the predicted point: "< 1e-12" at float-noise level, else its value (a real gap)."""
    return f"< {NOISE_BOUND:.0e}" if distance < NOISE_BOUND else f"{distance:.1e}"


def _vec(x: torch.Tensor) -> str:
    return "(" + ", ".join(f"{v:.3f}" for v in x.tolist()) + ")"


def fixed_point_report() -> str:
    """Markdown tables: where each estimator x placement converges on BANDIT_EXAMPLE and TREE_EXAMPLE, with
    the distance (total variation) to each analytic optimum."""
    ex = example(BANDIT_EXAMPLE)
    ref, rewards, beta = ex["ref_probs"], ex["rewards"], ex["beta"]
    optima = {name: f(ref, rewards, beta) for f, name in OPTIMUM_NAMES.items()}
    lines = [
        f"Bandit: pi_ref = {BANDIT_EXAMPLE['ref_probs']}, r = {BANDIT_EXAMPLE['rewards']}, beta = {beta}; the "
        "advantage r_x - E_pi r (advantage=\"exact\", which RLOO gives in expectation); the optima:",
        "",
        *(f"- {name}: {_vec(p)}" for name, p in optima.items()),
        "",
        "| estimator | placement | fixed point | converges to | TV to it | " + " | ".join(
            f"TV to {name} optimum" for name in optima) + " |",
        "|---" * (5 + len(optima)) + "|",
    ]
    for estimator in ESTIMATORS:
        for placement in PLACEMENTS:
            probs = bandit_fixed_point(ref, rewards, beta, estimator, placement)
            label, point = predicted_bandit(ref, rewards, beta, estimator, placement, probs)
            lines.append(f"| {estimator} | {placement} | {_vec(probs)} | {label} | {_residual(tv(probs, point))} | "
                         + " | ".join(f"{tv(probs, p):.3f}" for p in optima.values()) + " |")
    tree = example(TREE_EXAMPLE)
    seq_first, seq_second = sequence_optimum(tree["ref_first"], tree["ref_second"], tree["rewards"], tree["beta"])
    seq_joint = seq_first[:, None] * seq_second
    lines += [
        "",
        f"Tree: pi_ref(a) = {_vec(tree['ref_first'])}, pi_ref(b | a) rows {TREE_EXAMPLE['ref_second']}, "
        f"R(a, b) rows {TREE_EXAMPLE['rewards']}, beta = {tree['beta']}; each token's return less its expected "
        f"value as the advantage (advantage=\"exact\", RLOO's in expectation); the sequence optimum's first token "
        f"{_vec(seq_first)}.",
        "",
        "| estimator | placement | first token pi(a) | converges to | joint TV to it | joint TV to sequence "
        "optimum | first token: TV, KL to the sequence optimum's |",
        "|---|---|---|---|---|---|---|",
    ]
    for estimator in ESTIMATORS:
        for placement in PLACEMENTS:
            first, second = tree_fixed_point(**tree, estimator=estimator, placement=placement)
            label, (p_first, p_second) = predicted_tree(tree, estimator, placement, second, first)
            joint = first[:, None] * second
            lines.append(
                f"| {estimator} | {placement} | {_vec(first)} | {label} | {_residual(tv(joint, p_first[:, None] * p_second))}"
                f" | {tv(joint, seq_joint):.3f} | {tv(first, seq_first):.3f}, {kl(first, seq_first):.3f} |")
    ref1, ref2, rewards, beta = tree["ref_first"], tree["ref_second"], tree["rewards"], tree["beta"]
    tok_first, tok_second = token_level_optimum(ref1, ref2, rewards, beta)
    second_kl = (tok_second * (tok_second.log() - ref2.log())).sum(-1)
    objective = lambda first, second: (first[:, None] * second * (
        rewards - beta * (first.log()[:, None] + second.log() - ref1.log()[:, None] - ref2.log()))).sum().item()
    lines += [
        "",
        f"A KL loss (k2, every X+, full) leaves the second token at the sequence optimum's pi*(b | a) and weights"
        f" prefix a by exp(KL(pi*(.|a) || ref(.|a))) = {_vec(second_kl.exp())} relative to the sequence"
        f" optimum, so E[R] - beta KL(pi || ref) over the sequence is {objective(tok_first, tok_second):.4f}"
        f" instead of its maximum {objective(seq_first, seq_second):.4f}.",
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------
# The advantage estimators' report: docs/kl.md, 'Where the advantage estimator moves the fixed point'.

# (reward, estimator, placement, advantage, n) per row; reward "r" is BANDIT6_EXAMPLE's rewards, "0/1" its
# binary_rewards.
ADVANTAGE_ROWS = (
    *(("r", "k3+", "loss", advantage, n) for advantage, n in (
        ("exact", None), ("rloo", 4), ("rloo", 8), ("drgrpo", 4), ("drgrpo", 8), ("drgrpo", 16), ("grpo", 2),
        ("grpo", 4), ("grpo", 8), ("grpo", 16), ("gae", None))),
    *(("r", "k3", "loss", advantage, n) for advantage, n in (("exact", None), ("drgrpo", 8), ("grpo", 8),
                                                               ("gae", None))),
    *(("r", "k1", "reward", advantage, n) for advantage, n in (("exact", None), ("rloo", 8), ("drgrpo", 8),
                                                                 ("grpo", 8), ("grpo", 16), ("gae", None))),
    *(("0/1", "k3+", "loss", advantage, n) for advantage, n in (("exact", None), ("drgrpo", 8), ("grpo", 8),
                                                                  ("grpo", 16), ("gae", None))),
    ("0/1", "k1", "reward", "grpo", 8),
)


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


def advantage_report() -> str:
    """Markdown: where each advantage estimator (ADVANTAGE_ROWS) leaves the policy on BANDIT6_EXAMPLE, against
    the idealised advantage's fixed point and the point derived for it, then the whitened advantages' criterion."""
    ex = example(BANDIT6_EXAMPLE)
    ref, beta = ex["ref_probs"], ex["beta"]
    rewards = {"r": ex["rewards"], "0/1": ex["binary_rewards"]}
    lines = [
        f"Bandit: pi_ref = {BANDIT6_EXAMPLE['ref_probs']}, r = {BANDIT6_EXAMPLE['rewards']}, 0/1 reward "
        f"{BANDIT6_EXAMPLE['binary_rewards']}, beta = {beta}. beta's reverse-KL optimum: "
        f"{_vec(reverse_kl_optimum(ref, rewards['r'], beta))} "
        f"(0/1: {_vec(reverse_kl_optimum(ref, rewards['0/1'], beta))}).",
        "",
        "| reward | KL | advantage | fixed point | TV to exact's | converges to | TV to it |",
        "|---|---|---|---|---|---|---|",
    ]
    exact = {}  # the idealised advantage's fixed point of each reward x KL
    for reward, estimator, placement, advantage, n in ADVANTAGE_ROWS:
        model = AdvantageModel(advantage, n)
        probs = bandit_fixed_point(ref, rewards[reward], beta, estimator, placement, advantage=advantage, n=n)
        if (reward, estimator, placement) not in exact:
            exact[reward, estimator, placement] = bandit_fixed_point(ref, rewards[reward], beta, estimator, placement)
        label, point = predicted_with_advantage(ref, rewards[reward], beta, estimator, placement, model)
        distance = "-" if point is None else _residual(tv(probs, point))
        lines.append(f"| {reward} | {estimator}, {placement} | {model.label} | {_vec(probs)} | "
                     f"{tv(probs, exact[reward, estimator, placement]):.3f} | {label} | {distance} |")
    lines += ["", "Whitened advantages against a k2-gradient KL loss (whitened_optimum):", ""]
    for name, r in rewards.items():
        peak = beta * tilt_peak(ref, r)
        if peak < 1:
            lines.append(f"- reward {name}: beta max_t t std_pi_t(r) = {peak:.3f} < 1, no root at the rewards' scale; "
                         f"the whitening's eps stops the flow at t = 1 / (beta sqrt(1e-8)) = "
                         f"{1 / (beta * math.sqrt(WHITEN_EPS)):.3g}: the best arms in ref's ratios.")
        else:
            lines.append(f"- reward {name}: beta max_t t std_pi_t(r) = {peak:.3f} >= 1: the flow stops inside, at "
                         f"{_vec(whitened_optimum(ref, r, beta))}.")
    return "\n".join(lines)
