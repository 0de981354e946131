"""Sampled evaluation on held-out problems: pass@k and maj@k from n responses per problem.

    pass_at_k(n, c, k)          # Chen et al. 2021's unbiased estimator of P(one of k samples is right)
    majority_vote(answers)      # maj@n: the first response giving the most frequent final answer
    sampled_scores(correct, answers, sizes)   # one problem's pass@k for each k, then maj@n

    evaluate(cfg, accelerator, run, step)   # the trainer's evaluation: greedy val/accuracy, then the above
    metrics, per_problem = evaluate_per_problem(cfg, accelerator, run)   # the same, and each problem's values

`evaluate` draws `trainer.val_samples` responses per problem at the sampling temperature and logs
`val/pass@k` for k = 1, 2, 4, ... up to n (`val/pass@1` is the sampled accuracy) and `val/maj@n`, next to
greedy `val/accuracy`. A task may add metrics of its own (`Setup.val_metrics`, e.g. the embedded default's
planted habit, lab/habit.py): each scores every response, and is logged as `val/<name>` over the sampled
responses and `val/greedy_<name>` over the greedy ones. Whether a
response is right and what its final answer is come from the run's reward (rlhf.rewards.RewardFn:
`is_correct`, `answers`). pass@k minus pass@1 is the headroom RL can turn into pass@1: answers the policy
already finds, but not reliably.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Hashable, Sequence

import torch
from tqdm.auto import tqdm

from rlhf.processes import eval_batches, stop_rule
from rlhf.rewards import score_batch
from rlhf.rollout import (SamplingParams, cut_responses, generate, left_pad, paired_noise_generator, repeat_prompts,
                          stop_token_ids)
from rlhf.samples import sample_rows

# A task's own metric of held-out responses: (decoded responses, each one's row index in the held-out split)
# -> one number per response, averaged over the responses.
ResponseMetric = Callable[[Sequence[str], Sequence[int]], Sequence[float]]


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """The unbiased pass@k of one problem from `num_samples` responses of which `num_correct` are right:
    1 - C(n - c, k) / C(n, k), the chance that k responses drawn without replacement from the n hold at least
    one right one (Chen et al. 2021, arXiv:2107.03374, eq. 1). Needs 1 <= k <= n."""
    if not 1 <= k <= num_samples:
        raise ValueError(f"pass@k needs 1 <= k <= num_samples, got k={k}, num_samples={num_samples}")
    if not 0 <= num_correct <= num_samples:
        raise ValueError(f"num_correct must be in [0, {num_samples}], got {num_correct}")
    if num_samples - num_correct < k:
        return 1.0
    return 1.0 - math.comb(num_samples - num_correct, k) / math.comb(num_samples, k)


def pass_at_k_sizes(num_samples: int) -> list[int]:
    """The k reported for n samples: the powers of two below n, and n itself (n = 8: 1, 2, 4, 8)."""
    return sorted({2**i for i in range(num_samples.bit_length()) if 2**i < num_samples} | {num_samples})


def majority_vote(answers: list[Hashable | None]) -> int | None:
    """The index of the first response that gives the most frequent final answer (answers compared with ==,
    so GSM8K's decimal values "5" and "5.00" vote together); responses without an answer (None) do not vote;
    a tie goes to the answer given first. None if nobody answered."""
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return None
    top = max(votes.values())
    return next(i for i, a in enumerate(answers) if a is not None and votes[a] == top)


def sampled_scores(correct: list[bool], answers: list[Hashable | None], sizes: list[int]) -> list[float]:
    """pass@k for each k in `sizes`, then maj@n, of one problem's n sampled responses, from whether each is
    right and its final answer: maj@n is 1 when a response giving the majority answer is right."""
    majority = majority_vote(answers)
    maj = 0.0 if majority is None else float(correct[majority])
    return [pass_at_k(len(correct), sum(correct), k) for k in sizes] + [maj]


@torch.no_grad()
def evaluate(cfg, accelerator, run, step: int = 0) -> dict[str, float]:
    """Greedy `val/accuracy` on the held-out split; with trainer.val_samples = n > 0 also n responses per
    problem sampled at the rollout's temperature, for `val/pass@k` (k = 1, 2, 4, ..., n) and `val/maj@n`, their
    noise seeded by (seed, step, process); and each of the task's `run.val_metrics` (greedy and sampled). Each
    process takes its share. A response is right when the run's reward scores it at least
    reward.correct_threshold (RewardFn.is_correct). `run` is an rlhf.setup.Setup (or anything with its
    tokenizer, val_set, reward, models and val_metrics). `val/greedy_clip_ratio` is the share of greedy
    responses cut at data.max_response_length."""
    return _evaluate(cfg, accelerator, run, step, keep_problems=False)[0]


@torch.no_grad()
def evaluate_and_sample(cfg, accelerator, run, step: int, num_samples: int) -> tuple[dict[str, float], list[dict]]:
    """`evaluate`'s metrics, and the first `num_samples` greedy responses of this process as rows
    (rlhf.samples.sample_rows)."""
    metrics, _, samples = _evaluate(cfg, accelerator, run, step, keep_problems=False, num_samples=num_samples)
    return metrics, samples


@torch.no_grad()
def evaluate_per_problem(cfg, accelerator, run, step: int = 0) -> tuple[dict[str, float], dict[str, list[float]]]:
    """`evaluate`'s metrics, and for each metric its value on every held-out problem, in the split's row order
    (gathered from every process): 1.0 or 0.0 for `val/accuracy`, a problem's pass@k, maj@n (0 or 1), the mean
    of a task metric over its responses. Each metric is the mean of its per-problem values; paired comparisons
    of two models on the same problems (python -m rlhf.evaluate) need the values themselves."""
    return _evaluate(cfg, accelerator, run, step, keep_problems=True)[:2]


def _evaluate(cfg, accelerator, run, step: int, keep_problems: bool, num_samples: int = 0):
    """(metrics, per-problem values or None, sample rows)."""
    tokenizer, val_set, reward_fn = run.tokenizer, run.val_set, run.reward
    model, n, r = accelerator.unwrap_model(run.models[0]), cfg.trainer.val_samples, cfg.rollout
    prefill = cfg.data.val_prefill_batch_size
    greedy = SamplingParams(cfg.data.max_response_length, greedy=True, prefill_batch_size=prefill)
    sampled = SamplingParams(cfg.data.max_response_length, r.temperature, r.top_k, r.top_p, prefill_batch_size=prefill)
    noise = (paired_noise_generator(cfg.trainer.seed, step, accelerator.process_index, accelerator.device, "val")
             if n else None)
    sizes = pass_at_k_sizes(n) if n else []
    task_metrics = dict(getattr(run, "val_metrics", None) or {})
    stop_ids = stop_token_ids(model, tokenizer)
    names = ["val/accuracy", "val/greedy_clip_ratio", *(f"val/greedy_{m}" for m in task_metrics)]
    if n:
        names += [*(f"val/pass@{k}" for k in sizes), f"val/maj@{n}", *(f"val/{m}" for m in task_metrics)]
    sums = torch.zeros(len(names), dtype=torch.float64)  # per name: the sum over problems
    num_problems = torch.zeros(1, dtype=torch.float64)
    problem_rows = []  # (held-out row index, [one value per name]) for this process's problems

    def decode(rows, params, generator=None):
        prompt_ids, prompt_mask = left_pad(rows["input_ids"], tokenizer.pad_token_id)
        with accelerator.autocast():
            return generate(model, tokenizer, prompt_ids.to(accelerator.device), prompt_mask.to(accelerator.device),
                            params, all_finished=stop_rule(accelerator), generator=generator)

    def task_values(seq, indices):
        """Each task metric's value of every response to this process's problems (a stand-in row has none)."""
        texts = tokenizer.batch_decode(seq.response_ids[:len(indices)], skip_special_tokens=True)
        return [list(fn(texts, indices)) for fn in task_metrics.values()]

    def problem_means(values, per_problem, num):
        """Per problem: the mean of each task metric over its `per_problem` consecutive responses."""
        return [[sum(v[i * per_problem:(i + 1) * per_problem]) / per_problem for v in values] for i in range(num)]

    samples = []
    batches = eval_batches(len(val_set), cfg.data.val_batch_size, accelerator.process_index,
                           accelerator.num_processes)
    for mine in tqdm(batches, desc="eval", leave=False, disable=not accelerator.is_local_main_process):
        rows = val_set[mine or [0]]  # a process without rows left decodes a stand-in (see eval_batches)
        seq = decode(rows, greedy)
        scored = score_batch(reward_fn, tokenizer, seq, rows)
        if num_samples and not samples and mine:  # this process's first batch
            samples = sample_rows(tokenizer, seq, scored, stop_ids, num_samples)
        correct, cut = scored.correct.tolist(), cut_responses(seq, stop_ids).tolist()
        values = task_values(seq, mine)
        row_sums = [sum(correct[:len(mine)]), sum(cut[:len(mine)]), *(sum(v) for v in values)]
        per_row = [[float(c), float(k), *means] for c, k, means in zip(correct, cut, problem_means(values, 1, len(mine)))]
        if n:
            repeated = repeat_prompts(rows, n)[0]
            seq = decode(repeated, sampled, noise)
            correct = score_batch(reward_fn, tokenizer, seq, repeated).correct.tolist()
            answers = reward_fn.answers(tokenizer.batch_decode(seq.response_ids, skip_special_tokens=True))
            per_problem = torch.zeros(len(sizes) + 1, dtype=torch.float64)
            values = task_values(seq, [i for i in mine for _ in range(n)])
            for i, means in enumerate(problem_means(values, n, len(mine))):
                group = slice(i * n, (i + 1) * n)
                scores = sampled_scores(correct[group], answers[group], sizes)
                per_problem += torch.tensor(scores, dtype=torch.float64)
                per_row[i] += [*scores, *means]
            row_sums += [*per_problem.tolist(), *(sum(v) / n for v in values)]
        sums += torch.tensor(row_sums, dtype=torch.float64)
        num_problems += len(mine)
        problem_rows += zip(mine, per_row)
    totals = accelerator.reduce(torch.cat([sums, num_problems]).to(accelerator.device), "sum").cpu()
    metrics = dict(zip(names, (totals[:-1] / totals[-1].clamp(min=1)).tolist()))
    if not keep_problems:
        return metrics, None, samples
    if accelerator.num_processes > 1:
        from accelerate.utils import gather_object

        problem_rows = gather_object(problem_rows)
    problem_rows = sorted(problem_rows)
    return metrics, {name: [row[j] for _, row in problem_rows] for j, name in enumerate(names)}, samples
