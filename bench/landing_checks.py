"""Two checks of docs/results.md on a synthetic run's theory.json, made from the run's own record.

    python bench/landing_checks.py clamp-edge outputs/landing_bandit/grpo/loss-k3/seed42/theory.json
    python bench/landing_checks.py plain-path outputs/landing_tree_grpo/grpo/loss-k2/seed42/theory.json

clamp-edge (the bandit, GRPO with k3 in the loss): start the run's own solver (lab.landing.fixed_point_from)
at the argmax corner of the run's end, every other arm at log-ratio d to pi_ref, and print for each d the
total variation from where the solver goes to the run's fixed point: 0 inside the interior point's basin,
about 0.15 where verl's clamp on k3 makes the argmax corner stable.

plain-path (the tree): plain gradient ascent on tabular logits from pi_ref under the given advantage model
(lab.theory.fixed_points.tree_plain_flow), and the total variation from its end to the run's final policy.
"""

from __future__ import annotations

import argparse
import json
import os

import torch


from lab.landing import fixed_point_from
from lab.theory.fixed_points import tree_plain_flow


def tv(p: torch.Tensor, q: torch.Tensor) -> float:
    """Total variation between two distributions of the same shape."""
    return 0.5 * (p - q).abs().sum().item()


def clamp_edge(record: dict, log_ratios: list[float]) -> list[tuple[float, float]]:
    """[(d, TV from the solver's end to the fixed point)] for starts at the run's argmax corner with every other
    arm at log-ratio d to pi_ref (the best arm takes the remaining mass)."""
    ref, end = (torch.tensor(record[k], dtype=torch.float64) for k in ("ref", "policy"))
    point = torch.tensor(record["candidates"]["fixed_point"], dtype=torch.float64)
    best, out = end.argmax(), []
    for d in log_ratios:
        start = ref * torch.exp(torch.tensor(d, dtype=torch.float64))
        start[best] = 0.0
        start[best] = 1.0 - start.sum()
        out.append((d, tv(fixed_point_from(record, start), point)))
    return out


def plain_path(record: dict, advantage: str, n: int | None, lr: float, steps: int) -> float:
    """TV from the end of the plain-gradient path (tree) to the run's final policy pi(a, b)."""
    ref = torch.tensor(record["ref"], dtype=torch.float64)
    rewards = torch.tensor(record["rewards"], dtype=torch.float64)
    solver = record["solver"]
    first, second = tree_plain_flow(ref.sum(-1), ref / ref.sum(-1, keepdim=True), rewards, record["beta"],
                                    solver["estimator"], solver["placement"], advantage=advantage, n=n, lr=lr,
                                    steps=steps)
    return tv(first[:, None] * second, torch.tensor(record["policy"], dtype=torch.float64))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="check", required=True)
    edge = sub.add_parser("clamp-edge", help="the bandit: the solver from the argmax corner, per log-ratio d")
    edge.add_argument("theory_json")
    edge.add_argument("--d", type=float, nargs="+", default=[-1.5, -2.0, -2.4, -2.8, -3.2, -4.0])
    path = sub.add_parser("plain-path", help="the tree: the plain-gradient path's end against the run's end")
    path.add_argument("theory_json")
    path.add_argument("--advantage", default="grpo", help="advantage model of the path (default: %(default)s)")
    path.add_argument("--n", type=int, default=8, help="group size (default: %(default)s)")
    path.add_argument("--lr", type=float, default=0.5)
    path.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args(argv)
    with open(args.theory_json) as f:
        record = json.load(f)
    if args.check == "clamp-edge":
        for d, distance in clamp_edge(record, args.d):
            print(f"d = {d:+.1f}: TV from the solver's end to the fixed point {distance:.3f}")
    else:
        distance = plain_path(record, args.advantage, args.n, args.lr, args.steps)
        print(f"TV from the plain path's end to the run's end: {distance:.3f}")


if __name__ == "__main__":
    main()
