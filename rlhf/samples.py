"""Samples: a few of a batch's responses as rows a person reads, logged at each evaluation (the greedy held-out
responses) and every trainer.log_samples_freq steps (the training batch's), to wandb as the tables
`samples/val` and `samples/train` and to `<output_dir>/samples.jsonl` (rlhf.tracking.MetricsLogger.log_samples).

    rows = sample_rows(tokenizer, batch, rows, stop_ids, limit=8)   # a scored batch (rlhf.rewards.score_batch)
"""

from __future__ import annotations

from rlhf.rollout import cut_responses


def sample_rows(tokenizer, batch, rows, stop_ids: int | tuple[int, ...], limit: int) -> list[dict]:
    """The first `limit` responses of a scored batch (its `scores`, `correct` and any `reward/<part>`,
    rlhf.rewards.score_batch) as {prompt, response, reward, reward/<part>..., correct, length, cut}: the prompt
    as the model saw it, the response decoded without special tokens, its score, whether it counts as right, its
    number of tokens, and whether it was cut at data.max_response_length (no stop token)."""
    num = min(limit, len(batch["scores"]))
    lengths = batch["response_mask"][:num].sum(dim=1).tolist()
    cut = cut_responses(batch, stop_ids)[:num].tolist()
    prompts = tokenizer.batch_decode(list(rows["input_ids"][:num]))
    responses = tokenizer.batch_decode([ids[:length] for ids, length in zip(batch["response_ids"][:num].tolist(), lengths)],
                                       skip_special_tokens=True)
    parts = [key for key in batch if key.startswith("reward/")]
    return [{"prompt": prompts[i], "response": responses[i], "reward": batch["scores"][i].item(),
             **{key: batch[key][i].item() for key in parts}, "correct": bool(batch["correct"][i]),
             "length": lengths[i], "cut": cut[i]} for i in range(num)]
