"""Samples: a few of a batch's responses as rows a person reads, logged at each evaluation (the greedy held-out
responses) and every trainer.log_samples_freq steps (the training batch's), to wandb as the tables
`samples/val` and `samples/train` and to `<output_dir>/samples.jsonl` (rlhf.tracking.MetricsLogger.log_samples).

    rows = sample_rows(tokenizer, seq, scored, stop_ids, limit=8)   # rlhf.rollout.Sequences, rlhf.rewards.Scored
"""

from __future__ import annotations

from rlhf.rollout import Sequences, cut_responses


def sample_rows(tokenizer, seq: Sequences, scored, stop_ids: int | tuple[int, ...], limit: int) -> list[dict]:
    """The first `limit` responses of a scored batch (`scored`, rlhf.rewards.score_batch of `seq`) as rows
    {prompt, response, reward, reward/<part>..., correct, length, cut}: the prompt as the model saw it, the response
    without special tokens, `cut` when it ended at data.max_response_length (no stop token)."""
    num = min(limit, len(scored.scores))
    lengths = seq.response_mask[:num].sum(dim=1).tolist()
    cut = cut_responses(seq, stop_ids)[:num].tolist()
    prompts = tokenizer.batch_decode([ids[mask.bool()].tolist() for ids, mask in zip(seq.prompt_ids[:num],
                                                                                      seq.prompt_mask[:num])])
    responses = tokenizer.batch_decode([ids[:length] for ids, length in zip(seq.response_ids[:num].tolist(), lengths)],
                                       skip_special_tokens=True)
    return [{"prompt": prompts[i], "response": responses[i], "reward": scored.scores[i].item(),
             **{key: values[i].item() for key, values in scored.parts.items()}, "correct": bool(scored.correct[i]),
             "length": lengths[i], "cut": cut[i]} for i in range(num)]
