"""Exact expectations of the KL estimators over a small categorical, by enumerating the vocabulary.

One sampling step: x ~ pi = softmax(logits) over V tokens, a fixed reference distribution ref_probs (V,),
and an estimator k(x) = kl_penalty(log pi_x, log ref_x, name). Everything is a sum over x, so no sampling:
- expected_value:        E[k] = sum_x pi_x k(x)                                (std: estimator_std)
- expected_loss_grad:    grad_logits of sum_x sg(pi_x) k(x)                   (the KL in the actor loss)
- expected_reward_grad:  grad_logits of sum_x sg(pi_x) sg(k(x)) log pi_x      (the KL in the reward,
                         score-function gradient, as PPO/REINFORCE sees it)
- reverse_kl, forward_kl, total_variation and divergence_grad, to compare against.
Off-policy, x ~ pi_old (old_probs (V,)) while the gradient is w.r.t. pi's logits, with term(x) the
kl_penalty of x, given old_logprob = log pi_old(x) if `corrected` (rho-weighted, kl_penalty's rule) else not:
- expected_off_policy_value:     E_old[term] = sum_x old_x term(x)
- expected_off_policy_loss_grad: grad_logits of sum_x old_x term(x)                (old_x a constant)
`report()` is the estimator table `python -m lab.theory` prints first. The facts it shows are in docs/kl.md.
"""

import torch

from rlhf.kl.estimators import AS_PLUS, DETACHED, IN_GRAPH, PANEL_ESTIMATORS, kl_penalty, off_policy_rule

# Values at float-noise level (the fixed-point solver stops at TOL = 1e-14) depend on the CPU, BLAS and thread
# count, so the reports print them as this bound, never as their digits, and the docs quote the reports verbatim.
NOISE_BOUND = 1e-12

# docs/kl.md's worked examples: (pi, ref) as probabilities over a 4-token vocabulary.
EXAMPLES: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "A": ((0.5, 0.3, 0.15, 0.05), (0.25, 0.25, 0.25, 0.25)),
    "B": ((0.4, 0.3, 0.2, 0.1), (0.1, 0.2, 0.3, 0.4)),
}
# Off-policy examples: name -> (the example giving pi and ref, pi_old that sampled the tokens).
OFF_POLICY_EXAMPLES: dict[str, tuple[str, tuple[float, ...]]] = {
    "C": ("A", (0.4, 0.3, 0.2, 0.1)),
}


def example(name: str, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """docs/kl.md example `name` as (policy logits (V,), ref_probs (V,)); logits = log pi."""
    pi, ref = EXAMPLES[name]
    return torch.tensor(pi, dtype=dtype).log(), torch.tensor(ref, dtype=dtype)


def off_policy_example(
    name: str, dtype: torch.dtype = torch.float64
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """docs/kl.md off-policy example `name` as (policy logits (V,), ref_probs (V,), old_probs (V,))."""
    on_policy, old = OFF_POLICY_EXAMPLES[name]
    return (*example(on_policy, dtype), torch.tensor(old, dtype=dtype))


def _per_token(estimator: str, logits: torch.Tensor, ref_probs: torch.Tensor):
    """(log pi (V,), k(x) for every token x (V,)), differentiable w.r.t. logits if it requires grad."""
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs, kl_penalty(logprobs, ref_probs.log(), estimator)


def expected_value(estimator: str, logits: torch.Tensor, ref_probs: torch.Tensor) -> torch.Tensor:
    """E_{x~pi}[k(x)], a scalar."""
    logprobs, k = _per_token(estimator, logits.detach(), ref_probs)
    return (logprobs.exp() * k).sum()


def estimator_std(estimator: str, logits: torch.Tensor, ref_probs: torch.Tensor) -> torch.Tensor:
    """Standard deviation of k(x) for one sample x ~ pi, a scalar."""
    logprobs, k = _per_token(estimator, logits.detach(), ref_probs)
    mean = (logprobs.exp() * k).sum()
    return (logprobs.exp() * (k - mean).square()).sum().sqrt()


def _grad(objective, logits: torch.Tensor) -> torch.Tensor:
    leaf = logits.detach().requires_grad_(True)
    (grad,) = torch.autograd.grad(objective(leaf), leaf)
    return grad


def expected_loss_grad(estimator: str, logits: torch.Tensor, ref_probs: torch.Tensor) -> torch.Tensor:
    """E_{x~pi}[grad_logits k(x)] (V,): the expected gradient of the estimator used as a loss term."""

    def objective(leaf):
        logprobs, k = _per_token(estimator, leaf, ref_probs)
        return (logprobs.exp().detach() * k).sum()

    return _grad(objective, logits)


def expected_reward_grad(estimator: str, logits: torch.Tensor, ref_probs: torch.Tensor) -> torch.Tensor:
    """E_{x~pi}[k(x) grad_logits log pi(x)] (V,): the gradient of E[k] when k is a (detached) reward."""

    def objective(leaf):
        logprobs, k = _per_token(estimator, leaf, ref_probs)
        return (logprobs.exp().detach() * k.detach() * logprobs).sum()

    return _grad(objective, logits)


def _off_policy_terms(estimator, logits, ref_probs, old_probs, corrected: bool) -> torch.Tensor:
    """term(x) for every token x (V,): kl_penalty with old_logprob = log pi_old if corrected, else without."""
    old_logprob = old_probs.log() if corrected else None
    return kl_penalty(torch.log_softmax(logits, dim=-1), ref_probs.log(), estimator, old_logprob=old_logprob)


def expected_off_policy_value(
    estimator: str, logits: torch.Tensor, ref_probs: torch.Tensor, old_probs: torch.Tensor, corrected: bool
) -> torch.Tensor:
    """E_{x~pi_old}[term(x)], a scalar; corrected, it equals expected_value (E_pi[k]) for every estimator."""
    return (old_probs * _off_policy_terms(estimator, logits.detach(), ref_probs, old_probs, corrected)).sum()


def expected_off_policy_loss_grad(
    estimator: str, logits: torch.Tensor, ref_probs: torch.Tensor, old_probs: torch.Tensor, corrected: bool
) -> torch.Tensor:
    """E_{x~pi_old}[grad_logits term(x)] (V,): the expected gradient of the (weighted) loss term off-policy."""

    def objective(leaf):
        return (old_probs * _off_policy_terms(estimator, leaf, ref_probs, old_probs, corrected)).sum()

    return _grad(objective, logits)


def reverse_kl(logits: torch.Tensor, ref_probs: torch.Tensor) -> torch.Tensor:
    """KL(pi || ref) = sum_x pi_x log(pi_x / ref_x)."""
    logprobs = torch.log_softmax(logits, dim=-1)
    return (logprobs.exp() * (logprobs - ref_probs.log())).sum()


def forward_kl(logits: torch.Tensor, ref_probs: torch.Tensor) -> torch.Tensor:
    """KL(ref || pi) = sum_x ref_x log(ref_x / pi_x)."""
    return (ref_probs * (ref_probs.log() - torch.log_softmax(logits, dim=-1))).sum()


def total_variation(logits: torch.Tensor, ref_probs: torch.Tensor) -> torch.Tensor:
    """TV(pi, ref) = sum_x |pi_x - ref_x| / 2."""
    return 0.5 * (torch.softmax(logits, dim=-1) - ref_probs).abs().sum()


def divergence_grad(divergence, logits: torch.Tensor, ref_probs: torch.Tensor) -> torch.Tensor:
    """grad_logits of divergence(logits, ref_probs), e.g. divergence_grad(reverse_kl, ...) (V,)."""
    return _grad(lambda leaf: divergence(leaf, ref_probs), logits)


def _unless_noise(x: float) -> float:
    """x, or 0.0 where |x| is float noise (< NOISE_BOUND): a bias that is 0 in exact arithmetic (k1's, k3's) is
    computed as +-1e-16, whose sign depends on the machine and would print as -0.000000 on some."""
    return 0.0 if abs(x) < NOISE_BOUND else x


def _vec(x: torch.Tensor) -> str:
    return "(" + ", ".join(f"{v:+.6f}" for v in x.tolist()) + ")"


def _compare(grad: torch.Tensor, target: torch.Tensor) -> str:
    """'cos  max|err|' of grad against target; a zero grad has no direction."""
    err = (grad - target).abs().max().item()
    if grad.norm() < 1e-12:
        return f"{'zero':>8} {err:9.6f}"
    cos = torch.dot(grad, target) / (grad.norm() * target.norm())
    return f"{cos.item():8.5f} {err:9.6f}"


REPORT_ESTIMATORS = ("k1", "k2", "k3", "abs", "k1+", "k3+", "abs+")


RULE_LABELS = {IN_GRAPH: "in graph", DETACHED: "detached", AS_PLUS: "as X+"}


def _other_weighting_loss_grad(estimator, logits, ref_probs, old_probs) -> torch.Tensor:
    """The expected loss gradient with the weighting kl_penalty does not use: rho in the graph where it detaches
    rho, else rho detached on the estimator's own gradient (rho unclamped, built here by hand), to show that
    that one is biased."""

    def objective(leaf):
        logprobs = torch.log_softmax(leaf, dim=-1)
        rho = (logprobs - old_probs.log()).exp()
        weight = rho if off_policy_rule(estimator) == DETACHED else rho.detach()
        return (old_probs * weight * kl_penalty(logprobs, ref_probs.log(), estimator)).sum()

    return _grad(objective, logits)


def _off_policy_report(name: str) -> list[str]:
    """The report's lines for off-policy example `name`: each estimator uncorrected, corrected, other rho."""
    logits, ref, old = off_policy_example(name)
    on_policy, old_tuple = OFF_POLICY_EXAMPLES[name]
    grad_rev = divergence_grad(reverse_kl, logits, ref)
    lines = [
        f"Example {name} (off-policy): example {on_policy}'s pi and ref, tokens sampled from pi_old = {old_tuple}",
        f"  grad KL(pi||ref) = {_vec(grad_rev)}",
        "  corrected = kl_penalty(..., old_logprob=log pi_old): the term times rho = pi/pi_old, in the autograd",
        "  graph for k1, as X+ (k2's gradient, rho detached) for k3, detached for k2, abs and every X+; 'other rho'",
        "  is rho in the graph where kl_penalty detaches it, else rho detached on the estimator's own gradient",
        "",
        "  over x ~ pi_old, exact: the expected loss gradient as cos / max|err| against grad KL(pi||ref), and the",
        "  expected value (E_old[rho k] is the corrected one; X+ has X's value)",
        f"  {'estimator':<10}{'rho':>9}{'uncorrected':>20}{'corrected':>20}{'other rho':>20}"
        f"{'E_old[k]':>10}{'E_old[rho k]':>14}{'E_pi[k]':>10}",
    ]
    for est in REPORT_ESTIMATORS:
        uncorrected, corrected = (
            expected_off_policy_loss_grad(est, logits, ref, old, c) for c in (False, True)
        )
        other = _other_weighting_loss_grad(est, logits, ref, old)
        lines.append(
            f"  {est:<10}{RULE_LABELS[off_policy_rule(est)]:>9}{_compare(uncorrected, grad_rev):>20}"
            f"{_compare(corrected, grad_rev):>20}{_compare(other, grad_rev):>20}"
            f"{expected_off_policy_value(est, logits, ref, old, False).item():10.6f}"
            f"{expected_off_policy_value(est, logits, ref, old, True).item():14.6f}"
            f"{expected_value(est, logits, ref).item():10.6f}"
        )
    return lines + [""]


def report(names: tuple[str, ...] = ("A", "B"), off_policy: tuple[str, ...] = ("C",)) -> str:
    """The table `python -m lab.theory` prints first: exact values and expected gradients for each example in
    `names`, then each off-policy example in `off_policy` (OFF_POLICY_EXAMPLES) uncorrected and corrected."""
    lines = []
    for name in names:
        logits, ref = example(name)
        kl = reverse_kl(logits, ref).item()
        grad_rev = divergence_grad(reverse_kl, logits, ref)
        grad_fwd = divergence_grad(forward_kl, logits, ref)
        lines += [
            f"Example {name}: pi = {EXAMPLES[name][0]}, ref = {EXAMPLES[name][1]}",
            f"  KL(pi||ref) = {kl:.6f}   KL(ref||pi) = {forward_kl(logits, ref).item():.6f}"
            f"   TV = {total_variation(logits, ref).item():.6f}",
            f"  grad KL(pi||ref) = {_vec(grad_rev)}",
            f"  grad KL(ref||pi) = {_vec(grad_fwd)}  (= pi - ref)",
            "",
            "  value of one sample, exact over x ~ pi (X+ has X's value)",
            f"  {'estimator':<10}{'E[k]':>10}{'bias':>11}{'bias/KL':>9}{'std':>10}{'std/KL':>8}",
        ]
        for est in PANEL_ESTIMATORS:
            mean = expected_value(est, logits, ref).item()
            std = estimator_std(est, logits, ref).item()
            bias = _unless_noise(mean - kl)
            lines.append(f"  {est:<10}{mean:10.6f}{bias:+11.6f}{bias / kl:+9.3f}{std:10.6f}{std / kl:8.3f}")
        lines += [
            "",
            "  expected gradient w.r.t. the policy logits, each as cos / max|err| against a target",
            f"  {'estimator':<10}{'loss vs grad KL(pi||ref)':>26}{'loss vs pi - ref':>22}"
            f"{'reward vs grad KL(pi||ref)':>30}",
        ]
        for est in REPORT_ESTIMATORS:
            loss_grad = expected_loss_grad(est, logits, ref)
            reward_grad = expected_reward_grad(est, logits, ref)
            lines.append(
                f"  {est:<10}{_compare(loss_grad, grad_rev):>26}{_compare(loss_grad, grad_fwd):>22}"
                f"{_compare(reward_grad, grad_rev):>30}"
            )
        lines.append("")
    for name in off_policy:
        lines += _off_policy_report(name)
    lines += [
        "Reading: k1 and k3 are unbiased; k2 is biased (low in A, high in B: third order, either sign); abs is",
        "biased high. As a loss, k1's expected gradient is zero and k3's is pi - ref = grad KL(ref||pi), the forward",
        "KL (in B, descending it lowers the 2nd logit, which descending KL(pi||ref) raises); k2 and every X+",
        "give grad KL(pi||ref). In the reward, only k1 gives grad KL(pi||ref).",
    ]
    if off_policy:
        lines += [
            "Off-policy (x ~ pi_old), no estimator's uncorrected loss gives grad KL(pi||ref) (k1's points almost",
            "the opposite way: pi_old - pi), and the values drift from E_pi[k]. Corrected, the value is E_pi[k]",
            "for every estimator, and k1, k2, k3 and every X+ give grad KL(pi||ref) exactly; abs keeps its",
            "on-policy 2 grad TV (example A's abs loss row). The other rho is biased in every row (k1+ with rho",
            "in the graph: twice grad KL(pi||ref); k1 with rho detached: zero).",
        ]
    return "\n".join(lines)

