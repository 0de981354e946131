"""Sampling responses and the forward passes of one PPO step.

A rollout batch is a dict of tensors:
    prompt_ids, prompt_mask        (B, P)   left-padded prompts
    response_ids, response_mask    (B, R)   right-padded responses; the mask covers tokens up to and
                                            including the first EOS
    input_ids, attention_mask,     (B, P+R) the two concatenated, with position ids counted over real
    position_ids                            tokens only, exactly as `generate` counts them
The per-token tensors computed later (old_logprobs, ref_logprobs, values, advantages, ...) are (B, R):
entry t belongs to response token t, predicted from the state prompt + response[:t].
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig

from rlhf.core_algos import logprobs_from_logits


def left_pad(sequences: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (ids, mask), both (B, max_len), padded on the left for generation."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, seq in enumerate(sequences):
        if seq:
            ids[i, width - len(seq):] = torch.tensor(seq, dtype=torch.long)
            mask[i, width - len(seq):] = 1
    return ids, mask


def sampling_config(tokenizer, max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
                    top_p: float = 1.0, greedy: bool = False, ignore_eos: bool = False) -> GenerationConfig:
    """A complete GenerationConfig, so nothing leaks in from the checkpoint's generation_config.json
    (Qwen2.5-Instruct ships top_k=20, top_p=0.8, repetition_penalty=1.05: its samples would not be
    samples of pi, and every KL estimate would be biased). top_k=0 is passed as 0, not None: transformers
    turns None into its default of 50. `ignore_eos` samples all `max_new_tokens` (benchmarks): an empty
    EOS list, since None falls back to the model's own EOS."""
    common = dict(max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                  eos_token_id=[] if ignore_eos else tokenizer.eos_token_id, repetition_penalty=1.0)
    if greedy:
        return GenerationConfig(do_sample=False, **common)
    return GenerationConfig(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p, **common)


def response_mask_from_ids(response_ids: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """(B, R) long mask: 1 up to and including the first EOS, 0 after it."""
    is_eos = (response_ids == eos_token_id).long()
    eos_before = torch.cumsum(is_eos, dim=1) - is_eos  # EOS tokens strictly before position t
    return (eos_before == 0).long()


@torch.no_grad()
def generate(model, tokenizer, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
             gen_config: GenerationConfig) -> dict[str, torch.Tensor]:
    """Sample (or greedily decode) one response per prompt and build the rollout batch."""
    out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=gen_config)
    response_ids = out[:, prompt_ids.shape[1]:]
    pad = gen_config.max_new_tokens - response_ids.shape[1]
    if pad > 0:  # every sequence stopped early: pad to a fixed width
        response_ids = torch.nn.functional.pad(response_ids, (0, pad), value=tokenizer.pad_token_id)
    if gen_config.eos_token_id == []:  # ignore_eos: every sampled token is part of the response
        response_mask = torch.ones_like(response_ids)
    else:
        response_mask = response_mask_from_ids(response_ids, tokenizer.eos_token_id)
    response_ids = torch.where(response_mask.bool(), response_ids, tokenizer.pad_token_id)
    return build_batch(prompt_ids, prompt_mask, response_ids, response_mask)


def build_batch(prompt_ids, prompt_mask, response_ids, response_mask) -> dict[str, torch.Tensor]:
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "response_ids": response_ids,
        "response_mask": response_mask,
        "input_ids": torch.cat([prompt_ids, response_ids], dim=1),
        "attention_mask": attention_mask,
        # Left padding: count positions over real tokens only, as generate() does.
        "position_ids": (attention_mask.cumsum(dim=1) - 1).clamp(min=0),
    }


def response_logits(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """(B, R, V) logits predicting each response token (only the last R+1 positions are computed)."""
    num_response = batch["response_ids"].shape[1]
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                position_ids=batch["position_ids"], logits_to_keep=num_response + 1, use_cache=False)
    return out.logits[:, :-1]


def response_values(critic, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """(B, R) float32 values V(prompt + response[:t]) from a one-label token-classification critic."""
    num_response = batch["response_ids"].shape[1]
    out = critic(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                 position_ids=batch["position_ids"], use_cache=False)
    return out.logits[:, -num_response - 1:-1, 0].float()


def logprobs_and_logits(model, batch, temperature: float):
    """Log-probs (B, R) of the sampled tokens at the sampling temperature, in float32, and the logits
    (B, R, V) they came from (for the exact KL and the entropy)."""
    logits = response_logits(model, batch)
    return logprobs_from_logits(logits, batch["response_ids"], temperature), logits


def slice_batch(batch: dict[str, torch.Tensor], index) -> dict[str, torch.Tensor]:
    return {k: v[index] for k, v in batch.items()}
