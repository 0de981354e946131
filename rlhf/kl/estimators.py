"""The KL estimators by name: the sampled k1, k2, k3, abs and their straight-through `X+` forms, and `full`.

Each sampled estimator is a pure function `(logprob, ref_logprob) -> same shape`, registered under verl's
names by @register_estimator with its off-policy rule; kl_penalty parses a name (one optional trailing `+`)
and applies it, with the importance weight for off-policy tokens; kl_panel logs all of them side by side.
`full`, the exact KL, is computed from logits (rlhf.kl.exact); parse_estimator turns any name, `full`
included, into the KLEstimator the step calls. The table of values, biases and gradients, and each
off-policy rule and why, is the docstring of `rlhf.kl`.
"""

import functools
from dataclasses import dataclass, field
from typing import Callable

import torch

from rlhf.core_algos import masked_mean, upcast
from rlhf.registry import Registry, unknown_name_error

Estimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# The exact KL over the vocabulary (exact.full_kl) is an estimator name too, for the config and parse_estimator;
# it is computed from both models' logits, not from sampled log-probs, so kl_penalty refuses it.
FULL = "full"

# name -> estimator function; aliases map to the same function. Filled by @register_estimator. The empty
# name, `full` and names ending in `+` (the straight-through form) are not estimators of their own.
_ESTIMATORS = Registry("KL estimator", reserved=lambda name: name in ("", FULL) or name.endswith("+"))

# How kl_penalty(..., old_logprob=...) weights a base estimator X by rho = pi / pi_old off-policy (every `X+` is
# DETACHED); the rules and why are in rlhf.kl's docstring.
IN_GRAPH = "rho in the graph"  # rho X, differentiated through rho
DETACHED = "rho detached"  # sg(rho) X
AS_PLUS = "rho detached, k2's gradient"  # sg(rho) X+: the value rho X, the gradient sg(rho) d grad log pi
OFF_POLICY_RULES = (IN_GRAPH, DETACHED, AS_PLUS)
_OFF_POLICY: dict[Estimator, str] = {}


def register_estimator(name: str, *aliases: str, off_policy: str = DETACHED) -> Callable[[Estimator], Estimator]:
    """Register a base estimator `(logprob, ref_logprob) -> same shape` under `name` and its aliases. `off_policy`
    (one of OFF_POLICY_RULES) is how kl_penalty weights it on tokens sampled from pi_old: IN_GRAPH only for one with
    E_pi[value] == KL(pi || ref) for every pi and no clamp, as then grad E_old[rho X] = grad KL(pi || ref)."""
    if off_policy not in OFF_POLICY_RULES:
        raise ValueError(f"off_policy {off_policy!r}; valid: {', '.join(OFF_POLICY_RULES)}")

    def decorator(fn: Estimator) -> Estimator:
        _ESTIMATORS.register(name, *aliases)(fn)
        _OFF_POLICY[fn] = off_policy
        return fn

    return decorator


@register_estimator("k1", "kl", off_policy=IN_GRAPH)
def kl_k1(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """k1 = d. Unbiased for KL(pi||ref) but negative about half the time; d/dlogprob = 1, so as a loss its
    expected gradient is 0 (E[grad log pi] = 0) while in the reward it gives grad KL(pi||ref) (Schulman 2020)."""
    return logprob - ref_logprob


@register_estimator("k2", "mse")
def kl_k2(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """k2 = d^2 / 2. Biased (third order in d, either sign: E[k2] < KL in docs/kl.md's example A), low variance;
    d/dlogprob = d, so as a loss its expected gradient is exactly grad KL(pi||ref) (Schulman 2020; Liu et al.
    arXiv:2510.01555: k2 as a loss is gradient-equivalent to k1 in the reward)."""
    return 0.5 * (logprob - ref_logprob).square()


@register_estimator("k3", "low_var_kl", off_policy=AS_PLUS)
def kl_k3(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """k3 = exp(ref - lp) - 1 + (lp - ref) = r - 1 - log r with r = pi_ref/pi. >= 0 per sample, and unbiased
    where pi's support holds all of ref's mass (E_pi[r] = 1; not under top-k/top-p sampling) (Schulman 2020);
    d/dlogprob = 1 - exp(-d), so as a loss (GRPO, Shao et al. arXiv:2402.03300) its expected gradient is
    grad KL(ref||pi), the forward KL (Tang & Munos arXiv:2506.09477).

    Mirrors verl's clamps: the exponent ref - lp is clamped to [-20, 20] and the value to [-10, 10], so the
    value saturates at 10 (gradient 0) where d < -2.61087 or d > 10.99998 (K3_CLAMP_EDGES). expm1 keeps small
    values accurate. Off-policy it is weighted AS_PLUS: rho k3 in the graph has the gradient rho (k3 + k3')
    grad log pi = rho d grad log pi, k2's, wherever the value is not clamped, but past an edge autograd would give
    rho * 10 (a flat value plus its own 10), pushing a token pi gives far less than ref further down.
    """
    neg_d = (ref_logprob - logprob).clamp(-20.0, 20.0)
    return (torch.expm1(neg_d) - neg_d).clamp(-10.0, 10.0)


K3_CLAMP_EDGES = (-2.610868638149876, 10.999983298020256)  # the d where exp(-d) - 1 + d = 10


@register_estimator("abs")
def kl_abs(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """abs = |d|. Biased high (E[abs] >= KL); d/dlogprob = sign(d), so as a loss its expected gradient is
    2 grad TV(pi, ref), not a KL gradient (E_pi[sign(d) grad log pi] = grad sum_x |pi_x - ref_x|)."""
    return (logprob - ref_logprob).abs()


BASE_ESTIMATOR_NAMES: tuple[str, ...] = tuple(_ESTIMATORS)
ESTIMATOR_NAMES: tuple[str, ...] = BASE_ESTIMATOR_NAMES + tuple(n + "+" for n in BASE_ESTIMATOR_NAMES)
PANEL_ESTIMATORS = ("k1", "k2", "k3", "abs")

_PLUS_RULE = (
    "any of them may take a single trailing '+' (straight-through: the base value with k2's gradient)"
)


def _parse(name: str, allow_full: bool = True) -> "KLEstimator":
    """An estimator's name -> its KLEstimator; TypeError for a non-str, ValueError saying why for a bad name."""
    if not isinstance(name, str):
        raise TypeError(f"KL estimator name must be a str, got {type(name).__name__} {name!r}")
    plus = name.endswith("+")
    base = name[:-1] if plus else name  # the fix of verl PR #6058: strip the suffix before dispatch
    if base == FULL and not allow_full:
        raise ValueError(f"KL estimator {name!r} is the exact KL over the vocabulary: it needs both models' logits, "
                         "not sampled log-probs, so kl_penalty cannot compute it; use full_kl(logits, ref_logits)")
    if base == FULL and plus:
        raise ValueError("KL estimator 'full+' is not valid: 'full' is already the exact KL with the exact gradient, "
                         "so the '+' suffix (k2's gradient) does not apply; use 'full'")
    if base == FULL:
        return KLEstimator(name, needs_logits=True)
    if base not in _ESTIMATORS:
        valid = ESTIMATOR_NAMES + ((FULL,) if allow_full else ())
        note = f". Base names {', '.join(BASE_ESTIMATOR_NAMES)}: {_PLUS_RULE}."
        raise unknown_name_error(_ESTIMATORS.kind, name, valid, note=note)
    return KLEstimator(name, needs_logits=False, base=_ESTIMATORS[base], plus=plus)


@functools.lru_cache(maxsize=None)
def parse_estimator(name: str) -> "KLEstimator":
    """_parse(name), cached: the config's check and the step get the same KLEstimator, `full` included."""
    return _parse(name)


@dataclass(frozen=True)
class KLEstimator:
    """An estimator name parsed once; a call gives the per-token term, all (B, T): kl_penalty's, or for `full` the
    exact KL the caller brings (full_kl(logits, ref_logits, temperature), which needs no importance weight)."""

    name: str  # as configured, e.g. "low_var_kl+"
    needs_logits: bool  # `full`: computed from both models' logits (full_kl), not from sampled log-probs
    base: Estimator | None = field(default=None, repr=False)  # the sampled estimator; None for `full`
    plus: bool = False  # the straight-through `X+` form

    @property
    def off_policy_rule(self) -> str:
        """How an off-policy call weights the term (one of OFF_POLICY_RULES): every `X+` detached, else the base's."""
        return DETACHED if self.plus else _OFF_POLICY[self.base]

    def __call__(self, logprob: torch.Tensor, ref_logprob: torch.Tensor, full_kl: torch.Tensor | None = None,
                 old_logprob: torch.Tensor | None = None) -> torch.Tensor:
        if self.needs_logits:
            if full_kl is None:
                raise ValueError(f"KL estimator {self.name!r} needs full_kl, the exact per-token KL from both "
                                 "models' logits")
            return full_kl
        for other_name, other in (("ref_logprob", ref_logprob), ("old_logprob", old_logprob)):
            if other is not None and other.shape != logprob.shape:
                raise ValueError(f"logprob {tuple(logprob.shape)} and {other_name} {tuple(other.shape)} differ")
        rule = self.off_policy_rule
        logprob, ref_logprob = upcast(logprob), upcast(ref_logprob)
        value = self.base(logprob, ref_logprob)
        if self.plus or (old_logprob is not None and rule == AS_PLUS):
            k2 = kl_k2(logprob, ref_logprob)
            value = k2 - k2.detach() + value.detach()
        if old_logprob is None:
            return value
        rho = torch.exp((logprob - upcast(old_logprob.detach())).clamp(-20.0, 20.0))
        return (rho if rule == IN_GRAPH else rho.detach()) * value


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, estimator: str,
               old_logprob: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token KL estimate, elementwise: logprob, ref_logprob (B, T) or any equal shape -> same shape, in float32
    for half-precision inputs; verl's name and argument order. `estimator` is one of ESTIMATOR_NAMES (rlhf.kl's
    table); `X+` is X's value with k2's gradient, `k2 - k2.detach() + X.detach()`. With `old_logprob`, under the
    policy that sampled the tokens (a KL loss off-policy; never differentiated), the value is rho * X with
    rho = exp(clamp(logprob - old_logprob, -20, 20)), in the graph or detached by off_policy_rule (rlhf.kl: why)."""
    return _parse(estimator, allow_full=False)(logprob, ref_logprob, old_logprob=old_logprob)


@torch.no_grad()
def kl_panel(logprob: torch.Tensor, ref_logprob: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Token mean of each PANEL_ESTIMATORS estimate over mask == 1: (B, T) x 3 -> {"kl/k1", "kl/k2", "kl/k3",
    "kl/abs"}, each kl_penalty's value; the trainer adds "kl/full" (full_kl)."""
    if not mask.shape == logprob.shape == ref_logprob.shape:
        raise ValueError(f"mask {tuple(mask.shape)}, logprob {tuple(logprob.shape)} and ref_logprob "
                         f"{tuple(ref_logprob.shape)} differ")
    logprob, ref_logprob = upcast(logprob), upcast(ref_logprob)
    return {f"kl/{name}": masked_mean(_ESTIMATORS[name](logprob, ref_logprob), mask).item()
            for name in PANEL_ESTIMATORS}


# ----------------------------------------------------------------- questions about a name (the config's checks)


def check_estimator(name: str, allow_full: bool = False) -> str:
    """Validate an estimator name from a config and return it unchanged; raises like _parse (with `allow_full`,
    `full`, the exact KL from logits, is accepted too)."""
    _parse(name, allow_full)
    return name


def needs_logits(name: str) -> bool:
    """Whether estimator `name` is computed from both models' logits (`full`, by full_kl) rather than from
    sampled log-probs (every name kl_penalty takes). Raises like check_estimator(name, allow_full=True)."""
    return _parse(name).needs_logits


def canonical(name: str) -> str:
    """The first-registered name of an estimator, keeping a `+` suffix: `low_var_kl+` -> `k3+`, `mse` -> `k2`,
    `full` -> `full`. Raises like check_estimator(name, allow_full=True)."""
    estimator = _parse(name)
    if estimator.needs_logits:
        return name
    return next(n for n in _ESTIMATORS if _ESTIMATORS[n] is estimator.base) + ("+" if estimator.plus else "")


def off_policy_rule(estimator: str) -> str:
    """How kl_penalty(..., old_logprob=...) weights `estimator` (one of OFF_POLICY_RULES): IN_GRAPH for k1,
    AS_PLUS for k3, DETACHED for k2, abs and every `X+`. Raises like check_estimator."""
    return _parse(estimator, allow_full=False).off_policy_rule
