"""Whether sampled updates carry k3 in the loss across verl's clamp edge at one decision.

    python -m lab.theory.sampled_edge            # 8 seeds, beta 0.1, (q, p, o) = (0.8, 0.04, 0.16)

A 3-token softmax on free logits, rewards (0, 1, 0), started at the reference: each step samples n = 8 tokens,
takes RLOO advantages (the trainer's group_outcome_advantages) and one update on the policy-gradient loss plus
beta times k3 of the sampled tokens (rlhf.kl.kl_penalty, clamps included). The exact flow stops at the forward
optimum (habit beta q / lam), inside the edge (d = -2.61087) from beta ~0.074 up; a sampled run that crosses the
edge loses k3's pull on the habit and ends near 0. Reports each seed's final habit probability and the lowest d
it visited.
"""

from __future__ import annotations

import argparse

import torch

from rlhf.core_algos import group_outcome_advantages
from rlhf.kl import K3_CLAMP_EDGES, kl_penalty


def run(seed: int, beta: float = 0.1, ref=(0.8, 0.04, 0.16), steps: int = 3000, lr: float = 0.05, n: int = 8,
        optimizer: str = "adam") -> dict:
    """One sampled run; lr decays linearly to 0. Returns {"habit": final, "min_d": lowest log(pi/ref) of the
    habit, "crossed": whether that went past the edge}."""
    generator = torch.Generator().manual_seed(seed)
    ref_logprobs = torch.tensor(ref, dtype=torch.float64).log()
    logits = ref_logprobs.clone().requires_grad_(True)
    opt = (torch.optim.Adam if optimizer == "adam" else torch.optim.SGD)([logits], lr=lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 - step / steps)
    min_d = 0.0
    for _ in range(steps):
        logprobs = torch.log_softmax(logits, -1)
        tokens = torch.multinomial(logprobs.detach().exp(), n, replacement=True, generator=generator)
        lp = logprobs[tokens]
        scores = (tokens == 1).double()
        advantages, _ = group_outcome_advantages(scores[:, None], torch.ones(n, 1), torch.zeros(n), "rloo")
        loss = -(advantages[:, 0] * lp).mean() + beta * kl_penalty(lp, ref_logprobs[tokens], "k3").mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        schedule.step()
        min_d = min(min_d, (torch.log_softmax(logits.detach(), -1)[0] - ref_logprobs[0]).item())
    habit = torch.softmax(logits.detach(), -1)[0].item()
    return {"habit": habit, "min_d": min_d, "crossed": min_d < K3_CLAMP_EDGES[0]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--lr", type=float, nargs="+", default=[0.01, 0.05, 0.2])
    args = parser.parse_args(argv)
    for lr in args.lr:
        results = [run(seed, args.beta, steps=args.steps, lr=lr) for seed in range(args.seeds)]
        crossed = sum(r["crossed"] for r in results)
        print(f"beta {args.beta}, Adam lr {lr} -> 0 over {args.steps} steps, n = 8: {crossed} of {args.seeds} seeds "
              f"crossed the edge; final habit " + ", ".join(f"{r['habit']:.3f}" for r in results)
              + "; lowest d " + ", ".join(f"{r['min_d']:.2f}" for r in results))


if __name__ == "__main__":
    main()
