"""The sampler's decoding loops: over a static KV cache, without a host synchronisation per token (`decode`), and
the reference loop, a forward pass of the model per token (`reference_decode`).

    tokens, logprobs = decode(model, prompt_ids, prompt_mask, Decoding(max_new_tokens, pick, temperature, stop_ids,
                                                                       pad_token_id, generator, keep_logprobs))

`sample_tokens`, which rlhf.rollout.generate calls, runs `decode` for the models `supports` accepts (Qwen2 and
Llama causal LMs, the embedded default's and the recipes' kind, unsharded, with transformers' SDPA attention), and
`reference_decode` for everything else (FSDP2-sharded models, other architectures). The two give the same tokens
and the same log-probs under the same noise (tests/test_decode.py); what differs is how a token's forward pass is
run:

- the prompts' forward pass is the model's own (so the first token is computed exactly as before); its keys and
  values are copied once into a static cache of (B, KV heads, prompt + max_new_tokens, head dim) per layer, in
  the dtypes the model's own cache gave them (under bf16 autocast, float32 keys: the rotary embedding's float32
  cos/sin promote them; bf16 values on transformers 5.25, float32 on 5.17). With `prefill_batch_size` it runs
  on that many prompts at a time, each sub-batch's keys and values copied in before the next starts: the pass
  then holds the static cache and one sub-batch's activations, not the whole batch's (the evaluation's
  data.val_prefill_batch_size); the rows keep the batch's width, so their positions and masks are unchanged;
- each later token runs the decoder layers' own modules (norms, projections, MLP, the rotary embedding) in the
  order transformers' forward runs them, without its per-token set-up (the 4D mask, the cache object, the output
  record): the new key and value are written into the cache in place, and attention reads the cache as it is,
  the grouped query heads folded into the query length ((B, heads, 1, D) -> (B, KV heads, heads / KV heads, D):
  no copy of the cache per KV head; transformers 5.25's own `pack_gqa`, the same kernel);
- whether every sequence has stopped is read on the host every `STOP_CHECK_EVERY` tokens, not after each one
  (on a GPU each read waits for the queued work). The tokens drawn past the stop are pads, as in the reference,
  and the noise they drew is given back: the random state is rewound to where the reference loop leaves it, so
  the next use of the generator (or of the global random state) draws what it would have drawn.

`cache_kept(model)`, around both loops in `sample_tokens`, keeps layers that checkpoint their activations
from dropping the cache while decoding (transformers before 5.2x drops it in such layers even without gradients).

`step_type=CompiledTokenStep` runs the one-token step through `torch.compile` over full-length (static-shape)
attention with a mask; on CUDA in "reduce-overhead" mode, which replays it as a CUDA graph. Its tokens agree with the
eager step's up to float rounding, not bit for bit (the attention reads the whole cache). The trainer uses the eager
step; bench/gpu_check.py measures both on a GPU, and bench/decode_speed.py on the CPU.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed.fsdp import FSDPModule

from rlhf.core_algos import logprobs_from_logits

ARCHITECTURES = ("Qwen2ForCausalLM", "LlamaForCausalLM")  # the decoder-layer structure `TokenStep` runs
STOP_CHECK_EVERY = 8  # tokens between two host reads of "has every sequence stopped?"


def unsupported(model) -> str | None:
    """Why `decode` cannot run `model`, None when it can. Sharded weights are gathered by each layer's forward, which
    TokenStep bypasses; another attention implementation than SDPA would not give the reference's numbers."""
    if type(model).__name__ not in ARCHITECTURES:
        return f"{type(model).__name__} is not one of {', '.join(ARCHITECTURES)}"
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        return "its weights are sharded (FSDP2)"
    attention = getattr(model.config, "_attn_implementation", None)
    if attention != "sdpa":
        return f"its attention implementation is {attention!r}, not 'sdpa'"
    if any(getattr(layer.self_attn, "sliding_window", None) for layer in model.model.layers):
        return "it has sliding-window attention layers"
    return None


def supports(model) -> bool:
    return unsupported(model) is None


def sample_tokens(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, how: Decoding,
                  all_finished=torch.all):
    """`decode`'s result where it `supports` the model and the stop rule is this process's own; else, for a stop
    rule of several processes (FSDP2) or another architecture, `reference_decode`'s. Both run with the KV cache
    kept (`cache_kept`) and, for small CPU work, on one thread (`few_threads`)."""
    # inference_mode saves 4-9% of sampling time over no_grad (the caller clones the tokens out of it); not under
    # FSDP2 (its in-place updates refuse the gathered inference tensors), nor autocast (recasts weights per token).
    lighter = not isinstance(model, FSDPModule) and not torch.is_autocast_enabled(prompt_ids.device.type)
    with torch.inference_mode() if lighter else torch.no_grad(), cache_kept(model), few_threads(model, len(prompt_ids)):
        if all_finished is torch.all and supports(model):
            return decode(model, prompt_ids, prompt_mask, how)
        return reference_decode(model, prompt_ids, prompt_mask, how, all_finished)


@contextlib.contextmanager
def cache_kept(model):
    """Inside the block, the layers that checkpoint their activations (rlhf.setup sets their training flag) do not,
    so that they keep the KV cache (see the module); decoding has no backward to recompute for."""
    layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True and m.training]
    for layer in layers:
        layer.training = False
    try:
        yield
    finally:
        for layer in layers:
            layer.training = True


# batch x parameters below which decoding runs on one thread (measured on 2 cores: docs/gpu.md, "Decoding")
ONE_THREAD_BELOW = 10**8


@contextlib.contextmanager
def few_threads(model, batch_size: int):
    """Inside the block, torch uses one thread for small CPU work (batch x parameters < ONE_THREAD_BELOW) when idle
    OpenMP threads sleep (OMP_WAIT_POLICY=PASSIVE): waking one for each shared op, a system call, costs more than a
    small op, and a token is ~150 ops. Spinning threads (the default policy) are left alone."""
    threads = torch.get_num_threads()
    one = (threads > 1 and os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE"
           and next(model.parameters()).device.type == "cpu"
           and batch_size * sum(p.numel() for p in model.parameters()) < ONE_THREAD_BELOW)
    if one:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if one:
            torch.set_num_threads(threads)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) positions counted over real tokens only, so left padding does not shift them: what
    transformers' `generate` uses, and what a sequence without padding would get. Padding gets 0."""
    return (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)


def kv_cache_name(model) -> str:
    """The name of the KV cache in `model`'s forward arguments and outputs: transformers 5.24 renamed
    `past_key_values` to `cache` (the old name goes in 5.40)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def prompt_pass(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, position_ids: torch.Tensor):
    """The prompts' forward pass, the model's own, keeping its KV cache: (the output, the cache); both loops start
    with it."""
    out = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=position_ids, use_cache=True,
                logits_to_keep=1)
    cache = getattr(out, kv_cache_name(model), None)
    if cache is None or cache.get_seq_length() == 0:
        raise RuntimeError(f"{type(model).__name__} returned no KV cache; generation needs use_cache=True "
                           "(gradient checkpointing in train mode turns it off)")
    return out, cache


def prefill(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, position_ids: torch.Tensor, length: int,
            prefill_batch_size: int | None = None) -> tuple[torch.Tensor, StaticCache]:
    """The prompts' forward pass into a StaticCache of `length` slots: ((B, V) last-position logits, the cache),
    run on `prefill_batch_size` prompts at a time (None: all at once), each sub-batch's cache copied in and freed
    before the next sub-batch runs."""
    batch_size = len(prompt_ids)
    size = prefill_batch_size or batch_size
    cache, logits = None, []
    for start in range(0, batch_size, size):
        rows = slice(start, start + size)
        out, prompt_cache = prompt_pass(model, prompt_ids[rows], prompt_mask[rows], position_ids[rows])
        if cache is None:
            cache = StaticCache(prompt_cache, length, batch_size)
        cache.fill(rows, prompt_cache)
        logits.append(out.logits[:, -1])
        del out, prompt_cache
    return logits[0] if len(logits) == 1 else torch.cat(logits), cache


@dataclass(frozen=True)
class Decoding:
    """How either loop decodes (rlhf.rollout.generate builds it from its SamplingParams)."""

    max_new_tokens: int
    pick: Callable[[torch.Tensor], torch.Tensor]  # (B, V) logits -> (B,) tokens (rlhf.rollout.next_token)
    temperature: float  # of the kept log-probs, softmax(logits / temperature)
    stop_ids: tuple[int, ...] | None  # a sequence ends at its first; None: every token sampled
    pad_token_id: int
    generator: torch.Generator | None = None  # where `pick` draws its noise (None: the device's global state)
    keep_logprobs: bool = False  # return the sampled tokens' log-probs
    prefill_batch_size: int | None = None  # prompts per forward of the prompt pass (`prefill`; None: all at once)


def decode(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, how: Decoding,
           step_type: type[TokenStep] | None = None):
    """(B, how.max_new_tokens) tokens, pad after a sequence's stop token and for every sequence once all have
    stopped; with `how.keep_logprobs` their float32 log-probs (0 after the stop of all), else None. `step_type`
    runs each later token: TokenStep (None), or CompiledTokenStep (the benchmarks')."""
    batch_size, prompt_width = prompt_ids.shape
    device = prompt_ids.device
    position_ids = position_ids_from_mask(prompt_mask)
    logits, cache = prefill(model, prompt_ids, prompt_mask, position_ids, prompt_width + how.max_new_tokens,
                            how.prefill_batch_size)
    # Row i attends to its real prompt tokens and everything sampled.
    attend = torch.cat([prompt_mask.bool(), prompt_mask.new_ones(batch_size, how.max_new_tokens, dtype=torch.bool)],
                       dim=1)
    one_token = (step_type or TokenStep)(model, cache, attend[:, None, None, :])  # (B, 1, 1, P + R)
    last_position = position_ids[:, -1]

    tokens = torch.full((batch_size, how.max_new_tokens), how.pad_token_id, dtype=torch.long, device=device)
    logprobs = torch.zeros(batch_size, how.max_new_tokens, device=device) if how.keep_logprobs else None
    finished = torch.zeros(batch_size, dtype=torch.bool, device=device)
    stop = None if how.stop_ids is None else torch.tensor(how.stop_ids, dtype=torch.long, device=device)
    all_stopped_at = torch.full((), -1, dtype=torch.long, device=device)  # the first t after which all had stopped
    generator = how.generator
    if generator is None:  # the global random state `how.pick` draws from
        generator = (torch.default_generator if device.type == "cpu"
                     else torch.cuda.default_generators[device.index if device.index is not None
                                                        else torch.cuda.current_device()])
    window_start, saved = 0, generator.get_state()
    for t in range(how.max_new_tokens):
        token = how.pick(logits)
        if how.keep_logprobs:  # of the unfiltered softmax(logits / T): what the trainer's forward pass computes
            logprobs[:, t] = logprobs_from_logits(logits[:, None], token[:, None], how.temperature)[:, 0]
        if stop is not None:
            token = token.masked_fill(finished, how.pad_token_id)  # nothing after a sequence's stop token
            finished |= torch.isin(token, stop)
            all_stopped_at = torch.where((all_stopped_at < 0) & finished.all(), t, all_stopped_at)
        tokens[:, t] = token
        last = t + 1 == how.max_new_tokens
        if stop is not None and (last or (t + 1) % STOP_CHECK_EVERY == 0):
            stopped_at = int(all_stopped_at)  # the host read: every STOP_CHECK_EVERY tokens, and after the last
            if stopped_at >= 0:
                # The reference loop draws nothing after the stop: rewind the noise to the window's start, and
                # draw again (on logits of the same shape) only what it drew up to the stop.
                generator.set_state(saved)
                for _ in range(stopped_at - window_start + 1):
                    how.pick(torch.zeros_like(logits))
                if how.keep_logprobs:
                    logprobs[:, stopped_at + 1:] = 0
                break
            window_start, saved = t + 1, generator.get_state()
        if not last:
            logits = one_token(token, last_position + t + 1, prompt_width + t)
    return tokens, logprobs


class StaticCache:
    """Each layer's keys and values, (B, KV heads, length, head dim), in the dtypes of `prompt_cache` (the model's
    own cache of the prompts, or of their first sub-batch), zero until `fill` copies the prompts' in."""

    def __init__(self, prompt_cache, length: int, batch_size: int):
        self.keys, self.values = [], []
        for keys, values in ((layer.keys, layer.values) for layer in prompt_cache.layers):
            _, num_kv_heads, _, head_dim = keys.shape
            self.keys.append(keys.new_zeros(batch_size, num_kv_heads, length, head_dim))
            self.values.append(values.new_zeros(batch_size, num_kv_heads, length, head_dim))
        self.length = length

    def fill(self, rows: slice, prompt_cache) -> None:
        """The prompts' keys and values of `rows` (the model's cache of those rows) into their first slots."""
        for layer, keys, values in zip(prompt_cache.layers, self.keys, self.values):
            prompt_width = layer.keys.shape[2]
            keys[rows, :, :prompt_width] = layer.keys
            values[rows, :, :prompt_width] = layer.values


class TokenStep:
    """One token's forward pass over the static cache: (B,) tokens, (B,) positions, the cache slot -> (B, V)
    logits. The layers' own modules, in transformers' order (Qwen2DecoderLayer.forward, Qwen2Attention.forward,
    sdpa_attention_forward). `attend` (B, 1, 1, P + R): which cache slots each row attends to."""

    def __init__(self, model, cache: StaticCache, attend: torch.Tensor):
        self.model, self.cache = model, cache
        self.attend = None if bool(attend.all()) else attend  # no row padded: SDPA without a mask, as transformers
        attention = model.model.layers[0].self_attn
        self.head_dim, self.groups = attention.head_dim, attention.num_key_value_groups
        self.rotate = sys.modules[type(attention).__module__].apply_rotary_pos_emb

    def __call__(self, token: torch.Tensor, position: torch.Tensor, slot: int) -> torch.Tensor:
        return self.forward(token, position, slot, slot + 1, self.attend)

    @staticmethod
    def write(cache: torch.Tensor, slot, new: torch.Tensor) -> None:
        """The new (B, KV heads, 1, D) key or value into its slot of the cache."""
        cache[:, :, slot] = new[:, :, 0]

    def forward(self, token, position, slot, length: int, attend):
        model, cache = self.model.model, self.cache
        batch_size = token.shape[0]
        hidden = model.embed_tokens(token[:, None])  # (B, 1, H)
        cos, sin = model.rotary_emb(hidden, position[:, None])
        for layer, keys, values in zip(model.layers, cache.keys, cache.values):
            attention = layer.self_attn
            residual = hidden
            hidden = layer.input_layernorm(hidden)
            shape = (batch_size, 1, -1, self.head_dim)
            query = attention.q_proj(hidden).view(shape).transpose(1, 2)  # (B, heads, 1, D)
            key = attention.k_proj(hidden).view(shape).transpose(1, 2)  # (B, KV heads, 1, D)
            value = attention.v_proj(hidden).view(shape).transpose(1, 2)
            query, key = self.rotate(query, key, cos, sin)
            self.write(keys, slot, key)
            self.write(values, slot, value)
            # The grouped heads as the query length: (B, KV heads, groups, D) against the cache as it is.
            query = query.reshape(batch_size, -1, self.groups, self.head_dim)
            out = torch.nn.functional.scaled_dot_product_attention(
                query, keys[:, :, :length], values[:, :, :length],
                attn_mask=None if attend is None else attend[..., :length], scale=attention.scaling)
            out = out.reshape(batch_size, -1, 1, self.head_dim).transpose(1, 2).contiguous()
            hidden = residual + attention.o_proj(out.reshape(batch_size, 1, -1).contiguous())
            residual = hidden
            hidden = residual + layer.mlp(layer.post_attention_layernorm(hidden))
        return self.model.lm_head(model.norm(hidden))[:, -1]


# ----------------------------------------------------------------------------- off the trainer's path


class CompiledTokenStep(TokenStep):
    """TokenStep through `torch.compile` over full-length (static-shape) attention with a mask; on CUDA in
    "reduce-overhead" mode, which replays it as a CUDA graph. For the benchmarks (bench/gpu_check.py,
    bench/decode_speed.py): the trainer decodes with TokenStep."""

    def __init__(self, model, cache: StaticCache, attend: torch.Tensor):
        super().__init__(model, cache, attend)
        self.attend = attend  # always: the attention reads the whole cache, the unwritten slots masked
        # The cache is written in place at every step: static addresses, so that a CUDA graph may own them
        # (gpt-fast's KV cache is a module buffer for the same reason).
        for tensor in (*cache.keys, *cache.values):
            torch._dynamo.mark_static_address(tensor)
        mode = "reduce-overhead" if cache.keys[0].device.type == "cuda" else None
        self.compiled = torch.compile(self.forward, mode=mode, dynamic=False)
        self.slots = torch.arange(cache.length, device=cache.keys[0].device)

    def __call__(self, token: torch.Tensor, position: torch.Tensor, slot: int) -> torch.Tensor:
        slot = torch.full((1,), slot, device=token.device)  # static shapes: the slot as a tensor
        return self.compiled(token, position, slot, self.cache.length, self.attend & (self.slots <= slot))

    @staticmethod
    def write(cache: torch.Tensor, slot, new: torch.Tensor) -> None:
        # index_copy_ does not convert: under autocast on 5.17 the cache's values are float32
        cache.index_copy_(2, slot, new.to(cache.dtype))


def reference_decode(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, how: Decoding,
                     all_finished=torch.all):
    """`decode`'s tokens and log-probs by a forward pass of the model per token over its own KV cache, the stop
    read after every token: what rlhf.rollout.generate runs for the models `supports` refuses, and the
    reference tests/test_decode.py holds `decode` to. `all_finished((B,) bool finished) -> bool` may widen
    "every sequence has stopped" to other processes' too (rlhf.processes.stop_rule). The prompt pass is whole
    (`how.prefill_batch_size` is not read) and `pick` draws from `how.generator` itself."""
    batch_size, prompt_width = prompt_ids.shape
    # Room for every response token up front; row i attends to its real prompt tokens and everything sampled.
    attention_mask = torch.cat([prompt_mask, prompt_mask.new_ones(batch_size, how.max_new_tokens)], dim=1)
    position_ids = position_ids_from_mask(prompt_mask)
    cache_name = kv_cache_name(model)
    out, _ = prompt_pass(model, prompt_ids, prompt_mask, position_ids)
    finished = torch.zeros(batch_size, dtype=torch.bool, device=prompt_ids.device)
    stop = None if how.stop_ids is None else torch.tensor(how.stop_ids, dtype=torch.long, device=prompt_ids.device)
    tokens, logprobs = [], []
    for t in range(how.max_new_tokens):
        token = how.pick(out.logits[:, -1])
        if how.keep_logprobs:  # of the unfiltered softmax(logits / T): what the trainer's forward pass computes
            logprobs.append(logprobs_from_logits(out.logits[:, -1:], token[:, None], how.temperature)[:, 0])
        if stop is not None:
            token = token.masked_fill(finished, how.pad_token_id)  # nothing after a sequence's stop token
            finished |= torch.isin(token, stop)
        tokens.append(token)
        if t + 1 == how.max_new_tokens or (stop is not None and all_finished(finished)):
            break
        out = model(input_ids=token[:, None], attention_mask=attention_mask[:, :prompt_width + t + 1],
                    position_ids=position_ids[:, -1:] + t + 1, use_cache=True,
                    **{cache_name: getattr(out, cache_name)})
    width = how.max_new_tokens - len(tokens)
    response_ids = torch.nn.functional.pad(torch.stack(tokens, dim=1), (0, width), value=how.pad_token_id)
    kept = torch.nn.functional.pad(torch.stack(logprobs, dim=1), (0, width)) if how.keep_logprobs else None
    return response_ids, kept
