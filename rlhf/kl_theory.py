"""Exact expectations of the KL estimators over a small categorical, by enumerating the vocabulary.

One sampling step: x ~ pi = softmax(logits) over V tokens, a fixed reference distribution ref_probs (V,),
and an estimator k(x) = kl_penalty(log pi_x, log ref_x, name). Everything is a sum over x, so no sampling:
- expected_value:        E[k] = sum_x pi_x k(x)                                (std: estimator_std)
- expected_loss_grad:    grad_logits of sum_x sg(pi_x) k(x)                   (the KL in the actor loss)
- expected_reward_grad:  grad_logits of sum_x sg(pi_x) sg(k(x)) log pi_x      (the KL in the reward,
                         score-function gradient, as PPO/REINFORCE sees it)
- reverse_kl, forward_kl, total_variation and divergence_grad, to compare against.
`report()` is what `python -m rlhf.kl` prints. The facts it shows are in shared/reference/KL.md.
"""

import torch

from rlhf.kl import PANEL_ESTIMATORS, kl_penalty

# KL.md's worked examples: (pi, ref) as probabilities over a 4-token vocabulary.
EXAMPLES: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "A": ((0.5, 0.3, 0.15, 0.05), (0.25, 0.25, 0.25, 0.25)),
    "B": ((0.4, 0.3, 0.2, 0.1), (0.1, 0.2, 0.3, 0.4)),
}


def example(name: str, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """KL.md example `name` as (policy logits (V,), ref_probs (V,)); logits = log pi."""
    pi, ref = EXAMPLES[name]
    return torch.tensor(pi, dtype=dtype).log(), torch.tensor(ref, dtype=dtype)


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


def report(names: tuple[str, ...] = ("A", "B")) -> str:
    """The table `python -m rlhf.kl` prints: exact values and expected gradients for each example."""
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
            lines.append(
                f"  {est:<10}{mean:10.6f}{mean - kl:+11.6f}{(mean - kl) / kl:+9.3f}{std:10.6f}{std / kl:8.3f}"
            )
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
    lines += [
        "Reading: k1 and k3 are unbiased; k2 is biased (low in A, high in B: third order, either sign); abs is",
        "biased high. As a loss, k1's expected gradient is zero and k3's is pi - ref = grad KL(ref||pi), the forward",
        "KL (in B, descending it lowers the 2nd logit, which descending KL(pi||ref) raises); k2 and every X+",
        "give grad KL(pi||ref). In the reward, only k1 gives grad KL(pi||ref).",
    ]
    return "\n".join(lines)

