"""KL estimators, the exact KL from logits, and the KL-coefficient controllers.

Per token, with `d = logprob - ref_logprob` (log pi(x) - log pi_ref(x), x sampled from pi), each estimator
targets the reverse KL(pi || pi_ref) = E_{x~pi}[d]. Names are verl's, which users already type:

| name(s)            | value                      | E[value] - KL       | d/d(lp)     | E[loss gradient]   | rho      |
|--------------------|----------------------------|---------------------|-------------|--------------------|----------|
| `k1`, `kl`         | d                          | 0                   | 1           | 0 (use in reward)  | in graph |
| `k2`, `mse`        | d^2 / 2                    | 3rd order, any sign | d           | grad KL(pi || ref) | detached |
| `k3`, `low_var_kl` | exp(-d) - 1 + d            | 0 (unless clamped)  | 1 - exp(-d) | grad KL(ref || pi) | in graph |
| `abs`              | abs(d)                     | >= 0                | sign(d)     | 2 grad TV(pi, ref) | detached |
| `X+` (any above)   | X's value                  | X's bias            | d (k2's)    | grad KL(pi || ref) | detached |
| `full` (full_kl)   | sum_v pi_v log(pi_v/ref_v) | none (uses logits)  | exact       | grad KL(pi || ref) | none     |

`E[loss gradient]` is on-policy; `rho` is how kl_penalty weights the term off-policy (below; `full` sums
over the vocabulary, so it needs no weight).

In the reward (detached log-probs) `X+` is the same as `X`; only k1 there gives grad KL(pi || ref).

Off-policy (PPO after the first optimizer step: x ~ pi_old, not pi), `kl_penalty(..., old_logprob=...)`
returns rho * X with rho = pi(x) / pi_old(x), weighted so that the expected gradient is grad KL(pi || ref):
- rho in the graph for k1, k3 (unbiased values): E_old[rho X] = KL(pi || ref) as a function of theta, so its
  gradient is exact (for k3, DeepSeek-V3.2's unbiased KL, report section 3.1). Not a no-op at rho = 1: the
  gradient gains X * grad log pi, which turns k1's 0 and k3's forward-KL gradient into grad KL(pi || ref).
- rho detached for k2 and every `X+`: E_old[sg(rho) d grad log pi] = E_pi[d grad log pi] = grad KL(pi || ref).
- rho detached for abs: that keeps abs's on-policy gradient, 2 grad TV (in the graph would give grad E_pi|d|,
  the gradient of a value biased high, a KL gradient no more), so old_logprob only undoes the sampling shift.
The other weighting is biased in each case. Any weighted value has mean E_pi[X], X's on-policy mean.

Sources: J. Schulman, "Approximating KL Divergence" (2020) for k1/k2/k3; Shao et al. arXiv:2402.03300 (GRPO
uses k3 as a loss); Tang & Munos arXiv:2506.09477 and Zhang et al. arXiv:2505.17508 (which gradient each
placement gives); Liu et al. arXiv:2510.01555 (k2 as a loss == k1 in the reward); Amini et al.
arXiv:2504.10637 (full-vocabulary KL); DeepSeek-V3.2 report, section 3.1 (importance-weighted k3). The maths,
the off-policy section and the numbers the tests use are in docs/kl.md; exact expectations by enumeration
live in `rlhf.kl_theory`.

Run `python -m rlhf.kl` to print, for small categorical examples, each estimator's exact mean, bias
and std, its expected loss/reward gradient against grad KL(pi || ref), and (example C) the same off-policy,
uncorrected and corrected.
"""

import math
from typing import Callable

import torch
import torch.nn.functional as F

from rlhf.core_algos import masked_mean

Estimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# name -> estimator function; aliases map to the same function. Filled by @register_estimator.
_ESTIMATORS: dict[str, Estimator] = {}
# the estimators registered with unbiased=True: off-policy, kl_penalty puts rho inside their autograd graph
_UNBIASED: set[Estimator] = set()


def register_estimator(name: str, *aliases: str, unbiased: bool = False) -> Callable[[Estimator], Estimator]:
    """Register a base estimator `(logprob, ref_logprob) -> same shape` under `name` and its aliases.

    Adding an estimator is one decorated function below (ESTIMATOR_NAMES is built from the registry after
    them). Names may not end in `+` (reserved for the straight-through form) and may not be `full`.
    `unbiased=True` declares E_{x~pi}[value] == KL(pi || ref) for every pi: kl_penalty then weights it
    off-policy by rho inside the graph, whose gradient is exactly grad KL(pi || ref); otherwise rho is
    detached, which keeps the estimator's on-policy expected gradient.
    """

    def decorator(fn: Estimator) -> Estimator:
        for n in (name, *aliases):
            if n in _ESTIMATORS or n.endswith("+") or n in ("", "full"):
                raise ValueError(f"cannot register KL estimator {n!r}: taken or reserved")
            _ESTIMATORS[n] = fn
        if unbiased:
            _UNBIASED.add(fn)
        return fn

    return decorator


@register_estimator("k1", "kl", unbiased=True)
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


@register_estimator("k3", "low_var_kl", unbiased=True)
def kl_k3(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """k3 = exp(ref - lp) - 1 + (lp - ref) = r - 1 - log r with r = pi_ref/pi. Unbiased and >= 0 per sample
    (Schulman 2020); d/dlogprob = 1 - exp(-d), so as a loss (GRPO, Shao et al. arXiv:2402.03300) its
    expected gradient is grad KL(ref||pi), the forward KL (Tang & Munos arXiv:2506.09477).

    Mirrors verl's clamps: the exponent ref - lp is clamped to [-20, 20] and the value to [-10, 10], so the
    value saturates at 10 (gradient 0) once d < ~-2.5 or d > ~11. expm1 keeps small values accurate.
    """
    neg_d = (ref_logprob - logprob).clamp(-20.0, 20.0)
    return (torch.expm1(neg_d) - neg_d).clamp(-10.0, 10.0)


@register_estimator("abs")
def kl_abs(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """abs = |d|. Biased high (E[abs] >= KL); d/dlogprob = sign(d), so as a loss its expected gradient is
    2 grad TV(pi, ref), not a KL gradient (Shah et al. arXiv:2512.21852)."""
    return (logprob - ref_logprob).abs()


BASE_ESTIMATOR_NAMES: tuple[str, ...] = tuple(_ESTIMATORS)
ESTIMATOR_NAMES: tuple[str, ...] = BASE_ESTIMATOR_NAMES + tuple(n + "+" for n in BASE_ESTIMATOR_NAMES)
PANEL_ESTIMATORS = ("k1", "k2", "k3", "abs")

_PLUS_RULE = (
    "any of them may take a single trailing '+' (straight-through: the base value with k2's gradient)"
)


def _unknown_name_error(name: str, allow_full: bool) -> ValueError:
    valid = ESTIMATOR_NAMES + (("full",) if allow_full else ())
    hint = ""
    fixed = name.strip().replace(" ", "").lower()
    if fixed != name and fixed in valid:
        hint = f" (did you mean {fixed!r}?)"
    return ValueError(
        f"unknown KL estimator {name!r}{hint}; valid names: {', '.join(valid)}. "
        f"Base names {', '.join(BASE_ESTIMATOR_NAMES)}: {_PLUS_RULE}."
    )


def _parse(name: str) -> tuple[Estimator, bool]:
    """Name -> (base estimator, straight-through?). Raises as check_estimator documents."""
    if not isinstance(name, str):
        raise TypeError(f"KL estimator name must be a str, got {type(name).__name__} {name!r}")
    if name in ("full", "full+"):
        raise ValueError(
            f"KL estimator {name!r} is the exact KL over the vocabulary: it needs both models' logits, "
            "not sampled log-probs, so kl_penalty cannot compute it; use full_kl(logits, ref_logits)"
        )
    plus = name.endswith("+")
    base = name[:-1] if plus else name  # the fix of verl PR #6058: strip the suffix before dispatch
    if base not in _ESTIMATORS:
        raise _unknown_name_error(name, allow_full=False)
    return _ESTIMATORS[base], plus


def check_estimator(name: str, allow_full: bool = False) -> str:
    """Validate an estimator name from a config and return it unchanged.

    Raises TypeError for a non-str and ValueError (naming the input, every valid name and the `+` rule)
    otherwise. With `allow_full`, `full` (the exact KL from logits, see full_kl) is also accepted, and
    `full+` is refused because `full` already has the exact gradient.
    """
    if allow_full and name == "full":
        return name
    if allow_full and name == "full+":
        raise ValueError(
            "KL estimator 'full+' is not valid: 'full' is already the exact KL with the exact gradient, "
            "so the '+' suffix (k2's gradient) does not apply; use 'full'"
        )
    try:
        _parse(name)
    except ValueError:
        if allow_full:  # the list of valid names must include "full"
            raise _unknown_name_error(name, allow_full=True) from None
        raise
    return name


def canonical(name: str) -> str:
    """The first-registered name of an estimator, keeping a `+` suffix: `low_var_kl+` -> `k3+`, `mse` -> `k2`,
    `full` -> `full`. Raises like check_estimator(name, allow_full=True)."""
    check_estimator(name, allow_full=True)
    if name == "full":
        return name
    base, plus = _parse(name)
    return next(n for n, fn in _ESTIMATORS.items() if fn is base) + ("+" if plus else "")


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """bf16/fp16 (and ints) -> float32; float32/float64 unchanged."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def kl_penalty(
    logprob: torch.Tensor, ref_logprob: torch.Tensor, estimator: str, old_logprob: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-token KL estimate, elementwise: logprob, ref_logprob (B, T) or any equal shape -> same shape.

    `estimator` is one of ESTIMATOR_NAMES (see the module table). `X+` returns X's value (equal for finite
    values) with k2's gradient, `k2 - k2.detach() + X.detach()`, i.e. d/dlogprob = logprob - ref_logprob
    (and -(logprob - ref_logprob) w.r.t. ref_logprob if it requires grad). Half-precision inputs are computed
    in float32 and the result is float32. Same name and argument order as verl's kl_penalty.

    `old_logprob` (same shape, never differentiated) is the log-prob under the policy that sampled the tokens,
    for a KL loss on off-policy samples (PPO after the first optimizer step). The result is then rho * term
    with rho = exp(clamp(logprob - old_logprob, -20, 20)) as in the policy loss: rho inside the graph for k1
    and k3, detached for k2, abs and every `X+` (the module docstring says why). Then E_{x~pi_old} of the
    result's value is X's on-policy mean and, for k1, k2, k3 and every `X+`, E_{x~pi_old} of its gradient is
    grad KL(pi || ref) (for abs, 2 grad TV as on-policy). Note that with rho in the graph the gradient
    changes even where old_logprob == logprob (rho == 1): the on-policy k1 and k3 losses do not give
    grad KL(pi || ref), the weighted ones do. None (the default) leaves the term unweighted, as before.
    """
    base, plus = _parse(estimator)
    for other_name, other in (("ref_logprob", ref_logprob), ("old_logprob", old_logprob)):
        if other is not None and other.shape != logprob.shape:
            raise ValueError(f"logprob {tuple(logprob.shape)} and {other_name} {tuple(other.shape)} differ")
    logprob, ref_logprob = _upcast(logprob), _upcast(ref_logprob)
    value = base(logprob, ref_logprob)
    if plus:
        k2 = kl_k2(logprob, ref_logprob)
        value = k2 - k2.detach() + value.detach()
    if old_logprob is None:
        return value
    rho = torch.exp((logprob - _upcast(old_logprob.detach())).clamp(-20.0, 20.0))
    return (rho if rho_in_graph(estimator) else rho.detach()) * value


def rho_in_graph(estimator: str) -> bool:
    """Whether kl_penalty(..., old_logprob=...) puts rho inside the autograd graph for `estimator` (k1, k3 and
    their aliases) rather than detaching it (k2, abs, every `X+`). Raises like check_estimator."""
    base, plus = _parse(estimator)
    return base in _UNBIASED and not plus


@torch.no_grad()
def kl_panel(logprob: torch.Tensor, ref_logprob: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Token-mean of each PANEL_ESTIMATORS estimate over mask == 1, without grad: (B, T) x 3 -> metrics.

    Returns {"kl/k1", "kl/k2", "kl/k3", "kl/abs"}; the trainer adds "kl/full" from full_kl. k1 and k3 estimate
    the same number (k1 noisier, may go negative), k2 and abs are biased (see the module table).
    """
    if mask.shape != logprob.shape:
        raise ValueError(f"mask {tuple(mask.shape)} and logprob {tuple(logprob.shape)} differ")
    return {
        f"kl/{name}": masked_mean(kl_penalty(logprob, ref_logprob, name), mask).item()
        for name in PANEL_ESTIMATORS
    }


class _FullKL(torch.autograd.Function):
    """Chunked exact KL with a hand-written backward, so autograd stores nothing of size (N, V).

    With p = softmax(z/T), q = softmax(u/T): dKL/dz = p * (log p - log q - KL) / T, dKL/du = (q - p) / T.
    """

    @staticmethod
    def _log_probs(logits, ref_logits, temperature):
        # x - logsumexp(x), not F.log_softmax: on some CPUs float32 log_softmax is off by ~1e-5 at V = 151,936
        # (its sum of exponentials is less accurate than logsumexp's), which is 1e-4 on a KL of 8 nats.
        z, u = _upcast(logits) / temperature, _upcast(ref_logits) / temperature
        return z - torch.logsumexp(z, dim=-1, keepdim=True), u - torch.logsumexp(u, dim=-1, keepdim=True)

    @staticmethod
    def _terms(p, logp, logq):
        # p * (log p - log q) with 0 * log 0 = 0, so tokens masked to -inf logits are harmless
        return torch.where(p > 0, p * (logp - logq), torch.zeros_like(p))

    @staticmethod
    def forward(ctx, logits, ref_logits, temperature, chunk_size):
        num_rows, _ = logits.shape  # (N, V)
        out = logits.new_empty(num_rows, dtype=torch.promote_types(logits.dtype, torch.float32))
        for i in range(0, num_rows, chunk_size):
            logp, logq = _FullKL._log_probs(logits[i : i + chunk_size], ref_logits[i : i + chunk_size], temperature)
            out[i : i + chunk_size] = _FullKL._terms(logp.exp(), logp, logq).sum(-1)
        ctx.save_for_backward(logits, ref_logits)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return out

    @staticmethod
    def backward(ctx, grad_out):
        logits, ref_logits = ctx.saved_tensors
        temperature, chunk_size = ctx.temperature, ctx.chunk_size
        want_logits, want_ref = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_logits = torch.zeros_like(logits) if want_logits else None
        grad_ref = torch.zeros_like(ref_logits) if want_ref else None
        for i in range(0, logits.shape[0], chunk_size):
            rows = slice(i, i + chunk_size)
            logp, logq = _FullKL._log_probs(logits[rows], ref_logits[rows], temperature)
            p = logp.exp()
            g = grad_out[rows].unsqueeze(-1) / temperature  # (n, 1)
            if want_logits:
                kl = _FullKL._terms(p, logp, logq).sum(-1, keepdim=True)
                centred = torch.where(p > 0, p * (logp - logq - kl), torch.zeros_like(p))
                grad_logits[rows] = (g * centred).to(logits.dtype)
            if want_ref:
                grad_ref[rows] = (g * (logq.exp() - p)).to(ref_logits.dtype)
        return grad_logits, grad_ref, None, None


def full_kl(
    logits: torch.Tensor, ref_logits: torch.Tensor, temperature: float = 1.0, chunk_size: int = 256
) -> torch.Tensor:
    """Exact KL(softmax(logits/T) || softmax(ref_logits/T)) over the last (vocab) dim: (..., V) x 2 -> (...).

    Differentiable w.r.t. logits (and ref_logits if it requires grad). The flattened leading dims are processed
    `chunk_size` rows at a time in float32 (float64 stays float64), forward and backward, so the extra memory
    is O(chunk_size * V) whatever B * T is, which matters at real vocabularies (Qwen2.5: V = 151,936). The
    result is float32 for half inputs. This is the `full` estimator (Amini et al. arXiv:2504.10637).
    """
    if logits.shape != ref_logits.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and ref_logits {tuple(ref_logits.shape)} differ")
    if logits.dim() == 0:
        raise ValueError("full_kl needs a vocabulary dim: logits must be (..., V)")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if not (isinstance(chunk_size, int) and chunk_size >= 1):
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    lead, vocab = logits.shape[:-1], logits.shape[-1]
    out = _FullKL.apply(logits.reshape(-1, vocab), ref_logits.reshape(-1, vocab), float(temperature), chunk_size)
    return out.reshape(lead)


# ----------------------------------------------------------------------------------------------------------
# KL-coefficient controllers for the KL in the reward: token_reward_t = score_t - value * kl_t.

KL_CTRL_TYPES = ("fixed", "adaptive")


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def check_kl_ctrl(type: str, kl_coef: float, target_kl: float | None = None, horizon: float | None = None) -> None:
    """Validate controller settings without building one (the config calls this early); raises ValueError.

    `fixed` uses only kl_coef (>= 0); `adaptive` also needs target_kl > 0 and horizon > 0.
    """
    if type not in KL_CTRL_TYPES:
        raise ValueError(f"unknown KL controller type {type!r}; valid types: {', '.join(KL_CTRL_TYPES)}")
    if not (_is_number(kl_coef) and kl_coef >= 0):
        raise ValueError(f"kl_coef must be a finite number >= 0, got {kl_coef!r}")
    if type == "adaptive":
        for setting, value in (("target_kl", target_kl), ("horizon", horizon)):
            if not (_is_number(value) and value > 0):
                raise ValueError(
                    f"{setting} must be a finite number > 0 for the adaptive KL controller, got {value!r}"
                )


class FixedKLController:
    """A constant coefficient: `.value` == kl_coef forever."""

    def __init__(self, kl_coef: float):
        check_kl_ctrl("fixed", kl_coef)
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt."""

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Proportional controller of Ziegler et al. 2019 (arXiv:1909.08593), as in verl and TRL.

    update: e = clip(current_kl / target_kl - 1, -0.2, 0.2); value *= 1 + e * n_steps / horizon, where n_steps
    is the number of samples (sequences) since the last update and current_kl the measured KL (the k1 mean).
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float):
        check_kl_ctrl("adaptive", init_kl_coef, target_kl, horizon)
        self.value = float(init_kl_coef)
        self.target_kl, self.horizon = float(target_kl), float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        current_kl = float(current_kl)
        if not math.isfinite(current_kl):  # one NaN would poison the coefficient for the rest of training
            raise ValueError(f"current_kl must be finite, got {current_kl}")
        error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


def build_kl_controller(
    type: str, kl_coef: float, target_kl: float | None = None, horizon: float | None = None
) -> FixedKLController | AdaptiveKLController:
    """Build the controller named by `type` (one of KL_CTRL_TYPES) after check_kl_ctrl."""
    check_kl_ctrl(type, kl_coef, target_kl, horizon)
    if type == "fixed":
        return FixedKLController(kl_coef)
    return AdaptiveKLController(kl_coef, target_kl, horizon)
