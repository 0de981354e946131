"""Forward against reverse KL on the language model's own states: the habit's decision tokens alone.

    python -m lab.decisions --predict                     # the prediction, from the warm start's own states
    python -m lab.decisions --out outputs/decisions       # the runs (configs/sweeps/decisions.yaml), the report
    python -m lab.decisions --report-only --out outputs/decisions   # the report from the runs' files
    python -m lab.decisions --pg sampled --n 8 --steps 80 --out outputs/decisions-sampled   # the trainer's way

The embedded default's warm start is trained on its habit's decision token and nothing else. A state is a
habit-prone training problem with the right reasoning lines fed in up to the decision token
(lab.habit.decision_contexts, as decision_probabilities builds them); stratum A holds states where the warm
start gives the right token at most 0.04, stratum B at least 0.2, 16 each (the first in the training split).
The reward is 1 for the right token and 0 for any other. A `Regime` says how each step trains: the policy
gradient exact (summed over the vocabulary) or sampled (RLOO over n tokens drawn per state, the trainer's
rlhf.core_algos.group_outcome_advantages); a KL loss sampled (its mean over the n tokens, as the trainer) or in
expectation over the vocabulary; one Adam update on the batch (on-policy), the learning rate decaying linearly
to 0; which strata are trained (the others only measured). The KL is one of RUNS, each computed by the
trainer's module (rlhf.kl): k1 in the reward, k3, k3+ or full in the loss. (k3 corrected for off-policy
samples is k3+ on these exactly on-policy batches, bit for bit, so it is no run of its own.)

At every logged step and at the end, at every state and over the whole vocabulary: KL(pi || ref), KL(ref || pi),
the habit's and the right token's probabilities (`exact_metrics`), kept per state.

The prediction (`predict_states`): with a 0/1 reward both optima keep the reference's ratios within each reward
class, so each state's limit is fixed by its right-token probability alone: the reverse-KL optimum (k1 in the
reward; k3+ and full in the loss) tilts it by e^(1/beta), the forward-KL optimum (k3 in the loss) is the exact
solver's fixed point on (habit, right, rest) (lab.theory.fixed_points, clamp included), and no KL goes to the
right token. This module is the lab's; the trainer never imports it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import asdict, dataclass

import torch

from lab.habit import DECISION_REWARDS, decision_contexts, next_token_probs
from rlhf.core_algos import group_outcome_advantages
from rlhf.kl import full_kl, kl_penalty, parse_estimator

RUNS = ("no-kl", "reward:k1", "loss:k3", "loss:k3+", "loss:full")
FORWARD_RUNS = ("loss:k3",)  # regularise KL(ref || pi); every other KL run KL(pi || ref)
STRATA = {"A": (0.0, 0.04), "B": (0.2, 1.0)}  # the warm start's right-token probability at the state
PER_STRATUM = 16
N = 8  # sampled tokens per state (RLOO's group; the KL loss's samples)
PG = ("exact", "sampled")  # the policy gradient: summed over the vocabulary, or RLOO over the N samples
KL = ("sampled", "expected")  # a KL loss: its mean over the N samples, or its expectation over the vocabulary
METRICS = ("habit", "right", "reverse_kl", "forward_kl")


def check_modes(pg: str, kl: str) -> None:
    """ValueError naming the valid choices unless `pg` is one of PG and `kl` one of KL."""
    if pg not in PG or kl not in KL:
        raise ValueError(f"unknown policy gradient {pg!r} or KL {kl!r}; valid: {', '.join(PG)} and {', '.join(KL)}")


@dataclass
class States:
    """The decision states: right-padded contexts (S, L), their lengths (S,), the habit's and the right token's
    ids (S,), and each state's stratum name."""

    input_ids: torch.Tensor
    lengths: torch.Tensor
    habit: torch.Tensor
    right: torch.Tensor
    strata: list[str]

    def of_strata(self, names) -> States:
        """The states of the strata `names`, in order."""
        keep = torch.tensor([name in names for name in self.strata])
        return States(self.input_ids[keep], self.lengths[keep], self.habit[keep], self.right[keep],
                      [name for name in self.strata if name in names])


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
               generator: torch.Generator, n: int = N, temperature: float = 1.0, pg: str = "sampled",
               kl: str = "sampled") -> torch.Tensor:
    """The step's loss, averaged over states: the policy-gradient loss of reward 1 for the right token, plus, for
    a KL in the loss, beta times its term (every KL from rlhf.kl, the trainer's KLEstimator). `pg` "sampled": the
    mean over n tokens sampled per state from pi of -A log pi, RLOO advantages over each state's samples, as
    the trainer; "exact": -sum_x sg(pi_x) (r_x - E_pi[r]) log pi_x over the whole vocabulary, whose gradient is
    exactly -grad E_pi[r]. k1 in the reward subtracts beta k1 from each sample's score (sampled) or from every
    token's reward (exact) before the advantage. `kl` "sampled": the KL term's mean over the n samples, as the
    trainer; "expected": sum_x sg(pi_x) X(x) over the vocabulary, whose gradient is the estimator's expected
    loss gradient exactly (its clamps included)."""
    if run not in RUNS:
        raise ValueError(f"unknown run {run!r}; valid: {', '.join(RUNS)}")
    check_modes(pg, kl)
    logprobs = torch.log_softmax(logits / temperature, -1)
    ref_logprobs = torch.log_softmax(ref_logits / temperature, -1)
    tokens = torch.multinomial(logprobs.detach().exp(), n, replacement=True, generator=generator)  # (S, n)
    lp, ref_lp = logprobs.gather(1, tokens), ref_logprobs.gather(1, tokens)
    if pg == "exact":
        rewards = torch.zeros_like(logprobs).scatter_(1, states.right[:, None], 1.0)  # (S, V)
        if run == "reward:k1":
            rewards = rewards - beta * kl_penalty(logprobs.detach(), ref_logprobs, "k1")
        probs = logprobs.detach().exp()
        advantages = rewards - (probs * rewards).sum(-1, keepdim=True)
        loss = -(probs * advantages * logprobs).sum(-1).mean()
    else:
        scores = (tokens == states.right[:, None]).to(lp.dtype)
        if run == "reward:k1":
            scores = scores - beta * kl_penalty(lp.detach(), ref_lp, "k1")
        groups = torch.arange(len(tokens)).repeat_interleave(n)
        advantages, _ = group_outcome_advantages(scores.reshape(-1, 1), torch.ones(scores.numel(), 1), groups, "rloo")
        loss = -(advantages.view_as(lp) * lp).mean()
    if run.startswith("loss:"):  # the trainer's estimator object
        estimator = parse_estimator(run.removeprefix("loss:"))
        full = full_kl(logits, ref_logits, temperature)[:, None] if estimator.needs_logits else None  # (S, 1)
        if kl == "sampled" or estimator.needs_logits:
            loss = loss + beta * estimator(lp, ref_lp, full).mean()
        else:
            loss = loss + beta * (logprobs.detach().exp() * estimator(logprobs, ref_logprobs)).sum(-1).mean()
    return loss


@dataclass(frozen=True)
class Regime:
    """How a run trains: the policy gradient (PG) and a KL loss's term (KL), tokens sampled per state, Adam
    updates, the initial learning rate (decaying linearly to 0), and the strata whose states are trained on (the
    others are only measured)."""

    pg: str = "exact"
    kl: str = "sampled"
    n: int = 64
    steps: int = 300
    lr: float = 1e-4
    train_strata: tuple[str, ...] = tuple(STRATA)

    def __post_init__(self):
        check_modes(self.pg, self.kl)
        if not self.train_strata or set(self.train_strata) - set(STRATA):
            raise ValueError(f"train strata {self.train_strata}; valid: a non-empty subset of {', '.join(STRATA)}")


def train(model, states: States, ref_logits: torch.Tensor, run: str, beta: float, seed: int, regime: Regime,
          log_every: int = 10, temperature: float = 1.0) -> dict:
    """One run: `regime.steps` on-policy Adam updates from `model`'s weights (changed in place), on the states of
    `regime.train_strata`. Returns {"steps": [...], per metric: [[per-state values of every state] per logged
    step]}, the last entry the end."""
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=regime.lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / regime.steps)
    history: dict = {"steps": [], **{key: [] for key in METRICS}}
    trained = torch.tensor([name in regime.train_strata for name in states.strata])
    trained_states = states.of_strata(regime.train_strata)

    def log(step, logits):
        history["steps"].append(step)
        for key, value in exact_metrics(logits, ref_logits, states, temperature).items():
            history[key].append([round(v, 6) for v in value.tolist()])

    model.train()
    for step in range(regime.steps):
        logits = decision_logits(model, states)
        if step % log_every == 0:
            log(step, logits.detach())
        loss = loss_terms(logits[trained], ref_logits[trained], trained_states, run, beta, generator, regime.n,
                          temperature, regime.pg, regime.kl)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    model.eval()
    with torch.no_grad():
        log(regime.steps, decision_logits(model, states))
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


def deterministic(run: str, regime: Regime) -> bool:
    """Whether every seed of `run` is the same run: the exact policy gradient and no sampled KL (no KL, k1 in the
    reward, full, or an expected KL loss), so nothing a seed draws enters the update."""
    sampled_kl = run.startswith("loss:") and run != "loss:full" and regime.kl == "sampled"
    return regime.pg == "exact" and not sampled_kl


def run_grid(config: str, runs, betas, seeds, regime: Regime, out_dir: str, log=print) -> dict:
    """Every (run, beta, seed) from the warm start (no KL once per seed: beta does not enter it); writes and
    returns {"regime", "strata", "reference", "prediction", "runs": {f"{run}@{beta}": {seed: history}}, "tv":
    {key: {seed: {stratum: mean}}}, "tv_per_state": {key: {seed: [per state]}}, "timing_s"}."""
    model, tokenizer, problems, temperature = load_warm_start(config)
    start_state = {k: v.clone() for k, v in model.state_dict().items()}
    states = decision_states(model, tokenizer, problems, temperature=temperature, pad_id=tokenizer.pad_token_id or 0)
    with torch.no_grad():
        ref_logits = decision_logits(model, states).double()
    ref_probs = torch.softmax(ref_logits / temperature, -1)
    result = {"config": config, "regime": asdict(regime), "strata": states.strata,
              "reference": {key: v.tolist() for key, v in exact_metrics(ref_logits, ref_logits, states,
                                                                           temperature).items()},
              "prediction": predict_states(ref_probs, states, betas), "runs": {}, "timing_s": {}, "tv": {},
              "tv_per_state": {}, "limit_habit": {},
              "run_order": list(runs)}
    limit_policies = {beta: limits(ref_probs, states, beta) for beta in betas}
    for beta, policies in limit_policies.items():  # each state's limit habit, for the per-state ends
        result["limit_habit"][str(beta)] = {name: [round(v, 6) for v in limit_metrics(limit, ref_probs, states)[
            "habit"].tolist()] for name, limit in policies.items()}
    os.makedirs(out_dir, exist_ok=True)
    for run in runs:
        for beta in ([betas[0]] if run == "no-kl" else betas):
            key = f"{run}@{beta}" if run != "no-kl" else "no-kl"
            for seed in seeds[:1] if deterministic(run, regime) else seeds:
                model.load_state_dict(start_state)
                began = time.perf_counter()
                result["runs"].setdefault(key, {})[seed] = train(model, states, ref_logits.float(), run, beta, seed,
                                                                 regime, temperature=temperature)
                result["timing_s"][f"{key}/{seed}"] = round(time.perf_counter() - began, 1)
                with torch.no_grad():
                    end = torch.softmax(decision_logits(model, states).double() / temperature, -1)
                tv = 0.5 * (end - limit_policies[beta][limit_of(run)]).abs().sum(-1)
                result["tv"].setdefault(key, {})[seed] = by_stratum(tv, states)
                result["tv_per_state"].setdefault(key, {})[seed] = [round(v, 6) for v in tv.tolist()]
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
            merged = {**result, "runs": {}, "tv": {}, "tv_per_state": {}, "timing_s": {}}
        if result["regime"] != merged["regime"]:  # one regime a table
            raise ValueError(f"{path} was run in regime {result['regime']}, not {merged['regime']}: one regime "
                             "per --out directory")
        for part in ("runs", "tv", "tv_per_state"):
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


def as_regime(saved: dict) -> dict:
    """A Regime's fields as json.dump saved them (train_strata back to a tuple)."""
    return {**saved, "train_strata": tuple(saved["train_strata"])}


def report(result: dict) -> str:
    """Markdown: the regime; per beta and stratum, each run's end (mean ± 95% t-interval over seeds) against its
    limit, its TV to the limit, how many of the stratum's states end with the habit past k3's lower clamp edge
    and how many below their limit's habit; and the paired k3 − k3+ differences against the predicted one."""
    from rlhf.kl import K3_CLAMP_EDGES
    from rlhf.stats import Estimate, paired_differences

    strata, regime = result["strata"], result["regime"]
    members = {s: [i for i, name in enumerate(strata) if name == s] for s in STRATA}
    ref_habit = torch.tensor(result["reference"]["habit"], dtype=torch.float64)

    def cell(values) -> str:
        e = Estimate(tuple(values))
        return f"{e.mean:.3f}" + (f" ± {e.half_width:.3f}" if e.half_width is not None else "")

    def counts(key, seeds, s, beta, run) -> str:
        """'past / below': mean over seeds of the stratum's states whose habit ends past k3's lower edge (d <
        -2.61) and below its limit's habit (by more than 0.005)."""
        limit = torch.tensor(result["limit_habit"][str(beta)][limit_of(run)], dtype=torch.float64)[members[s]]
        past, below = [], []
        for seed in seeds:
            habit = run_end(result, key, seed, "habit")[members[s]]
            past.append(((habit / ref_habit[members[s]]).log() < K3_CLAMP_EDGES[0]).sum().item())
            below.append((habit < limit - 0.005).sum().item())
        return f"{sum(past) / len(seeds):.1f} / {sum(below) / len(seeds):.1f}"

    lines = [f"Regime: policy gradient {regime['pg']}, KL loss {regime['kl']}, n = {regime['n']} tokens a state, "
             f"{regime['steps']} Adam steps from lr {regime['lr']:g} (linear to 0), trained on strata "
             f"{' and '.join(regime['train_strata'])}.", ""]
    # the coefficients run; no KL's limit is the same at every one, so a grid of no KL alone reports at the first
    betas = sorted({float(k.split("@")[1]) for k in result["runs"] if "@" in k}) or [float(next(iter(result["prediction"])))]
    for beta in betas:
        pred = result["prediction"][str(beta)] if str(beta) in result["prediction"] else result["prediction"][beta]
        for s in STRATA:
            trained = "trained" if s in regime["train_strata"] else "measured only, not trained on"
            lines += [f"**beta = {beta}, stratum {s}** ({len(members[s])} states, {trained}; measured: mean ± 95% "
                      "t-interval over seeds of the stratum's mean at the end; predicted: the limit's)", "",
                      "| run | seeds | habit: measured / predicted | right token | KL(pi‖ref) | KL(ref‖pi) | TV to its limit "
                      "| states: habit past the edge / below its limit |",
                      "|---|---|---|---|---|---|---|---|"]
            for run in result["run_order"]:
                key = "no-kl" if run == "no-kl" else f"{run}@{beta}"
                if key not in result["runs"]:
                    continue
                seeds = sorted(result["runs"][key])[:1 if deterministic(run, Regime(**as_regime(regime))) else None]
                limit = pred[limit_of(run)][s]
                row = [run, str(len(seeds))]
                for metric in METRICS:
                    values = [run_end(result, key, seed, metric)[members[s]].mean().item() for seed in seeds]
                    row.append(f"{cell(values)} / {limit[metric]:.3f}")
                row += [cell([result["tv"][key][seed][s] for seed in seeds]), counts(key, seeds, s, beta, run)]
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


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, parsed; its defaults are the documented grid (configs/sweeps/decisions.yaml's)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--predict", action="store_true", help="print the prediction only (no training)")
    parser.add_argument("--runs", nargs="+", default=list(RUNS))
    parser.add_argument("--beta", type=float, nargs="+", default=[0.2, 0.3])
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 43, 44, 45, 46])
    default = Regime()
    parser.add_argument("--pg", choices=PG, default=default.pg,
                        help="the policy gradient: summed over the vocabulary (exact) or RLOO over --n samples")
    parser.add_argument("--kl", choices=KL, default=default.kl,
                        help="a KL loss: its mean over --n samples (sampled) or its expectation over the vocabulary")
    parser.add_argument("--n", type=int, default=default.n, help="tokens sampled per state")
    parser.add_argument("--steps", type=int, default=default.steps)
    parser.add_argument("--lr", type=float, default=default.lr, help="Adam's initial learning rate (to 0 linearly)")
    parser.add_argument("--train-strata", nargs="+", choices=list(STRATA), default=list(default.train_strata),
                        help="train on these strata's states only (the others are measured, not trained on)")
    parser.add_argument("--out", default="outputs/decisions")
    parser.add_argument("--report-only", action="store_true", help="the report from --out's decisions*.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = arguments(argv)
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
        regime = Regime(args.pg, args.kl, args.n, args.steps, args.lr, tuple(args.train_strata))
        run_grid(args.config, args.runs, args.beta, args.seeds, regime, args.out)
    text = report(load_results(args.out))
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
