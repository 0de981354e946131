"""The embedded default's planted habit: what training does to it, and where a KL lets it stop.

    python -m lab.habit outputs/tiny                                # a run's greedy answers, classified
    python -m lab.habit --predict --config configs/tiny.yaml --beta 0.1 0.3   # where each KL stops it

The warm-start demos of the embedded default end, for most multi-step problems, with the first step's
result instead of the last (`task.options.sft_early_answer_frac`, see `rlhf.embedded`). The trainer logs the
share of such answers at every evaluation (`habit_metric`: `val/habit_rate` sampled, `val/greedy_habit_rate`
greedy). The first command decodes the held-out split greedily for the warm start and every checkpoint of a
finished run and counts the answers that are correct, that report the first step's result (the habit), and
that are otherwise wrong (docs/results.md's table). The second reads the warm start's probabilities at the
habit's decision token (`decision_probabilities`) and says where training stops on them with k3 in the loss
(the forward KL) and with k3+ (the reverse KL), by the exact solver (docs/kl.md, "The habit a forward KL
keeps").
"""

from __future__ import annotations

import argparse
import os
from collections import Counter

import torch

from rlhf.embedded import CATEGORIES, classify, held_out_problems  # noqa: F401  (the metric is the trainer's)


@torch.no_grad()
def greedy_counts(model, tokenizer, problems, max_prompt_length: int, max_response_length: int,
                  method: str = "strict", batch_size: int = 128) -> Counter:
    """Counts of `CATEGORIES` over the greedy answers of `model` to `problems` (a GSM8K-schema Dataset)."""
    from rlhf.data import tokenize_prompts
    from rlhf.rollout import SamplingParams, generate, left_pad

    prompts, num_filtered = tokenize_prompts(problems, tokenizer, max_prompt_length)
    if num_filtered:  # the rows would no longer line up with their answers
        raise ValueError(f"{num_filtered} held-out prompts are longer than data.max_prompt_length={max_prompt_length}")
    params = SamplingParams(max_response_length, greedy=True)
    counts = Counter({c: 0 for c in CATEGORIES})
    for start in range(0, len(prompts), batch_size):
        ids = prompts[start:start + batch_size]["input_ids"]
        seq = generate(model, tokenizer, *left_pad(ids, tokenizer.pad_token_id), params)
        texts = tokenizer.batch_decode(seq.response_ids, skip_special_tokens=True)
        counts.update(classify(t, a, method) for t, a in zip(texts, problems[start:start + batch_size]["answer"]))
    return counts


# ----------------------------------------------------------------------------- where a KL keeps the habit


def decision_contexts(tokenizer, problems) -> list[tuple[list[int], int, int]]:
    """[(context ids, habit token id, right token id)] for each problem whose first step's result is not its
    answer: the prompt and the right response up to the habit's decision token (decision_probabilities).

    The decision token is the first token where the response that reports the first step's result differs
    from the right response, both with the right reasoning lines ("...\n#### 12" against "...\n#### 2"):
    the first digit after `#### `, or a later one when the two numbers share their first digits."""
    from rlhf.data import build_prompt
    from rlhf.embedded import answer_with_first_result

    add_special_tokens = not getattr(tokenizer, "chat_template", None)  # as rlhf.data.tokenize_prompts
    out = []
    for question, answer in zip(problems["question"], problems["answer"]):
        habit = answer_with_first_result(answer)
        if habit == answer:  # one-step problems, and those whose first result is the answer: no habit to drop
            continue
        prompt = tokenizer(build_prompt(tokenizer, question), add_special_tokens=add_special_tokens)["input_ids"]
        # + EOS, as the warm start's demos end: "#### 1" and "#### 12" part at the EOS after "1".
        right_ids, habit_ids = (tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                                for text in (answer, habit))
        at = next(i for i, (a, b) in enumerate(zip(right_ids, habit_ids)) if a != b)
        out.append((prompt + right_ids[:at], habit_ids[at], right_ids[at]))
    return out


@torch.no_grad()
def next_token_probs(model, context: list[int], temperature: float = 1.0) -> torch.Tensor:
    """(V,) float64: the sampling policy after `context`, softmax(logits / temperature)."""
    return torch.softmax(model(input_ids=torch.tensor([context])).logits[0, -1].double() / temperature, -1)


@torch.no_grad()
def decision_probabilities(model, tokenizer, problems, temperature: float = 1.0) -> torch.Tensor:
    """(N, 3) float64: for each held-out problem whose first step's result is not its answer (N of them), the
    policy's probabilities at the habit's decision token, [habit, right, any other token] (decision_contexts).
    The policy is the sampling one, softmax(logits / temperature)."""
    rows = []
    for context, habit, right in decision_contexts(tokenizer, problems):
        probs = next_token_probs(model, context, temperature)
        q, p = probs[habit].item(), probs[right].item()
        rows.append([q, p, 1.0 - q - p])
    return torch.tensor(rows, dtype=torch.float64)


# The reward at the decision: reporting the right number is worth 1, the habit and any other token 0.
DECISION_REWARDS = (0.0, 1.0, 0.0)


def habit_limits(ref_probs: torch.Tensor, beta: float) -> dict[str, torch.Tensor]:
    """(N,) the habit's probability where training stops at each decision of `ref_probs` (N, 3), under exact
    (or RLOO's) advantages and DECISION_REWARDS: "forward", the forward-KL optimum a k3 loss reaches
    (pi_x = beta ref_x / (lam - r_x): the habit keeps beta q / lam, lam in (1, 1 + beta]); "reverse", the
    reverse-KL optimum of k1 in the reward and k2, X+ and full in the loss (ref exp(r / beta), renormalised:
    the habit's share falls as e^(-1 / beta)). docs/kl.md, 'The habit a forward KL keeps', derives them."""
    from lab.theory.optima import forward_kl_optimum, reverse_kl_optimum

    rewards = torch.tensor(DECISION_REWARDS, dtype=torch.float64).expand_as(ref_probs)
    return {"forward": forward_kl_optimum(ref_probs, rewards, beta)[:, 0],
            "reverse": reverse_kl_optimum(ref_probs, rewards, beta)[:, 0]}


def edge_margins(ref_probs: torch.Tensor, beta) -> torch.Tensor:
    """(N,) nats between the forward-KL optimum and k3's lower clamp edge at each decision of `ref_probs` (N, 3):
    the habit's d = log(beta / lam) there (every token scored 0 shares it) minus the edge's -2.61087; negative
    where the optimum lies past the edge, where a k3 loss no longer holds it. `beta` a float or (N, 1)."""
    from rlhf.kl import K3_CLAMP_EDGES

    return (habit_limits(ref_probs, beta)["forward"] / ref_probs[:, 0]).log() - K3_CLAMP_EDGES[0]


def crossing_betas(ref_probs: torch.Tensor) -> torch.Tensor:
    """(N,) the coefficient below which each decision's forward-KL optimum lies past k3's clamp edge: the root of
    edge_margins in beta (it increases with beta), by bisection on [1e-3, 1]."""
    from lab.theory.optima import _bisect

    n = len(ref_probs)
    return _bisect(lambda beta: edge_margins(ref_probs, beta)[:, None], torch.full((n, 1), 1e-3, dtype=torch.float64),
                   torch.ones(n, 1, dtype=torch.float64))[:, 0]


def solver_limits(ref_probs: torch.Tensor, beta: float, advantage: str = "rloo", n: int | None = 4
                  ) -> dict[str, torch.Tensor]:
    """(N,) the habit's probability where the exact solver (lab.theory.fixed_points) takes k3 and k3+ in
    the loss from each decision of `ref_probs` (N, 3), under the trainer's advantage estimator `advantage`
    with group size n: habit_limits' two optima where the clamp and the estimator leave them (RLOO, where the
    forward optimum lies inside k3's clamp edge: beta above ~0.074 on the embedded default's decisions),
    elsewhere the corner or the point the estimator moves them to (docs/kl.md, "verl's clamp")."""
    from lab.theory.fixed_points import bandit_fixed_point

    rewards = torch.tensor(DECISION_REWARDS, dtype=torch.float64)
    return {name: torch.stack([bandit_fixed_point(row, rewards, beta, estimator, "loss", advantage=advantage,
                                                  n=n)[0] for row in ref_probs])
            for name, estimator in (("k3", "k3"), ("k3+", "k3+"))}


def predict(model, tokenizer, problems, betas, temperature: float = 1.0, advantage: str = "rloo",
            n: int | None = 4) -> dict:
    """The prediction for `problems` (all the held-out split): the decision probabilities' summary and, per
    beta, the habit rate where training stops (each habit-prone problem's habit probability, summed and
    divided by all problems: the rate if every response reached the decision with the right reasoning lines)
    for k3 in the loss and for k3+ in the loss (which k2 and full in the loss and k1 in the reward share under
    RLOO) by the exact solver, and the closed-form forward-KL optimum; `reference_rate`: the same for pi_ref."""
    ref = decision_probabilities(model, tokenizer, problems, temperature)
    total = len(problems["question"])
    out = {"num_problems": total, "num_habit_prone": len(ref), "q_mean": ref[:, 0].mean().item(),
           "q_median": ref[:, 0].median().item(), "right_median": ref[:, 1].median().item(),
           "reference_rate": ref[:, 0].sum().item() / total, "advantage": advantage, "n": n, "betas": {}}
    crossing = crossing_betas(ref)
    out["crossing_beta"] = {"min": crossing.min().item(), "median": crossing.median().item(),
                            "max": crossing.max().item()}
    for beta in betas:
        limits = {**solver_limits(ref, beta, advantage, n), "forward_optimum": habit_limits(ref, beta)["forward"]}
        out["betas"][beta] = {name: pi.sum().item() / total for name, pi in limits.items()}
        margins = edge_margins(ref, beta)
        out["betas"][beta]["margin"] = {"min": margins.min().item(), "median": margins.median().item(),
                                        "past": int((margins < 0).sum())}
    return out


def report(output_dir: str) -> list[tuple[str, Counter]]:
    """[(label, counts)] for the warm start and each checkpoint under `output_dir`, oldest first."""
    from safetensors.torch import load_file

    from rlhf.checkpoint import checkpoint_step, list_checkpoints
    from rlhf.config import load_config
    from rlhf.data import load_gsm8k
    from rlhf.embedded import embedded_options, prepare_embedded_default
    from rlhf.models import load_causal_lm, load_tokenizer

    cfg = load_config(os.path.join(output_dir, "config.yaml"))
    if cfg.task.name != "embedded" or cfg.model.path != "embedded" or cfg.data.val_files != "embedded":
        raise ValueError(f"{output_dir} is not a run of the embedded default (model.path={cfg.model.path!r}, "
                         f"data.val_files={cfg.data.val_files!r}); the habit exists only there")
    cache_dir = cfg.trainer.cache_dir or os.path.join(output_dir, "embedded")
    artifacts = prepare_embedded_default(cache_dir, embedded_options(cfg), log=lambda *_: None)
    tokenizer = load_tokenizer(artifacts.model_dir)
    model = load_causal_lm(artifacts.model_dir).eval()
    problems = load_gsm8k(artifacts.val_file, cfg.data.val_split)
    args = (tokenizer, problems, cfg.data.max_prompt_length, cfg.data.max_response_length, cfg.data.reward_method)

    rows = [("warm start (step 0)", greedy_counts(model, *args))]
    for path in list_checkpoints(output_dir):
        # accelerate saves the first prepared model, the actor, as model.safetensors; tied weights once.
        missing, unexpected = model.load_state_dict(load_file(os.path.join(path, "model.safetensors")), strict=False)
        if unexpected or set(missing) - {"lm_head.weight"}:
            raise ValueError(f"{path}/model.safetensors does not match the policy: missing {missing}, "
                             f"unexpected {unexpected}")
        rows.append((f"step {checkpoint_step(path)}", greedy_counts(model, *args)))
    return rows


def print_prediction(config: str, betas: list[float]) -> None:
    """`--predict`: the prediction table of docs/kl.md, "The habit a forward KL keeps", for `config`'s warm
    start (its embedded cache, built if missing) and held-out problems, under RLOO's advantages."""
    from rlhf.config import load_config
    from rlhf.models import load_causal_lm, load_tokenizer

    cfg = load_config(config)
    artifacts, problems = held_out_problems(cfg, log=print)
    pred = predict(load_causal_lm(artifacts.model_dir).eval(), load_tokenizer(artifacts.model_dir), problems, betas,
                   cfg.rollout.temperature)
    print(f"{pred['num_habit_prone']} of {pred['num_problems']} held-out problems can show the habit; at the "
          f"decision token the warm start gives it q = {pred['q_mean']:.3f} on average (median "
          f"{pred['q_median']:.3f}) and the right token {pred['right_median']:.3f} (median); habit rate if every "
          f"response reached the decision: {pred['reference_rate']:.3f}. Where training stops (RLOO, n = 4):\n")
    print("| beta | k3 in the loss | k3+, k2, full in the loss; k1 in the reward | forward-KL optimum (no clamp) |")
    print("|---|---|---|---|")
    for beta, limits in pred["betas"].items():
        print(f"| {beta} | {limits['k3']:.3f} | {limits['k3+']:.3f} | {limits['forward_optimum']:.3f} |")
    crossing = pred["crossing_beta"]
    print(f"\nThe forward-KL optimum lies past k3's clamp edge (d = -2.61087) below beta = {crossing['min']:.4f} to "
          f"{crossing['max']:.4f} (median {crossing['median']:.4f}) over the {pred['num_habit_prone']} decisions. "
          "The margin between the optimum and the edge, nats (min / median, and how many decisions lie past it):\n")
    print("| beta | " + " | ".join(str(beta) for beta in pred["betas"]) + " |")
    print("|---" * (len(pred["betas"]) + 1) + "|")
    print("| margin | " + " | ".join(f"{m['min']:.3f} / {m['median']:.3f} ({m['past']} past)"
                                    for m in (limits["margin"] for limits in pred["betas"].values())) + " |")


def main(argv: list[str] | None = None) -> None:
    """`python -m lab.habit OUTPUT_DIR`: print `report` as docs/results.md's markdown table;
    `python -m lab.habit --predict --config configs/tiny.yaml --beta 0.1 0.3`: `print_prediction`."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output_dir", nargs="?", help="trainer.output_dir of a run of the embedded default")
    parser.add_argument("--predict", action="store_true", help="where a KL stops the habit, from the warm start")
    parser.add_argument("--config", default="configs/tiny.yaml", help="--predict: the embedded default's config")
    parser.add_argument("--beta", type=float, nargs="+", default=[0.1, 0.15, 0.2, 0.3], help="--predict: coefficients")
    args = parser.parse_args(argv)
    import transformers

    transformers.logging.disable_progress_bar()  # "Loading weights" bars between the table's rows
    if args.predict:
        return print_prediction(args.config, args.beta)
    if args.output_dir is None:
        parser.error("give a run's output_dir, or --predict")
    output_dir = args.output_dir
    print("| greedy held-out answers | correct | reports the first step's result (habit) | other wrong answer |")
    print("|---|---|---|---|")
    for label, counts in report(output_dir):
        print(f"| {label} | " + " | ".join(str(counts[c]) for c in CATEGORIES) + " |")


if __name__ == "__main__":
    main()
