"""The exact KL over the vocabulary from both models' logits: the `full` estimator (full_kl).

Chunked over rows, with a hand-written backward, so that its memory does not grow with B * T at real
vocabulary sizes (Amini et al. arXiv:2504.10637 for the full-vocabulary KL).
"""

import math

import torch

from rlhf.core_algos import upcast

CHUNK_ROWS = 256  # rows of the flattened (N, V) logits taken to float32 at a time, forward and backward


class _FullKL(torch.autograd.Function):
    """(N, V) x 2 -> (N,), with a hand-written backward so that autograd stores nothing of size (N, V): with
    p = softmax(z/T), q = softmax(u/T), dKL/dz = p * (log p - log q - KL) / T and dKL/du = (q - p) / T."""

    @staticmethod
    def _log_probs(logits, ref_logits, temperature):
        # x - logsumexp(x), not F.log_softmax: on some CPUs float32 log_softmax is off by ~1e-5 at V = 151,936
        # (its sum of exponentials is less accurate than logsumexp's), which is 1e-4 on a KL of 8 nats.
        z, u = upcast(logits) / temperature, upcast(ref_logits) / temperature
        return z - torch.logsumexp(z, dim=-1, keepdim=True), u - torch.logsumexp(u, dim=-1, keepdim=True)

    @staticmethod
    def _terms(p, logp, logq):
        # p * (log p - log q) with 0 * log 0 = 0, so tokens masked to -inf logits are harmless
        return torch.where(p > 0, p * (logp - logq), torch.zeros_like(p))

    @staticmethod
    def forward(ctx, logits, ref_logits, temperature):
        num_rows, _ = logits.shape  # (N, V)
        out = logits.new_empty(num_rows, dtype=torch.promote_types(logits.dtype, torch.float32))
        for i in range(0, num_rows, CHUNK_ROWS):
            logp, logq = _FullKL._log_probs(logits[i : i + CHUNK_ROWS], ref_logits[i : i + CHUNK_ROWS], temperature)
            out[i : i + CHUNK_ROWS] = _FullKL._terms(logp.exp(), logp, logq).sum(-1)
        ctx.save_for_backward(logits, ref_logits)
        ctx.temperature = temperature
        return out

    @staticmethod
    def backward(ctx, grad_out):
        logits, ref_logits = ctx.saved_tensors
        temperature = ctx.temperature
        want_logits, want_ref = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_logits = torch.zeros_like(logits) if want_logits else None
        grad_ref = torch.zeros_like(ref_logits) if want_ref else None
        for i in range(0, logits.shape[0], CHUNK_ROWS):
            rows = slice(i, i + CHUNK_ROWS)
            logp, logq = _FullKL._log_probs(logits[rows], ref_logits[rows], temperature)
            p = logp.exp()
            g = grad_out[rows].unsqueeze(-1) / temperature  # (n, 1)
            if want_logits:
                kl = _FullKL._terms(p, logp, logq).sum(-1, keepdim=True)
                centred = torch.where(p > 0, p * (logp - logq - kl), torch.zeros_like(p))
                grad_logits[rows] = (g * centred).to(logits.dtype)
            if want_ref:
                grad_ref[rows] = (g * (logq.exp() - p)).to(ref_logits.dtype)
        return grad_logits, grad_ref, None


def full_kl(logits: torch.Tensor, ref_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Exact KL(softmax(logits/T) || softmax(ref_logits/T)) over the last (vocab) dim: (..., V) x 2 -> (...), in
    float32 for half inputs (float64 stays float64), differentiable w.r.t. both. CHUNK_ROWS rows at a time, so the
    extra memory is O(CHUNK_ROWS * V) whatever B * T is, which matters at real vocabularies (Qwen2.5: V = 151,936).
    """
    if logits.shape != ref_logits.shape or logits.dim() == 0:
        raise ValueError(f"logits {tuple(logits.shape)} and ref_logits {tuple(ref_logits.shape)}: one shape "
                         "(..., V) is needed")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    lead, vocab = logits.shape[:-1], logits.shape[-1]
    out = _FullKL.apply(logits.reshape(-1, vocab), ref_logits.reshape(-1, vocab), float(temperature))
    return out.reshape(lead)
