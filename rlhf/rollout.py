"""Sampling responses: `generate`, our KV-cache decoding loop, and the `Sequences` it returns.

The per-token tensors a step computes about the responses (log-probs, values, advantages, ...) are (B, R):
entry t belongs to response token t, predicted from the state prompt + response[:t] (rlhf/step.py).
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, fields

import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from rlhf import decode
from rlhf.lora import plain_model


def left_pad(sequences: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (ids, mask), both (B, max_len), padded on the left for generation."""
    width = max(len(s) for s in sequences)
    ids = torch.tensor([[pad_token_id] * (width - len(s)) + list(s) for s in sequences], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in sequences], dtype=torch.long)
    return ids, mask


def repeat_prompts(rows: dict[str, list], n: int) -> tuple[dict[str, list], torch.Tensor]:
    """Each prompt row n times in a row (its group of responses), and each copy's group id (B * n,): the index
    of its prompt in `rows`."""
    repeated = {key: [value for value in values for _ in range(n)] for key, values in rows.items()}
    return repeated, torch.arange(len(next(iter(rows.values())))).repeat_interleave(n)


@dataclass
class Sequences:
    """Prompts and their responses, as `generate` returns them (B rows):"""

    prompt_ids: torch.Tensor  # (B, P) left-padded prompts
    prompt_mask: torch.Tensor  # (B, P)
    response_ids: torch.Tensor  # (B, R) right-padded responses
    response_mask: torch.Tensor  # (B, R) 1 up to and including the first stop token
    input_ids: torch.Tensor  # (B, P+R) the two concatenated
    attention_mask: torch.Tensor  # (B, P+R)
    position_ids: torch.Tensor  # (B, P+R) counted over real tokens only, exactly as `generate` counts them
    logprobs: torch.Tensor | None = None  # (B, R) float32 log-probs of the sampled tokens, when kept; 0 after

    @classmethod
    def build(cls, prompt_ids, prompt_mask, response_ids, response_mask, logprobs=None) -> Sequences:
        """The record from left-padded prompts and right-padded responses."""
        attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
        return cls(prompt_ids, prompt_mask, response_ids, response_mask, torch.cat([prompt_ids, response_ids], dim=1),
                   attention_mask, decode.position_ids_from_mask(attention_mask), logprobs)

    def select(self, index) -> Sequences:
        """The rows `index` of every tensor (a micro-batch)."""
        return Sequences(*(None if (v := getattr(self, f.name)) is None else v[index] for f in fields(self)))


@dataclass(frozen=True)
class SamplingParams:
    """How `generate` picks each token, and what it keeps. Nothing else applies: the checkpoint's
    generation_config.json is never read (Qwen2.5-Instruct's ships top_k=20, top_p=0.8, repetition_penalty=1.05,
    under which samples would not be samples of pi and every KL estimate would be biased)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    greedy: bool = False  # argmax instead of sampling (evaluation)
    ignore_eos: bool = False  # sample all max_new_tokens even after EOS (benchmarks)
    keep_logprobs: bool = False  # keep Sequences.logprobs, of softmax(logits / temperature) before top-k/top-p
    prefill_batch_size: int | None = None  # prompts per forward of the prompt pass (rlhf.decode.prefill; None: all)


def paired_noise_generator(seed: int, step: int, process_index: int, device, stream: str = "rollout") -> torch.Generator:
    """The sampling noise of one step (`rollout.paired_noise`), seeded by (seed, step, process index): two runs
    with the same seed draw the same noise (common random numbers), so their samples differ only where their
    policies do. `stream` names a separate sequence ("val": the sampled evaluation's), so no use shifts another."""
    digest = hashlib.sha256(f"{stream}/{seed}/{step}/{process_index}".encode()).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """(B, V) logits -> (B,) tokens: the argmax, or an exact sample of softmax(logits / temperature) after
    the optional top-k/top-p filters (transformers' own warpers). The noise comes from `generator`, or from
    the global random state when it is None."""
    logits = logits.float()
    if params.greedy:
        return logits.argmax(dim=-1)
    logits = logits / params.temperature
    if params.top_k > 0:
        logits = TopKLogitsWarper(params.top_k)(None, logits)
    if params.top_p < 1.0:
        logits = TopPLogitsWarper(params.top_p)(None, logits)
    # Gumbel-max: argmax(logits + G), G = -log(-log U) i.i.d., is distributed as softmax(logits). On CPU it
    # is ~3x cheaper than torch.multinomial, which draws exponentials (0.17 vs 0.52 ms for 32 x 400).
    uniform = torch.rand(logits.shape, generator=generator, device=logits.device, dtype=logits.dtype)
    gumbel = -torch.log(-torch.log(uniform))
    return (logits + gumbel).argmax(dim=-1)


def stop_token_ids(model, tokenizer) -> tuple[int, ...]:
    """The ids that end a response: the tokenizer's EOS and every id of the model's generation config
    `eos_token_id`, an int or a list (Qwen2.5-Instruct lists `<|im_end|>` 151645 and `<|endoftext|>` 151643,
    and its tokenizer's EOS is only the first). Only these ids are read from the generation config."""
    listed = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = [tokenizer.eos_token_id, *(listed if isinstance(listed, (list, tuple)) else [listed])]
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def is_stop_token(ids: torch.Tensor, stop_ids: int | tuple[int, ...]) -> torch.Tensor:
    """Bool tensor like `ids`: which entries are one of the stop ids (an int or a tuple of them)."""
    stop_ids = (stop_ids,) if isinstance(stop_ids, int) else stop_ids
    return torch.isin(ids, torch.tensor(stop_ids, dtype=ids.dtype, device=ids.device))


def cut_responses(seq: Sequences, stop_ids: int | tuple[int, ...]) -> torch.Tensor:
    """(B,) bool: which responses were cut at the length limit: all their R tokens, the last not a stop token."""
    mask = seq.response_mask
    return (mask.sum(dim=1) == mask.shape[1]) & ~is_stop_token(seq.response_ids[:, -1], stop_ids)


def response_mask_from_ids(response_ids: torch.Tensor, eos_token_ids: int | tuple[int, ...]) -> torch.Tensor:
    """(B, R) long mask: 1 up to and including the first stop token (any of `eos_token_ids`), 0 after it."""
    is_eos = is_stop_token(response_ids, eos_token_ids).long()
    eos_before = torch.cumsum(is_eos, dim=1) - is_eos  # EOS tokens strictly before position t
    return (eos_before == 0).long()


def generate(model, tokenizer, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams,
             all_finished=None, generator: torch.Generator | None = None) -> Sequences:
    """Sample (or greedily decode) one response per left-padded prompt with rlhf.decode's loops (greedy: the tokens
    of `model.generate`, tests/test_rollout.py), the noise from `generator` (None: the global random state). A
    sequence ends at its first stop token (stop_token_ids); decoding stops when all have, or after max_new_tokens;
    `all_finished((B,) bool finished) -> bool` may widen "all" to other processes' sequences."""
    model = plain_model(model)  # a LoRA policy samples through its transformers model, adapters in place
    eos = None if params.ignore_eos else stop_token_ids(model, tokenizer)
    how = decode.Decoding(params.max_new_tokens, functools.partial(next_token, params=params, generator=generator),
                          params.temperature, eos, tokenizer.pad_token_id, generator, params.keep_logprobs,
                          params.prefill_batch_size)
    response_ids, logprobs = decode.sample_tokens(model, prompt_ids, prompt_mask, how, all_finished or torch.all)
    response_ids = response_ids.clone()  # out of inference_mode
    response_mask = torch.ones_like(response_ids) if eos is None else response_mask_from_ids(response_ids, eos)
    response_ids = torch.where(response_mask.bool(), response_ids, tokenizer.pad_token_id)
    kept = torch.where(response_mask.bool(), logprobs.clone(), 0.0) if params.keep_logprobs else None
    return Sequences.build(prompt_ids, prompt_mask, response_ids, response_mask, kept)
