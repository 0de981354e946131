"""Forward against reverse KL on the language model's own states: the habit's decision tokens alone.

    python -m lab.decisions --predict                     # the prediction, from the warm start's own states
    python -m lab.decisions --out outputs/decisions       # the runs (configs/sweeps/decisions.yaml), the report
    python -m lab.decisions --report-only --out outputs/decisions   # the report from the runs' files

The embedded default's warm start is trained on its habit's decision token and nothing else. A state is a
habit-prone training problem with the right reasoning lines fed in up to the decision token
(lab.habit.decision_contexts, as decision_probabilities builds them); stratum A holds states where the warm
start gives the right token at most 0.04, stratum B at least 0.2, 16 each (the first in the training split).
Each step samples n = 8 tokens per state from the policy at the decision, rewards 1 for the right token and 0
for any other, takes RLOO advantages (the trainer's rlhf.core_algos.group_outcome_advantages) and makes exactly
one Adam update on the batch (on-policy), the learning rate decaying linearly to 0. The KL is one of RUNS,
each computed by the trainer's module (rlhf.kl): k1 in the reward, k3, k3+ or full in the loss, or k3 in the
loss importance-weighted by pi / sg(pi) (kl_penalty's old_logprob, rho in the graph: "corrected k3").

At every logged step and at the end, at every state and over the whole vocabulary: KL(pi || ref), KL(ref || pi),
the habit's and the right token's probabilities (`exact_metrics`), kept per stratum.

The prediction (`predict_states`): with a 0/1 reward both optima keep the reference's ratios within each reward
class, so each state's limit is fixed by its right-token probability alone: the reverse-KL optimum (k1 in the
reward; k3+, full and corrected k3 in the loss) tilts it by e^(1/beta), the forward-KL optimum (k3 in the loss)
is the exact solver's fixed point on (habit, right, rest) (lab.theory.fixed_points, clamp included), and no KL
goes to the right token. This module is the lab's; the trainer never imports it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import dataclass

import torch

from lab.habit import DECISION_REWARDS, decision_contexts, next_token_probs
from rlhf.core_algos import group_outcome_advantages
from rlhf.kl import full_kl, kl_penalty, parse_estimator

RUNS = ("no-kl", "reward:k1", "loss:k3", "loss:k3+", "loss:full", "loss:k3-corrected")
FORWARD_RUNS = ("loss:k3",)  # regularise KL(ref || pi); every other KL run KL(pi || ref)
STRATA = {"A": (0.0, 0.04), "B": (0.2, 1.0)}  # the warm start's right-token probability at the state
PER_STRATUM = 16
N = 8  # sampled tokens per state (RLOO's group)
METRICS = ("habit", "right", "reverse_kl", "forward_kl")


@dataclass
class States:
    """The decision states: right-padded contexts (S, L), their lengths (S,), the habit's and the right token's
    ids (S,), and each state's stratum name."""

    input_ids: torch.Tensor
    lengths: torch.Tensor
    habit: torch.Tensor
    right: torch.Tensor
    strata: list[str]


def stratum_of(right_probability: float) -> str | None:
    """The stratum whose interval (inclusive) holds the reference's right-token probability, else None."""
    return next((name for name, (low, high) in STRATA.items() if low <= right_probability <= high), None)


def decision_logits(model, states: States) -> torch.Tensor:
    """(S, V) the model's logits at each state's decision token (the last position of its context)."""
    mask = (torch.arange(states.input_ids.shape[1])[None] < states.lengths[:, None]).long()
    logits = model(input_ids=states.input_ids, attention_mask=mask).logits
    return logits[torch.arange(len(states.lengths)), states.lengths - 1]


@torch.no_grad()
def decision_states(model, tokenizer, problems, per_stratum: int = PER_STRATUM, temperature: float = 1.0,
                    pad_id: int = 0) -> States:
    """The first `per_stratum` habit-prone problems of `problems` in each stratum, by the model's right-token
    probability at the decision (softmax(logits / temperature)). Raises ValueError if a stratum runs short."""
    chosen: dict[str, list] = {name: [] for name in STRATA}
    for context, habit, right in decision_contexts(tokenizer, problems):
        name = stratum_of(next_token_probs(model, context, temperature)[right].item())
        if name is not None and len(chosen[name]) < per_stratum:
            chosen[name].append((context, habit, right))
        if all(len(rows) == per_stratum for rows in chosen.values()):
            break
    short = {name: len(rows) for name, rows in chosen.items() if len(rows) < per_stratum}
    if short:
        raise ValueError(f"too few states in strata {short} (wanted {per_stratum} each)")
    rows = [(name, row) for name in STRATA for row in chosen[name]]
    longest = max(len(row[0]) for _, row in rows)
    ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    for i, (_, (context, _, _)) in enumerate(rows):
        ids[i, :len(context)] = torch.tensor(context)
    return States(ids, torch.tensor([len(row[0]) for _, row in rows]), torch.tensor([row[1] for _, row in rows]),
                  torch.tensor([row[2] for _, row in rows]), [name for name, _ in rows])


@torch.no_grad()
def exact_metrics(logits: torch.Tensor, ref_logits: torch.Tensor, states: States, temperature: float = 1.0
                  ) -> dict[str, torch.Tensor]:
    """Per state (S,), over the whole vocabulary: KL(pi || ref), KL(ref || pi) (rlhf.kl.full_kl), and pi's
    probabilities of the habit's and the right token; pi = softmax(logits / temperature)."""
    probs = torch.softmax(logits.double() / temperature, -1)
    rows = torch.arange(len(states.habit))
    return {"habit": probs[rows, states.habit], "right": probs[rows, states.right],
            "reverse_kl": full_kl(logits.double(), ref_logits.double(), temperature),
            "forward_kl": full_kl(ref_logits.double(), logits.double(), temperature)}


def loss_terms(logits: torch.Tensor, ref_logits: torch.Tensor, states: States, run: str, beta: float,
               generator: torch.Generator, n: int = N, temperature: float = 1.0) -> torch.Tensor:
    """The step's loss: n tokens sampled per state from pi, reward 1 for the right token, RLOO advantages over
    each state's n samples, the policy-gradient loss (the mean over samples of -A log pi) plus, for a KL in
    the loss, beta times its mean term (every KL from rlhf.kl). k1 in the reward subtracts beta k1 of each
    sample from its score before the advantage."""
    if run not in RUNS:
        raise ValueError(f"unknown run {run!r}; valid: {', '.join(RUNS)}")
    logprobs = torch.log_softmax(logits / temperature, -1)
    ref_logprobs = torch.log_softmax(ref_logits / temperature, -1)
    tokens = torch.multinomial(logprobs.detach().exp(), n, replacement=True, generator=generator)  # (S, n)
    lp, ref_lp = logprobs.gather(1, tokens), ref_logprobs.gather(1, tokens)
    scores = (tokens == states.right[:, None]).to(lp.dtype)
    if run == "reward:k1":
        scores = scores - beta * kl_penalty(lp.detach(), ref_lp, "k1")
    groups = torch.arange(len(tokens)).repeat_interleave(n)
    advantages, _ = group_outcome_advantages(scores.reshape(-1, 1), torch.ones(scores.numel(), 1), groups, "rloo")
    loss = -(advantages.view_as(lp) * lp).mean()
    if run.startswith("loss:"):  # the trainer's estimator object; `-corrected`: weighted by rho (on-policy: 1)
        estimator = parse_estimator(run.removeprefix("loss:").removesuffix("-corrected"))
        full = full_kl(logits, ref_logits, temperature)[:, None] if estimator.needs_logits else None  # (S, 1)
        old = lp.detach() if run.endswith("-corrected") else None
        loss = loss + beta * estimator(lp, ref_lp, full, old).mean()
    return loss


def train(model, states: States, ref_logits: torch.Tensor, run: str, beta: float, seed: int, steps: int,
          lr: float, log_every: int = 10, temperature: float = 1.0) -> dict:
    """One run: `steps` on-policy Adam updates (lr decaying linearly to 0) from `model`'s weights (changed in
    place). Returns {"steps": [...], per metric: [[per-state values] per logged step]}, the last entry the end."""
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / steps)
    history: dict = {"steps": [], **{key: [] for key in METRICS}}

    def log(step, logits):
        history["steps"].append(step)
        for key, value in exact_metrics(logits, ref_logits, states, temperature).items():
            history[key].append([round(v, 6) for v in value.tolist()])

    model.train()
    for step in range(steps):
        logits = decision_logits(model, states)
        if step % log_every == 0:
            log(step, logits.detach())
        loss = loss_terms(logits, ref_logits, states, run, beta, generator, temperature=temperature)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    model.eval()
    with torch.no_grad():
        log(steps, decision_logits(model, states))
    return history


# ----------------------------------------------------------------------------- the prediction


def class_limit(ref_probs: torch.Tensor, states: States, right_limit: torch.Tensor) -> torch.Tensor:
    """(S, V) the limit policy whose right token has `right_limit` (S,) and whose other tokens keep the
    reference's ratios (what both optima do under a 0/1 reward)."""
    rows = torch.arange(len(states.right))
    ref_right = ref_probs[rows, states.right]
    limit = ref_probs * ((1 - right_limit) / (1 - ref_right))[:, None]
    limit[rows, states.right] = right_limit
    return limit


def limits(ref_probs: torch.Tensor, states: States, beta: float) -> dict[str, torch.Tensor]:
    """{"forward", "reverse", "no-kl"}: (S, V) each state's limit: the solver's k3-in-the-loss fixed point on
    (habit, right, rest) under RLOO's advantages (exact in expectation), the reverse-KL optimum, the right token."""
    from lab.theory.fixed_points import bandit_fixed_point
    from lab.theory.optima import reverse_kl_optimum

    rows = torch.arange(len(states.right))
    q, p = ref_probs[rows, states.habit], ref_probs[rows, states.right]
    three = torch.stack([q, p, 1 - q - p], -1)
    rewards = torch.tensor(DECISION_REWARDS, dtype=torch.float64)
    forward = torch.stack([bandit_fixed_point(row, rewards, beta, "k3", "loss")[1] for row in three])
    reverse = reverse_kl_optimum(three, rewards.expand_as(three), beta)[:, 1]
    return {"forward": class_limit(ref_probs, states, forward), "reverse": class_limit(ref_probs, states, reverse),
            "no-kl": class_limit(ref_probs, states, torch.ones_like(p) - 1e-12)}


def limit_of(run: str) -> str:
    return "no-kl" if run == "no-kl" else "forward" if run in FORWARD_RUNS else "reverse"


def limit_metrics(limit: torch.Tensor, ref_probs: torch.Tensor, states: States) -> dict[str, torch.Tensor]:
    """exact_metrics of a limit policy (S, V) given as probabilities."""
    rows = torch.arange(len(states.right))
    ratio = (limit / ref_probs).log()
    return {"habit": limit[rows, states.habit], "right": limit[rows, states.right],
            "reverse_kl": (limit * ratio).sum(-1), "forward_kl": -(ref_probs * ratio).sum(-1)}


def predict_states(ref_probs: torch.Tensor, states: States, betas) -> dict:
    """{beta: {limit name: {stratum: {metric: mean over the stratum's states}}}}, and k3 − k3+ per stratum."""
    out = {}
    for beta in betas:
        per = {}
        for name, limit in limits(ref_probs, states, beta).items():
            values = limit_metrics(limit, ref_probs, states)
            per[name] = {s: {key: by_stratum(value, states)[s] for key, value in values.items()} for s in STRATA}
        out[beta] = per
    return out


def by_stratum(values: torch.Tensor, states: States) -> dict[str, float]:
    """The mean of per-state `values` (S,) within each stratum."""
    return {s: values[[i for i, name in enumerate(states.strata) if name == s]].double().mean().item()
            for s in STRATA}


# ----------------------------------------------------------------------------- the grid and its report


def load_warm_start(config: str):
    """(model, tokenizer, training problems, temperature) of the embedded default built by `config`."""
    from rlhf.config import load_config
    from rlhf.data import load_gsm8k
    from rlhf.embedded import embedded_cache_dir, embedded_options, prepare_embedded_default
    from rlhf.models import load_causal_lm, load_tokenizer

    cfg = load_config(config)
    artifacts = prepare_embedded_default(embedded_cache_dir(cfg), embedded_options(cfg), log=lambda *_: None)
    problems = load_gsm8k(artifacts.train_file, cfg.data.train_split)
    return (load_causal_lm(artifacts.model_dir).eval(), load_tokenizer(artifacts.model_dir), problems,
            cfg.rollout.temperature)


def run_grid(config: str, runs, betas, seeds, steps: int, lr: float, out_dir: str, log=print) -> dict:
    """Every (run, beta, seed) from the warm start (no KL once per seed: beta does not enter it); writes and
    returns {"states", "prediction", "runs": {f"{run}@{beta}": {seed: history}}, "timing_s"}."""
    model, tokenizer, problems, temperature = load_warm_start(config)
    start_state = {k: v.clone() for k, v in model.state_dict().items()}
    states = decision_states(model, tokenizer, problems, temperature=temperature, pad_id=tokenizer.pad_token_id or 0)
    with torch.no_grad():
        ref_logits = decision_logits(model, states).double()
    ref_probs = torch.softmax(ref_logits / temperature, -1)
    result = {"config": config, "steps": steps, "lr": lr, "n": N, "strata": states.strata,
              "reference": {key: v.tolist() for key, v in exact_metrics(ref_logits, ref_logits, states,
                                                                           temperature).items()},
              "prediction": predict_states(ref_probs, states, betas), "runs": {}, "timing_s": {}, "tv": {},
              "run_order": list(runs)}
    limit_policies = {beta: limits(ref_probs, states, beta) for beta in betas}
    os.makedirs(out_dir, exist_ok=True)
    for run in runs:
        for beta in ([betas[0]] if run == "no-kl" else betas):
            key = f"{run}@{beta}" if run != "no-kl" else "no-kl"
            for seed in seeds:
                model.load_state_dict(start_state)
                began = time.perf_counter()
                result["runs"].setdefault(key, {})[seed] = train(model, states, ref_logits.float(), run, beta, seed,
                                                                 steps, lr, temperature=temperature)
                result["timing_s"][f"{key}/{seed}"] = round(time.perf_counter() - began, 1)
                with torch.no_grad():
                    end = torch.softmax(decision_logits(model, states).double() / temperature, -1)
                tv = 0.5 * (end - limit_policies[beta][limit_of(run)]).abs().sum(-1)
                result["tv"].setdefault(key, {})[seed] = by_stratum(tv, states)
                log(f"{key} seed {seed}: {result['timing_s'][f'{key}/{seed}']} s")
                with open(os.path.join(out_dir, f"decisions-{'-'.join(map(str, betas))}-{'-'.join(map(str, seeds))}.json"), "w") as f:
                    json.dump(result, f)
    return result


def load_results(out_dir: str) -> dict:
    """The results of every decisions*.json under `out_dir` merged (one file per sweep agent): runs, TVs and
    timings joined, the states and prediction from the first (every file has the same)."""
    import glob

    merged: dict = {}
    for path in sorted(glob.glob(os.path.join(out_dir, "decisions*.json"))):
        with open(path) as f:
            result = json.load(f)
        if not merged:
            merged = {**result, "runs": {}, "tv": {}, "timing_s": {}}
        for part in ("runs", "tv"):
            for key, seeds in result[part].items():
                merged[part].setdefault(key, {}).update(seeds)
        merged["timing_s"].update(result["timing_s"])
        merged["run_order"] = [r for r in RUNS if any(k.split("@")[0] == r for k in merged["runs"])]
    if not merged:
        raise FileNotFoundError(f"no decisions*.json under {out_dir}")
    return merged


def run_end(result: dict, key: str, seed, metric: str) -> torch.Tensor:
    """(S,) a run's per-state `metric` at its end."""
    return torch.tensor(result["runs"][key][seed][metric][-1], dtype=torch.float64)


def report(result: dict) -> str:
    """Markdown: per beta and stratum, each run's end (mean ± 95% t-interval over seeds) against its limit, and
    the paired k3 − k3+ differences against the predicted one."""
    from rlhf.stats import Estimate, paired_differences

    strata = result["strata"]
    members = {s: [i for i, name in enumerate(strata) if name == s] for s in STRATA}

    def cell(values) -> str:
        e = Estimate(tuple(values))
        return f"{e.mean:.3f}" + (f" ± {e.half_width:.3f}" if e.half_width is not None else "")

    lines = []
    betas = sorted({float(k.split("@")[1]) for k in result["runs"] if "@" in k})
    for beta in betas:
        pred = result["prediction"][str(beta)] if str(beta) in result["prediction"] else result["prediction"][beta]
        for s in STRATA:
            lines += [f"**beta = {beta}, stratum {s}** ({len(members[s])} states; measured: mean ± 95% t-interval "
                      "over seeds of the stratum's mean at the end; predicted: the limit's)", "",
                      "| run | habit: measured / predicted | right token | KL(pi‖ref) | KL(ref‖pi) | TV to its limit |",
                      "|---|---|---|---|---|---|"]
            for run in result["run_order"]:
                key = "no-kl" if run == "no-kl" else f"{run}@{beta}"
                if key not in result["runs"]:
                    continue
                seeds = sorted(result["runs"][key])
                limit = pred[limit_of(run)][s]
                row = [run]
                for metric in METRICS:
                    values = [run_end(result, key, seed, metric)[members[s]].mean().item() for seed in seeds]
                    row.append(f"{cell(values)} / {limit[metric]:.3f}")
                tv = [result["tv"][key][seed][s] for seed in seeds] if "tv" in result else []
                row.append(cell(tv) if tv else "n/a")
                lines.append("| " + " | ".join(row) + " |")
            lines.append("")
            k3, k3p = f"loss:k3@{beta}", f"loss:k3+@{beta}"
            if k3 in result["runs"] and k3p in result["runs"]:
                lines += ["| k3 − k3+ (paired over seeds) | measured | predicted |", "|---|---|---|"]
                for metric in METRICS:
                    per = {key: {seed: run_end(result, key, seed, metric)[members[s]].mean().item()
                                 for seed in result["runs"][key]} for key in (k3, k3p)}
                    d = paired_differences(per[k3], per[k3p])
                    predicted = pred["forward"][s][metric] - pred["reverse"][s][metric]
                    lines.append(f"| {metric} | {d.mean:+.3f}" + (f" ± {d.half_width:.3f}" if d.half_width is not None
                                                                  else "") + f" ({d.n} seeds) | {predicted:+.3f} |")
                lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--predict", action="store_true", help="print the prediction only (no training)")
    parser.add_argument("--runs", nargs="+", default=list(RUNS))
    parser.add_argument("--beta", type=float, nargs="+", default=[0.2, 0.3])
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 43, 44])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--out", default="outputs/decisions")
    parser.add_argument("--report-only", action="store_true", help="the report from --out's decisions*.json")
    args = parser.parse_args(argv)
    import transformers

    transformers.logging.disable_progress_bar()
    if args.predict:
        model, tokenizer, problems, temperature = load_warm_start(args.config)
        states = decision_states(model, tokenizer, problems, temperature=temperature)
        with torch.no_grad():
            ref_probs = torch.softmax(decision_logits(model, states).double() / temperature, -1)
        pred = predict_states(ref_probs, states, args.beta)
        print(json.dumps(pred, indent=1))
        return
    if not args.report_only:
        run_grid(args.config, args.runs, args.beta, args.seeds, args.steps, args.lr, args.out)
    text = report(load_results(args.out))
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
