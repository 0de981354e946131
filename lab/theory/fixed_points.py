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

The policy-gradient term follows an advantage model (`advantage=`, lab.theory.advantage_models): by default the
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
Adam: the tests check what every stable point satisfies. The analytic optima to compare with are in optima.py;
docs/kl.md, 'Where each estimator converges', derives them, and 'Where the advantage estimator moves the fixed
point' what the advantage models change. fixed_point_tables.py prints both tables (`python -m lab.theory`).
"""

import math
from collections.abc import Callable

import torch

from rlhf.kl.estimators import check_estimator, kl_penalty, needs_logits
from rlhf.kl.exact import full_kl
from lab.theory.advantage_models import (
    GROUP_ADVANTAGES,
    AdvantageModel,
    advantage_model,
    group_expected_advantages,
    whitening_scale,
)


# The rows of the report (any name kl_penalty takes, and `full`, is accepted; `k2+` is `k2`).
ESTIMATORS = ("k1", "k2", "k3", "abs", "k1+", "k3+", "abs+", "full")
# An estimator is a name kl_penalty takes (or `full`), or a value function (logprob, ref_logprob) -> k, elementwise,
# whose autograd derivative is the loss's per-token pull: lab.theory.peers passes a framework's own form that way,
# its weight and its clamp included.
Estimator = str | Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
PLACEMENTS = ("reward", "loss")

_STEP = 0.5  # initial step on the logits, in units of 1/beta (1/beta solves 'reward: k1' in one step)
_MAX_STEP = 1e6  # the longest step, in units of 1/beta (a bound, so that a step times h = 0 stays 0)
_MAX_MOVE = 0.5  # the most any logit moves in one step
# Logits stay within _FLOOR of their state's max: a dying token keeps pi >= ~e^-60 instead of underflowing to 0,
# where the estimators are infinite and the gradient NaN.
_FLOOR = 60.0
MAX_STEPS = 20_000
TOL = 1e-14  # converged when no probability moves by more than this in one step


def _is_full(estimator: Estimator) -> bool:
    return isinstance(estimator, str) and needs_logits(estimator)


def _value(estimator: Estimator, logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    return estimator(logprob, ref_logprob) if callable(estimator) else kl_penalty(logprob, ref_logprob, estimator)


def token_penalty(logits: torch.Tensor, ref_probs: torch.Tensor, estimator: Estimator, placement: str) -> torch.Tensor:
    """p(x) for every token x, (..., K) -> (..., K): the KL term's share of the advantage, A_x = r_x - beta p(x).

    reward: p = k(x), the estimator's value (the trainer's detached penalty); for `full`, the state's exact KL.
    loss: p = dk(x)/dlogprob(x) from autograd through kl_penalty (`X+`: k2's d), since the loss term's expected
    gradient is pi * (p - E_pi p); for `full`, the exact gradient of full_kl divided by pi.
    """
    logprobs = torch.log_softmax(logits.detach(), dim=-1)
    if _is_full(estimator):
        leaf = logits.detach().requires_grad_(True)
        kl = full_kl(leaf, ref_probs.log())  # (...)
        if placement == "reward":
            return kl.detach().unsqueeze(-1).expand_as(logits)
        (grad,) = torch.autograd.grad(kl.sum(), leaf)
        return grad / logprobs.exp()
    leaf = logprobs.requires_grad_(True)
    k = _value(estimator, leaf, ref_probs.log())
    if placement == "reward":
        return k.detach()
    (dk,) = torch.autograd.grad(k.sum(), leaf)  # elementwise estimator: the per-token derivative
    return dk


def _check(ref_probs: torch.Tensor, beta: float, estimator: Estimator, placement: str) -> None:
    if not callable(estimator):
        check_estimator(estimator, allow_full=True)
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown placement {placement!r}; valid: {', '.join(PLACEMENTS)}")
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta!r}")
    if not (ref_probs > 0).all() or not torch.allclose(ref_probs.sum(-1), torch.ones((), dtype=ref_probs.dtype)):
        raise ValueError("reference distributions must be positive and sum to 1 over the last dim")


def _one_sided(ref_probs: torch.Tensor, estimator: Estimator, placement: str) -> tuple[torch.Tensor, torch.Tensor]:
    """token_penalty just below and just above pi = ref (d = -/+1e-9), to find kinks there (abs's sign(d))."""
    if _is_full(estimator):
        zero = torch.zeros_like(ref_probs)
        return zero, zero
    sides = []
    for d in (-1e-9, 1e-9):
        leaf = (ref_probs.log() + d).requires_grad_(True)
        k = _value(estimator, leaf, ref_probs.log())
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


_PROBE_SPACING = 0.002  # nats between the points where a move is checked (_probed_moves)
_MAX_HALVINGS = 60
_NOISE = 1e-9  # a direction smaller than this is rounding near rest, not a turn


def _probed_moves(penalties, logits, hs, ps, steps, pinned, kinked, beta: float):
    """Each state's move (step * h, at most _MAX_MOVE a logit), halved until the KL loss's pull does not turn
    the flow back anywhere along it: at points _PROBE_SPACING apart (in the largest logit's move), a free
    token's direction with its penalty taken there, h - beta (p(probe) - p(start)), must not have turned
    against h (by more than a tenth of the state's largest |h|, plus _NOISE): the flow would have stopped
    before the move's end.

    Without it a step could carry a token across its stationary point and on past an edge where its
    penalty's derivative jumps: past k3's value clamp (d below -2.61) the KL loss no longer pulls a token
    back, so a step that jumps the window between the fixed point and the edge lands where nothing stops the
    token from dying, a corner the small-step flow never reaches (the window is 0.08 nats wide at beta = 0.08
    on a decision of the embedded default). Only a token that moves itself (a tenth of the state's largest
    move) counts, kinked tokens (abs at pi = ref) are left to _ascend's pinning, and `penalties` None (a KL
    in the reward, whose penalty is a value, continuous at the clamp) skips the check. The steps themselves
    are kept (only this iteration's move is halved, as often as needed), so a shortened move never passes
    for rest; returns (the moves, whether one was shortened)."""
    rejected = False
    scales = [torch.ones(h.shape[:-1] + (1,), dtype=h.dtype) for h in hs]
    for _ in range(_MAX_HALVINGS):
        moves = [scale * (step * h).clamp(-_MAX_MOVE, _MAX_MOVE) for scale, step, h in zip(scales, steps, hs)]
        if penalties is None:
            return moves, rejected
        bad = []
        for i, (z, move, h, p) in enumerate(zip(logits, moves, hs, ps)):
            count = max(4, math.ceil(move.abs().max().item() / _PROBE_SPACING))
            fractions = torch.arange(1, count + 1, dtype=z.dtype) / count
            probes = z + fractions.view(-1, *[1] * z.dim()) * move  # (count, ..., K)
            h_probe = h - beta * (penalties(i, probes) - p)
            scale = h.abs().amax(-1, keepdim=True)
            own = move.abs() > 0.1 * move.abs().amax(-1, keepdim=True)  # it moved, not only the others
            turned = (h_probe * h < 0) & (h_probe.abs() > 0.1 * scale + _NOISE) & own & ~kinked[i] & ~pinned[i]
            bad.append(turned.any(0).any(-1, keepdim=True))
        if not any(flag.any() for flag in bad):
            return moves, rejected
        rejected = True
        for scale, flag in zip(scales, bad):
            scale.mul_(torch.where(flag, 0.5, 1.0))
    return moves, rejected


def _ascend(advantages, refs: list[torch.Tensor], beta: float, kinks: list, max_steps: int, tol: float,
            measure=None, start: list[torch.Tensor] | None = None, penalties=None):
    """Natural-gradient ascent z += eta * (A - E_pi A) on each state's logits until no probability moves by > tol.

    `advantages(logits) -> [(base, p)]`, one pair per logits tensor, each token's expected advantage being
    A = base - beta * p: base is what the policy-gradient term gives a sample of that token (its reward, or an
    advantage estimator's E[A | token]), p the KL loss's share (or the penalty in the reward). `measure(probs)`
    returns the probabilities whose moves decide convergence (default: every state's own). The ascent starts
    from pi_ref, or from the probabilities `start` (one per tensor of refs). `kinks` holds each tensor's
    _one_sided penalties; `penalties(i, logits)`, tensor i's KL-loss p at any logits (None for a KL in the
    reward), lets _probed_moves check each move. Where p jumps at pi = ref (abs in the loss) the flow slides along pi_x = ref_x while
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
        new_logits, hs, ps = [], [], []
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
            hs.append(h)
            ps.append(p)
            pinned[i] = pin
        moves, rejected = _probed_moves(penalties, logits, hs, ps, steps, pinned, kinked, beta)
        for i, h in enumerate(hs):
            pin = pinned[i]
            z = logits[i] + moves[i]
            side = torch.sign(torch.log_softmax(z, -1) - refs[i].log())
            pin = pin | (kinked[i] & (side * sides[i] < 0))
            z = _pin(z, pin, refs[i]) if pin.any() else z
            z = z - z.max(-1, keepdim=True).values
            new_logits.append(z.clamp_min(-_FLOOR))
            pinned[i], sides[i] = pin, torch.where(pin, 0.0, side)  # a pinned token sits on ref: no side
        new_probs = [torch.softmax(z, -1) for z in new_logits]
        seen, before = (new_probs, probs) if measure is None else (measure(new_probs), measure(probs))
        moved = max((p - q).abs().max().item() for p, q in zip(seen, before))
        logits, probs, previous = new_logits, new_probs, hs
        if moved <= tol and step_index >= min_steps and not rejected:  # a shortened step is no sign of rest
            return probs
    raise RuntimeError(f"not converged after {max_steps} steps (a probability still moved by {moved:.3g})")


def _penalties(refs: list[torch.Tensor], estimator: Estimator, placement: str):
    """_ascend's `penalties`: (i, logits (..., K)) -> the KL loss's p at those logits against refs[i]; None in the
    reward (the penalty there is a value, continuous at the clamp, and the group models scale it)."""
    if placement != "loss":
        return None
    return lambda i, logits: token_penalty(logits, refs[i].expand_as(logits), estimator, placement)


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
    ref_probs: torch.Tensor, rewards: torch.Tensor, beta: float, estimator: Estimator, placement: str,
    max_steps: int = MAX_STEPS, tol: float = TOL, *, advantage: str = "exact", n: int | None = None,
    start: torch.Tensor | None = None,
) -> torch.Tensor:
    """The policy (K,) that training by exact expected gradients reaches from pi_ref on a K-armed bandit.

    ref_probs, rewards: (K,) float64; estimator in ESTIMATORS (or a value function, Estimator), placement
    "reward" or "loss" (module docstring); advantage the trainer's advantage estimator
    (advantage_models.ADVANTAGES, default the idealised r_x - E_pi r) and n its group size (rloo, grpo, drgrpo
    only). A corner is reached to ~1e-14 (a dying
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
                       start=None if start is None else [start], penalties=_penalties([ref_probs], estimator, placement))
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
                            None if start is None else list(start),
                            _penalties([ref_first, ref_second], estimator, placement))
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


def bandit_plain_flow(
    ref_probs: torch.Tensor, rewards: torch.Tensor, beta: float, estimator: str, placement: str, *,
    advantage: str = "exact", n: int | None = None, lr: float = 0.1, max_steps: int = 200_000, tol: float = 1e-12,
    natural: bool = False,
) -> torch.Tensor:
    """(K,) where plain gradient ascent on the bandit's logits stops: z += lr * pi (A - E_pi A), from pi_ref,
    A = base - beta p of bandit_fixed_point's advantage model; stopped once no probability moves by more than
    tol * lr in a step (or after max_steps, where a corner is still being approached at 1/t).

    The same expected gradient as bandit_fixed_point without its step control: at a small lr it follows the
    gradient flow, so its end is the fixed point that flow reaches, the check that the solver's answer does not
    depend on its steps (k3's value clamp is where it could: a long step jumps the edge the flow stops short of).
    `natural`: z += lr * (A - E_pi A), the natural-gradient flow the solver follows (the same fixed points; the
    path differs, and where a path can cross k3's edge, which path decides whether the token survives).
    """
    _check(ref_probs, beta, estimator, placement)
    model = _model(advantage, n)
    z = ref_probs.log().clamp_min(-_FLOOR)
    pi = torch.softmax(z, -1)
    for _ in range(max_steps):
        base, p = _bandit_advantages(model, z, rewards, beta, token_penalty(z, ref_probs, estimator, placement),
                                     placement)
        a = base - beta * p
        z = z + lr * (1.0 if natural else pi) * (a - (pi * a).sum())
        z = (z - z.max()).clamp_min(-_FLOOR)
        new = torch.softmax(z, -1)
        moved = (new - pi).abs().max().item()
        pi = new
        if moved <= tol * lr:
            break
    return pi
