"""The GPU recipes' memory per GPU, phase by phase, computed from the model's shape and the config's sizes, and
checked against peaks measured on a CPU at reduced shapes.

    python bench/recipe_memory.py                 # docs/gpu.md's table for the PPO recipe, per card and sharding
    python bench/recipe_memory.py --recipe grpo   # the same for the GRPO recipe (no critic, rollout.n = 5)
    python bench/recipe_memory.py --validate      # the model's error per phase against measured peaks (CPU, ~8 min)

A step has four moments that do not overlap, each one's tensors freed before the next; the peak of each is the
memory held throughout (weights, AdamW's moments, the reference: `static`) plus what that phase adds:
- sampling: the autocast copy of the actor's weights (bf16, cached for the whole decoding), and the largest of
  the prefill (the prompts' KV cache while the MLP of a layer runs on every prompt token: `prefill_activations`),
  the copy of the prompts' cache into the static cache (rlhf/decode.py: both at once), and the decoding (the
  static cache, the last position's logits and the sampler's float32 noise, a few (B, V) tensors);
- the rollout's log-prob pass, per micro-batch of rollout.log_prob_micro_batch_size: the actor's and the
  reference's logits alive together (for the exact KL), and the larger of two moments: the log-probs' (float32
  blocks of LOGITS_CHUNK_ROWS rows, read from the logits as they are) and the exact KL's (flat copies of both
  logits, its 256-row float32 chunks);
- the update, per micro-batch of actor.ppo_micro_batch_size: the gradients of the actor and the critic
  (allocated at the first backward, freed after each optimizer step), the autocast copy of the weights, and what
  autograd keeps between the forward and the backward: the logits (in the compute dtype; the log-probs and the
  entropy recompute their float32 blocks in the backward, core_algos), the layers' inputs (gradient
  checkpointing) or all their activations; and the larger of two moments: the forward's float32 blocks, and the
  backward's start, where the log-probs' (B, R, V) gradient and float32 blocks exist beside the logits;
- the optimizer step: fused AdamW's temporaries, one parameter tensor's size (small);
- the evaluation, at its largest batch (data.val_batch_size problems, times trainer.val_samples when it samples
  answers too) and the longest test prompt: the sampling's three moments, where the prefill runs on
  data.val_prefill_batch_size prompts at a time, each sub-batch's cache copied into the static cache, which
  exists from the first sub-batch's copy on (rlhf/decode.py).
With several processes: DDP adds its gradient buckets (a second copy of the gradients, 25 MB buckets packed
from them: counted as the whole gradients' size); FSDP2 divides the actor's and the critic's weights, gradients
and AdamW moments by the number of processes, gathers one decoder layer at a time (counted: one layer's weights)
and keeps the reference whole. Not counted: the CUDA context and the allocator's slack (~1-2 GB in practice),
attention's own buffers (SDPA's memory-efficient and flash kernels keep none the size of (T, T)).

--validate builds Qwen2 models of reduced shapes (the real recipe's proportions at a smaller width, vocabulary
and batch), runs two rlhf.step.train_step's of each case on the CPU in a fresh process (float32, no autocast: this
CPU multiplies bf16 matrices 30x slower than float32) and the trainer's evaluation after them, and compares each
phase's measured peak (the process's peak resident memory during the phase, less the process's own overhead,
found as its resident memory before the phase less the tensors it holds) with the model's. At Qwen2.5-0.5B's
width it counts what a decoder layer keeps for its backward (saved-tensor hooks) and what a token of the prompt
pass holds (the resident peak of a 2-layer model's prefill: float32, bf16 weights under autocast, with PEFT's
float32 adapters). It prints the error per phase, and of the part above `static`, and exits 1 where a number is
off by more than 15%.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from dataclasses import dataclass

from rlhf import core_algos, kl
from rlhf.step import computes_exact_kl
from rlhf.config import Config, load_config
from rlhf.core_algos import LOGITS_CHUNK_ROWS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

GIB = 2**30
RECIPE = os.path.join(REPO, "configs", "gsm8k_qwen2.5_0.5b.yaml")
GRPO_RECIPE = os.path.join(REPO, "configs", "gsm8k_qwen2.5_0.5b_grpo.yaml")
# Qwen/Qwen2.5-0.5B-Instruct's config.json, the fields that set its shape, under Qwen2Config's names (the
# rehearsal, the benchmarks and bench/gpu_check.py build their models from this one dict)
QWEN2_5_0_5B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                    num_key_value_heads=2, vocab_size=151_936, tie_word_embeddings=True)
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# The longest chat-templated GSM8K prompts, Qwen2.5-Instruct's tokenizer and template (lab.real_parts), the default
# instruction: of the 7,473 training problems (a training batch pads to its longest) and of the 1,319 test problems
# (an evaluation batch); measured on openai/grade-school-math's files (docs/gpu.md, "Memory per GPU")
GSM8K_PROMPT_TOKENS = 256
GSM8K_TEST_PROMPT_TOKENS = 232
DDP_BUCKET_BYTES = 25 * 2**20  # torch DDP's default bucket_cap_mb
# The table's columns: (label, card GB as sold, sharding, processes). 80 GB+ tries checkpointing off first.
CARDS = [("24 GB, 1 GPU", 24, "none", 1), ("24 GB, DDP", 24, "ddp", 2), ("24 GB, FSDP2 x2", 24, "fsdp", 2),
         ("40 GB, 1 GPU", 40, "none", 1), ("80 GB+, 1 GPU", 80, "none", 1)]
RESERVED_GIB = 2.0  # the CUDA context and the allocator's slack, not computed: an allowance (the GPU check measures it)
MARGIN_GIB = 0.5  # what a fitting setting leaves beyond the allowance, for what the model does not count
NUM_HELD_OUT = 1319  # GSM8K's test problems
# The LoRA recipes: adapters of rank 32 on every linear layer, the frozen base in bf16 (docs/gpu.md)
LORA_RECIPES = {"ppo-lora": os.path.join(REPO, "configs", "gsm8k_qwen2.5_0.5b_lora.yaml"),
                "grpo-lora": os.path.join(REPO, "configs", "gsm8k_qwen2.5_0.5b_grpo_lora.yaml")}
RECIPES = {"ppo": RECIPE, "grpo": GRPO_RECIPE, **LORA_RECIPES}
PHASES = ("sampling", "log-prob pass", "update", "optimizer step", "evaluation")
# The transformers versions whose KV caches differ (cache_keeps_value_dtype): the project's floor admits both
TRANSFORMERS = ("5.17", "5.2x")


# The linear layers of a Qwen2 decoder layer, with (inputs, outputs) as multiples of (width, KV width, MLP width)
LINEARS = {"q_proj": ("h", "h"), "k_proj": ("h", "kv"), "v_proj": ("h", "kv"), "o_proj": ("h", "h"),
           "gate_proj": ("h", "mlp"), "up_proj": ("h", "mlp"), "down_proj": ("mlp", "h")}


@dataclass(frozen=True)
class LoRA:
    """What the memory needs of `model.lora`: the adapters' rank, the adapted linear layers of each decoder layer,
    and whether the critic's backbone has adapters too (its value head is trained whole)."""

    rank: int
    target_modules: tuple[str, ...] = tuple(LINEARS)
    critic: bool = False


def lora_of(cfg: Config) -> LoRA | None:
    """cfg.model.lora as a LoRA (None with rank 0, or where the config has no LoRA section)."""
    section = getattr(cfg.model, "lora", None)
    if section is None or not section.rank:
        return None
    return LoRA(section.rank, tuple(section.target_modules), bool(section.critic))


def lora_parameters(lora: LoRA, shape: dict = QWEN2_5_0_5B) -> int:
    """The adapters' parameters on one model: rank x (inputs + outputs) for each adapted linear of each layer."""
    h = shape["hidden_size"]
    widths = {"h": h, "kv": shape["num_key_value_heads"] * (h // shape["num_attention_heads"]),
              "mlp": shape["intermediate_size"]}
    unknown = sorted(set(lora.target_modules) - set(LINEARS))
    if unknown:
        raise ValueError(f"unknown target module(s) {unknown}; a Qwen2 layer has {', '.join(LINEARS)}")
    per_layer = sum(lora.rank * (widths[LINEARS[m][0]] + widths[LINEARS[m][1]]) for m in lora.target_modules)
    return shape["num_hidden_layers"] * per_layer


def num_parameters(shape: dict = QWEN2_5_0_5B) -> int:
    """Parameters of a Qwen2 causal LM of this shape with tied embeddings (biases on q, k, v as in Qwen2);
    the critic's one-output score head is counted by the caller."""
    h = shape["hidden_size"]
    kv_dim = shape["num_key_value_heads"] * (h // shape["num_attention_heads"])
    attention = h * h + h + 2 * (h * kv_dim + kv_dim) + h * h  # q (+bias), k, v (+bias), o
    layer = attention + 3 * h * shape["intermediate_size"] + 2 * h  # gate, up, down; two RMSNorms
    embedding = shape["vocab_size"] * h * (1 if shape.get("tie_word_embeddings", True) else 2)
    return embedding + shape["num_hidden_layers"] * layer + h


@functools.cache
def cache_keeps_value_dtype() -> bool:
    """Whether the installed transformers' DynamicCache keeps the values in their own dtype when the keys are in
    another (float32 keys and bf16 values under autocast): 5.2x does; 5.17 starts both from an empty tensor of
    the keys' dtype, so torch.cat makes the values float32 too."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    cache.update(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2, dtype=torch.bfloat16), 0)
    values = cache.layers[0].values if hasattr(cache, "layers") else cache.value_cache[0]
    return values.dtype == torch.bfloat16


def memory(cfg: Config, shape: dict = QWEN2_5_0_5B, num_processes: int = 1, sharding: str = "none",
           mixed_precision: str | None = None, prompt_tokens: int | None = None,
           transformers: str | None = None, lora: LoRA | None = None,
           val_prompt_tokens: int | None = None) -> dict[str, float]:
    """GiB per process: each row (the module docstring), 'static', each phase of PHASES and 'peak'.
    `sharding`: none (one GPU), ddp or fsdp over `num_processes`; `mixed_precision` defaults to the config's
    trainer.mixed_precision; `prompt_tokens` to data.max_prompt_length (the longest prompt of a batch), and
    `val_prompt_tokens` (the evaluation's) to `prompt_tokens`;
    `transformers` ("5.17" or "5.2x", TRANSFORMERS) sets the KV cache's value dtype, by default the installed
    one's; `lora` the adapters (default: the config's model.lora, lora_of): the base frozen in model.dtype,
    adapters, their gradients and AdamW moments in float32, no reference copy (the reference is the policy with its
    adapters off)."""
    if sharding not in ("none", "ddp", "fsdp"):
        raise ValueError(f"unknown sharding {sharding!r}; choose from none, ddp, fsdp")
    h, v, layers, mlp = (shape[k] for k in ("hidden_size", "vocab_size", "num_hidden_layers", "intermediate_size"))
    kv_dim = shape["num_key_value_heads"] * (h // shape["num_attention_heads"])
    weight = BYTES[cfg.model.dtype]
    ref_weight = BYTES[cfg.model.ref_dtype or cfg.model.dtype]
    autocast = (mixed_precision or cfg.trainer.mixed_precision or "no") in ("bf16", "fp16")
    compute = 2 if autocast else weight  # activations and logits
    ref_compute = 2 if autocast else ref_weight
    # Keys leave the rotary embedding in its cos/sin's dtype, the embedding's (float32 under autocast over
    # float32 weights); values come from v_proj in the compute dtype, and stay so where the installed
    # transformers' cache keeps each one's dtype (5.2x; 5.17 makes the values the keys' dtype).
    key_bytes = 4 if weight == 4 else weight
    if transformers not in (None, *TRANSFORMERS):
        raise ValueError(f"unknown transformers {transformers!r}; choose from {', '.join(TRANSFORMERS)}")
    own_value_dtype = cache_keeps_value_dtype() if transformers is None else transformers == "5.2x"
    value_bytes = compute if own_value_dtype else key_bytes
    lora = lora or lora_of(cfg)
    actor = num_parameters(shape)
    critic = num_parameters(shape) + h + 1 if core_algos.needs_critic(cfg.algorithm.adv_estimator) else 0
    need_ref = (cfg.algorithm.use_kl_in_reward or cfg.actor.use_kl_loss or cfg.trainer.log_kl_panel) and lora is None
    # Trained parameters, in float32 where the base is frozen (adapters), in model.dtype where it is not
    adapters = lora_parameters(lora, shape) if lora else 0
    critic_adapters = adapters if lora and lora.critic and critic else 0
    actor_trained, actor_trained_bytes = (adapters, 4) if lora else (actor, weight)
    critic_trained, critic_trained_bytes = ((critic_adapters + h + 1, 4) if critic_adapters else (critic, weight))
    trained_bytes = actor_trained * actor_trained_bytes + critic_trained * critic_trained_bytes
    shards = num_processes if sharding == "fsdp" else 1
    prompt = prompt_tokens or cfg.data.max_prompt_length
    tokens = prompt + cfg.data.max_response_length
    rows = cfg.data.max_response_length + 1  # logits kept per response (rlhf.step.response_logits)
    batch = cfg.data.train_batch_size * cfg.rollout.n // num_processes  # this process's responses
    micro = min(cfg.actor.ppo_micro_batch_size, cfg.actor.ppo_mini_batch_size * cfg.rollout.n // num_processes)
    log_micro = min(cfg.rollout.log_prob_micro_batch_size, batch)
    layer_params = (actor - v * h - h) / layers

    val_batch = min(cfg.data.val_batch_size, -(-(cfg.data.max_val_samples or NUM_HELD_OUT) // num_processes))
    val_rows = val_batch * max(1, cfg.trainer.val_samples)  # the sampled evaluation decodes n answers a problem
    # under FSDP2 decoding takes the reference loop (rlhf.rollout.generate), whose prompt pass is whole
    val_prefill = val_rows if sharding == "fsdp" else min(cfg.data.val_prefill_batch_size or val_rows, val_rows)
    val_prompt = val_prompt_tokens or prompt
    val_tokens = val_prompt + cfg.data.max_response_length

    def kv_cache(num_sequences, num_tokens):
        return layers * num_sequences * num_tokens * kv_dim * (key_bytes + value_bytes)

    def float32_chunks(num_rows, count):  # `count` float32 chunks of at most LOGITS_CHUNK_ROWS rows
        return count * min(LOGITS_CHUNK_ROWS, num_rows) * v * 4

    def decoding_step(num_sequences):  # the last position's logits, the sampler's float32 copy, noise, two logs, sum
        return num_sequences * v * (compute + 4 * 4)

    full_kl_loss = cfg.actor.use_kl_loss and kl.needs_logits(cfg.actor.kl_loss_type)
    out = {
        "actor weights": actor * weight / shards,
        "actor adapters (float32)": adapters * 4 / shards,
        "actor AdamW moments": 2 * actor_trained * actor_trained_bytes / shards,
        "critic weights": critic * weight / shards,
        "critic adapters (float32)": critic_adapters * 4 / shards,
        "critic AdamW moments": 2 * critic_trained * critic_trained_bytes / shards,
        "reference": actor * ref_weight if need_ref else 0,
        "gradients (update)": trained_bytes / shards,
        "DDP gradient buckets (update)": trained_bytes if sharding == "ddp" else 0,
        # one decoder layer's weights gathered whole for its forward (and its gradient before the reduce-scatter)
        "FSDP2 gathered layer": 2 * layer_params * weight if sharding == "fsdp" else 0,
        "autocast copy of the weights (bf16)": (actor * 2 if autocast and weight == 4 else 0) + (adapters * 2 if autocast else 0),
        "KV cache (sampling)": kv_cache(batch, tokens),
        "prompts' KV cache (sampling)": kv_cache(batch, prompt),
        "prefill activations (sampling)": batch * prompt * prefill_activations(shape, prompt, compute, lora),
        "decoding step (sampling)": decoding_step(batch),
        # the actor's and the reference's logits alive together; a float32 block divided by the temperature and
        # logsumexp's two temporaries
        "logits, log-prob pass": log_micro * rows * v * (compute + ref_compute),
        "log-probs' float32 blocks, log-prob pass": float32_chunks(log_micro * (rows - 1), 3),
        # kl.full_kl (the panel's kl/full and kl/full_forward, or a `full` KL in the reward): flat copies of both
        # logits, and some 8 float32 temporaries of its 256-row chunks
        "exact KL's flat copies and chunks, log-prob pass": (
            log_micro * (rows - 1) * v * (compute + ref_compute) + 8 * min(256, log_micro * (rows - 1)) * v * 4
            if computes_exact_kl(cfg) else 0),
        "logits, update": micro * rows * v * compute,
        # the forward's moment: actor/entropy's block divided by the temperature, its log_softmax, exp and product
        "float32 blocks, update forward": float32_chunks(micro * (rows - 1), 4),
        # the backward's start: the log-probs' (B, R, V) gradient and a block's float32 softmax, product and
        # division (the model output's (B, R + 1, V) gradient it is then copied into comes after the logits are
        # freed: no larger)
        "logits' gradient and float32 blocks, update backward": (micro * (rows - 1) * v * compute
                                                                 + float32_chunks(micro * (rows - 1), 3)),
        # a `full` KL loss: the reference's logits, and the flat copies of both that kl.full_kl keeps for its backward
        "reference logits, `full` KL loss": (micro * rows * v * ref_compute
                                              + micro * (rows - 1) * v * (compute + ref_compute) if full_kl_loss else 0),
        # with checkpointing each layer's input (the residual stream, in the weights' dtype) and, while one layer
        # is recomputed, all of its activations
        "layer activations kept, update": micro * tokens * (
            h * weight * layers + layer_activations(shape, weight, compute, lora) if cfg.model.gradient_checkpointing
            else layers * layer_activations(shape, weight, compute, lora)),
        "KV cache (evaluation)": kv_cache(val_rows, val_tokens),
        "prompts' KV cache, a prefill sub-batch (evaluation)": kv_cache(val_prefill, val_prompt),
        "prefill activations, a sub-batch (evaluation)": (val_prefill * val_prompt
                                                          * prefill_activations(shape, val_prompt, compute, lora)),
        "decoding step (evaluation)": decoding_step(val_rows),
    }
    out = {key: value / GIB for key, value in out.items()}
    gathered = out["FSDP2 gathered layer"]
    out["static"] = sum(out[k] for k in ("actor weights", "actor adapters (float32)", "actor AdamW moments",
                                         "critic weights", "critic adapters (float32)", "critic AdamW moments",
                                         "reference"))
    held = out["static"] + out["autocast copy of the weights (bf16)"] + gathered
    out["sampling"] = held + max(out["prompts' KV cache (sampling)"] + out["prefill activations (sampling)"],
                                 out["prompts' KV cache (sampling)"] + out["KV cache (sampling)"],
                                 out["KV cache (sampling)"] + out["decoding step (sampling)"])
    out["log-prob pass"] = held + out["logits, log-prob pass"] + max(
        out["log-probs' float32 blocks, log-prob pass"], out["exact KL's flat copies and chunks, log-prob pass"])
    out["update"] = (held + out["gradients (update)"] + out["DDP gradient buckets (update)"] + out["logits, update"]
                     + out["reference logits, `full` KL loss"] + out["layer activations kept, update"]
                     + max(out["float32 blocks, update forward"],
                           out["logits' gradient and float32 blocks, update backward"]))
    out["optimizer step"] = out["static"] + out["gradients (update)"] + out["DDP gradient buckets (update)"]
    # a sub-batch's prefill runs beside the static cache unless it is the first (the cache is made after it)
    sub_batch = out["prompts' KV cache, a prefill sub-batch (evaluation)"]
    out["evaluation"] = held + max(
        sub_batch + out["prefill activations, a sub-batch (evaluation)"]
        + (out["KV cache (evaluation)"] if val_prefill < val_rows else 0),
        sub_batch + out["KV cache (evaluation)"], out["KV cache (evaluation)"] + out["decoding step (evaluation)"])
    out["peak"] = max(out[phase] for phase in PHASES)
    return out


def prefill_activations(shape: dict, prompt_tokens: int, compute: int, lora: LoRA | None = None) -> int:
    """Bytes a token of the prompt pass (no gradients) holds at its peak, in a layer's MLP: three MLP-wide
    tensors in the compute dtype (act(gate) and up while their product is made), four with PEFT's adapters (the
    base layer's output, the adapter's scaled output and their out-of-place sum beside act(gate) in up_proj; in
    down_proj the input, its float32 copy for the float32 adapter and autocast's bf16 copy of that come to as
    much); beside them the residual stream and the norm's output, the norm's float32 input and product, and the
    4D attention mask (one byte per prompt position). measured_prefill_activations counts them on the CPU."""
    h, mlp = shape["hidden_size"], shape["intermediate_size"]
    return (4 if lora else 3) * mlp * compute + 2 * h * compute + 2 * h * 4 + prompt_tokens


def layer_activations(shape: dict, weight: int, compute: int, lora: LoRA | None = None) -> int:
    """Bytes one decoder layer keeps for its backward, per token, with weights of `weight` bytes and activations of
    `compute` bytes (2 under bf16 autocast, over float32 or bf16 weights), as saved-tensor hooks count them
    (measured_layer_activations, tests/test_recipe_memory.py):
    - each RMSNorm: its input in float32 (Qwen2's norm computes in float32), its normalised input in the weights'
      dtype and its output; under autocast over float32 weights the output is not kept, but each linear layer it
      feeds keeps its own cast copy: q, k, v, gate and up;
    - attention: the rotated queries, the keys and values repeated to every query head (a padding mask makes SDPA
      take transformers' repeat_kv path, and a training batch has padding), the output, and SDPA's float32
      log-sum-exp per head;
    - the MLP: gate, up, their activation and product;
    - with LoRA (PEFT): each adapter's rank-sized output, and two more copies of the width in the compute dtype
      (what PEFT's forward adds, as the hooks count it)."""
    h, mlp, heads = shape["hidden_size"], shape["intermediate_size"], shape["num_attention_heads"]
    cast = compute != weight  # autocast over float32 weights: the linears keep cast copies of their inputs
    norms = 2 * (4 * h + h * weight + (0 if cast else h * weight) + 4)
    casts = 5 * h * compute if cast else 0
    attention = 4 * h * compute + heads * 4
    adapters = (len(lora.target_modules) * lora.rank + 2 * h) * compute if lora else 0
    return norms + casts + attention + 4 * mlp * compute + adapters


def measured_layer_activations(shape: dict, autocast: bool, num_tokens: int = 50, weight: str = "float32",
                               lora: LoRA | None = None) -> float:
    """Bytes a decoder layer keeps for its backward per token, counted with saved-tensor hooks on the CPU: Qwen2
    models of 3 and 1 layers of `shape` (weights in `weight`, bf16 autocast or none; `lora`: PEFT's adapters on
    them) on 2 left-padded sequences, the difference halved. Weights and autocast's cached bf16 copies of them are
    not counted (rows of their own)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    def saved_bytes(num_layers):
        torch.manual_seed(0)
        config = Qwen2Config(**{**shape, "num_hidden_layers": num_layers, "vocab_size": 512})
        config._attn_implementation = "sdpa"
        model = Qwen2ForCausalLM(config).to(getattr(torch, weight)).eval()
        if lora:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=lora.rank, lora_alpha=lora.rank,
                                                     target_modules=list(lora.target_modules))).eval()
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        weight_shapes = {tuple(p.shape) for p in model.parameters() if p.dim() == 2}
        if any(2 * num_tokens in dims for dims in weight_shapes):  # a (2 x tokens, width) view would pass for a weight
            raise ValueError(f"num_tokens={num_tokens}: 2 x num_tokens is a weight's dimension; choose another")
        ids = torch.randint(0, 512, (2, num_tokens))
        mask = torch.ones(2, num_tokens, dtype=torch.long)
        mask[0, :5] = 0  # left padding, as the trainer's batches have
        saved = {}

        def pack(tensor):
            storage = tensor.untyped_storage()
            is_weight_copy = tensor.dim() == 2 and (tuple(tensor.shape) in weight_shapes
                                                   or tuple(tensor.shape[::-1]) in weight_shapes)
            if storage.data_ptr() not in weights and not is_weight_copy:
                saved[storage.data_ptr()] = storage.nbytes()
            return tensor

        with (torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
              torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)):
            model(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=1)
        return sum(saved.values())

    return (saved_bytes(3) - saved_bytes(1)) / 2 / (2 * num_tokens)


PREFILL_SETTINGS = {"float32": ("float32", False, None), "bf16 weights": ("bfloat16", True, None),
                    "bf16 weights, LoRA rank 32": ("bfloat16", True, LoRA(32))}


def measured_prefill_activations(setting: str, num_prompts: int = 4, num_tokens: int = 128) -> float:
    """Bytes a token of the prompt pass holds at its peak beyond the KV cache, on the CPU in this (fresh) process:
    a 2-layer Qwen2 of Qwen2.5-0.5B's width (PREFILL_SETTINGS: its weights, bf16 autocast, PEFT's adapters) runs
    the prompts' forward as rlhf.decode does (no gradients, the cache kept, the last position's logits); the peak
    resident set (VmHWM) less the one before it, with freed memory returned to the system
    (MALLOC_MMAP_THRESHOLD_, set by validate). A first forward in the same autocast region leaves its cached
    bf16 copies of float32 weights (the adapters') out of the count."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    weight, autocast, lora = PREFILL_SETTINGS[setting]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = Qwen2Config(**{**QWEN2_5_0_5B, "num_hidden_layers": 2, "vocab_size": 512})
    config._attn_implementation = "sdpa"
    model = Qwen2ForCausalLM(config).to(getattr(torch, weight)).eval()
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=lora.rank, lora_alpha=lora.rank,
                                                 target_modules=list(lora.target_modules))).base_model.model
    ids = torch.randint(1, 512, (num_prompts, num_tokens))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding, as an evaluation batch has
    positions = (mask.cumsum(1) - 1).clamp(min=0)

    def prefill():
        return model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)

    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        prefill()
        before = _status_kb("VmRSS") * 1024
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        out = prefill()
        peak = _status_kb("VmHWM") * 1024
    cache = getattr(out, "cache", None) or out.past_key_values
    cache_bytes = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    return (peak - before - cache_bytes) / (num_prompts * num_tokens)


def table(columns: dict[str, dict[str, float]]) -> str:
    """Markdown: one row per kind of tensor and per phase, one column per setting; rows that are 0 in every
    column are left out."""
    keys = [key for key in next(iter(columns.values())) if any(col[key] for col in columns.values())]
    summary = [k for k in keys if k.startswith("peak on") or k in ("card less the allowance", "margin")]
    keys = [k for k in keys if k not in (*PHASES, "peak", *summary)] + [*PHASES, "peak", *summary]
    lines = ["| GiB per GPU | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for key in keys:
        name = f"**{key}**" if key in ("static", "peak", "margin") else (f"*{key}*" if key in PHASES else key)
        lines.append(f"| {name} | " + " | ".join(f"{col[key]:.2f}" for col in columns.values()) + " |")
    return "\n".join(lines)


def load_recipe(path: str, overrides=()) -> tuple[Config, LoRA | None]:
    """A recipe's config (`overrides` on top) and its LoRA: the file's model.lora section is read here, and the
    rest goes through load_config (so the memory of a LoRA recipe is computed with or without the trainer's LoRA
    installed)."""
    import yaml

    with open(path) as f:
        raw = yaml.safe_load(f)
    section = raw.get("model", {}).pop("lora", None) or {}
    # A LoRA recipe's model.dtype is its frozen base's: set after load_config, which without the LoRA section
    # would refuse it as a model trained whole in that dtype.
    base_dtype = raw["model"].pop("dtype", None) if section.get("rank") else None

    def dotted(tree, prefix=""):
        for key, value in tree.items():
            if isinstance(value, dict):
                yield from dotted(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}={json.dumps(value)}"

    cfg = load_config(None, [*dotted(raw), *overrides])
    if not section.get("rank"):
        return cfg, None
    cfg.model.dtype = base_dtype or cfg.model.dtype
    return cfg, LoRA(section["rank"], tuple(section.get("target_modules", LINEARS)), bool(section.get("critic", False)))


def usable_gib(card_gb: int) -> float:
    """What a card sold as `card_gb` GB holds, in GiB, less RESERVED_GIB."""
    return card_gb * 1e9 / GIB - RESERVED_GIB


def fitting_overrides(recipe: str, card_gb: int, sharding: str, processes: int,
                      prompt_tokens: int = GSM8K_PROMPT_TOKENS,
                      val_prompt_tokens: int = GSM8K_TEST_PROMPT_TOKENS) -> list[str] | None:
    """The largest micro-batch sizes (actor.ppo_micro_batch_size dividing a process's mini-batch share,
    rollout.log_prob_micro_batch_size a power of two), the fewest evaluation batches (data.val_batch_size) and
    the largest prefill sub-batch for them (data.val_prefill_batch_size, a power of two, or the whole batch)
    whose computed peak fits the card; gradient checkpointing off where the update then still fits with a
    micro-batch of 8 or more (80 GB and larger). None if nothing fits."""
    base, _ = load_recipe(RECIPES[recipe])
    share = base.actor.ppo_mini_batch_size * base.rollout.n // processes
    micros = [m for m in range(share, 0, -1) if share % m == 0]

    def fits(overrides, phase):  # on every transformers of TRANSFORMERS, with MARGIN_GIB to spare
        cfg, lora = load_recipe(RECIPES[recipe], overrides)
        return all(memory(cfg, num_processes=processes, sharding=sharding, prompt_tokens=prompt_tokens,
                          transformers=version, lora=lora, val_prompt_tokens=val_prompt_tokens)[phase]
                   <= usable_gib(card_gb) - MARGIN_GIB for version in TRANSFORMERS)

    def evaluation(chosen):  # the fewest batches, then the largest prefill sub-batch
        share_held_out = -(-NUM_HELD_OUT // processes)
        for val in dict.fromkeys(-(-share_held_out // k) for k in range(1, share_held_out + 1)):
            rows = val * max(1, base.trainer.val_samples)
            for prefill in [None, *(2**i for i in range(rows.bit_length() - 1, -1, -1) if 2**i < rows)]:
                sizes = [f"data.val_batch_size={val}", f"data.val_prefill_batch_size={prefill or 'null'}"]
                if fits([*chosen, *sizes], "evaluation"):
                    return sizes
        return None

    for checkpointing in ((False, True) if card_gb >= 80 else (True,)):
        flag = [f"model.gradient_checkpointing={str(checkpointing).lower()}"]
        micro = next((m for m in micros if fits([*flag, f"actor.ppo_micro_batch_size={m}"], "update")), None)
        if micro is None or (not checkpointing and micro < 8):
            continue
        chosen = [*flag, f"actor.ppo_micro_batch_size={micro}"]
        log_micro = next((m for m in (64, 32, 16, 8, 4, 2, 1)
                          if fits([*chosen, f"rollout.log_prob_micro_batch_size={m}"], "log-prob pass")), None)
        val = evaluation(chosen)
        if log_micro is None or val is None or not fits([*chosen, f"rollout.log_prob_micro_batch_size={log_micro}"],
                                                         "sampling"):
            return None
        return [*chosen, f"rollout.log_prob_micro_batch_size={log_micro}", *val]
    return None


def recipe_columns(recipe: str, prompt_tokens: int = GSM8K_PROMPT_TOKENS,
                   val_prompt_tokens: int = GSM8K_TEST_PROMPT_TOKENS) -> dict[str, dict[str, float]]:
    """One column per card of CARDS (no FSDP2 column for a LoRA recipe: the adapters leave little to shard): the
    recipe with the micro-batch sizes that fit it (fitting_overrides); a card nothing fits on gets a column of the
    recipe's own sizes, marked as not fitting."""
    columns = {}
    for label, card_gb, sharding, processes in CARDS:
        if recipe in LORA_RECIPES and sharding == "fsdp":
            continue
        overrides = fitting_overrides(recipe, card_gb, sharding, processes, prompt_tokens, val_prompt_tokens)
        cfg, lora = load_recipe(RECIPES[recipe], overrides or [])
        prefill = cfg.data.val_prefill_batch_size
        settings = (f"micro {cfg.actor.ppo_micro_batch_size}, log-prob micro {cfg.rollout.log_prob_micro_batch_size}, "
                    f"eval batch {cfg.data.val_batch_size}" + (f" (prefill {prefill} at a time)" if prefill else "")
                    + ("" if cfg.model.gradient_checkpointing else ", no checkpointing"))
        name = f"{label}: {settings}" if overrides else f"{label}: does not fit ({settings})"
        lengths = dict(prompt_tokens=prompt_tokens, val_prompt_tokens=val_prompt_tokens)
        column = memory(cfg, num_processes=processes, sharding=sharding, transformers="5.2x", lora=lora, **lengths)
        peaks = {version: memory(cfg, num_processes=processes, sharding=sharding, transformers=version, lora=lora,
                                 **lengths)["peak"] for version in TRANSFORMERS}
        column.update({f"peak on transformers {version}": peak for version, peak in peaks.items()})
        column["card less the allowance"] = usable_gib(card_gb)
        column["margin"] = usable_gib(card_gb) - max(peaks.values())
        columns[name] = column
    return columns


# ----------------------------------------------------------------------------- --validate


# Reduced shapes: Qwen2.5-0.5B's proportions (MLP ~5.4x the width, 7 query heads per KV head) at a smaller width,
# vocabulary and batch, so that a case runs in tens of seconds on a 2-core CPU in float32.
VALIDATION_SHAPE = dict(hidden_size=320, intermediate_size=1728, num_hidden_layers=4, num_attention_heads=5,
                        num_key_value_heads=1, vocab_size=24_576, tie_word_embeddings=True)
# The evaluation (32 problems a batch): its prompt pass in sub-batches of 8 (ppo), whole (the others), with 2
# sampled answers a problem (grpo: 64 rows), with PEFT's adapters (ppo-lora).
VALIDATION_CASES = {
    "ppo": ["data.max_prompt_length=64", "data.max_response_length=128", "data.train_batch_size=32",
            "actor.ppo_mini_batch_size=16", "actor.ppo_micro_batch_size=4", "rollout.log_prob_micro_batch_size=8",
            "data.val_prefill_batch_size=8"],
    "ppo, no checkpointing": ["data.max_prompt_length=64", "data.max_response_length=128", "data.train_batch_size=32",
                              "actor.ppo_mini_batch_size=16", "actor.ppo_micro_batch_size=4",
                              "rollout.log_prob_micro_batch_size=8", "model.gradient_checkpointing=false"],
    "grpo": ["data.max_prompt_length=64", "data.max_response_length=128", "data.train_batch_size=8",
             "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size=10", "rollout.log_prob_micro_batch_size=20",
             "trainer.val_samples=2"],
    # measured where peft is installed (the lora extra); float32 weights, as the other cases
    "ppo-lora": ["data.max_prompt_length=64", "data.max_response_length=128", "data.train_batch_size=32",
                 "actor.ppo_mini_batch_size=16", "actor.ppo_micro_batch_size=4", "rollout.log_prob_micro_batch_size=8",
                 "model.dtype=float32", "data.val_prefill_batch_size=null"],
}
MEASURED_PHASES = {"sampling": ("gen",), "log-prob pass": ("old_log_prob", "ref", "values"),
                   "update": ("update_actor", "update_critic"), "optimizer step": ("update_step",),
                   "evaluation": ("evaluation",)}


def validation_config(case: str, model_dir: str, out_dir: str) -> Config:
    recipe = LORA_RECIPES[case] if case in LORA_RECIPES else GRPO_RECIPE if case.startswith("grpo") else RECIPE
    return load_config(recipe, [*VALIDATION_CASES[case], f"model.path={model_dir}", "model.ref_dtype=float32",
                                "trainer.mixed_precision=no", "trainer.logger=none", f"trainer.output_dir={out_dir}",
                                "rollout.ignore_eos=true", "data.val_batch_size=32"])


def _status_kb(field: str) -> int:
    import re

    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1))


def measure_case(case: str) -> dict[str, float]:
    """In this (fresh) process: the peak tensor memory of each phase of the second of two steps of `case`, and of
    the trainer's evaluation after it, GiB: the peak resident set during the phase (VmHWM, reset through
    /proc/self/clear_refs as the phase starts) less the process's overhead (its resident set before the step less
    the tensors it holds then: parameters and AdamW moments)."""
    import tempfile

    import torch
    from accelerate import Accelerator
    from datasets import Dataset
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlhf.embedded import generate_problems, train_tokenizer
    from rlhf.held_out import evaluate
    from rlhf.models import load_tokenizer
    from rlhf.setup import build_setup, load_models
    from rlhf.tracking import Timer
    from rlhf.step import plan_step, train_step

    torch.set_num_threads(1)
    peaks: dict[str, int] = {}

    class PhaseMemory(Timer):
        def __call__(self, name):
            timer = super().__call__(name)

            class Phase:
                def __enter__(self):
                    with open("/proc/self/clear_refs", "w") as f:
                        f.write("5")  # VmHWM := VmRSS
                    return timer.__enter__()

                def __exit__(self, *exc):
                    peaks[name] = max(peaks.get(name, 0), _status_kb("VmHWM") * 1024)
                    return timer.__exit__(*exc)

            return Phase()

    with tempfile.TemporaryDirectory() as tmp:
        problems = generate_problems(64, seed=0)
        tokenizer = train_tokenizer([p["question"] + " " + p["answer"] for p in problems], vocab_size=500)
        config = Qwen2Config(**VALIDATION_SHAPE, max_position_embeddings=512, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
        torch.manual_seed(0)
        Qwen2ForCausalLM(config).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tokenizer = load_tokenizer(tmp)
        cfg = validation_config(case, tmp, os.path.join(tmp, "run"))
        prompt = cfg.data.max_prompt_length
        def prompts(num):
            return Dataset.from_dict({"input_ids": [[3 + (7 * i + j) % 400 for j in range(prompt)] for i in range(num)],
                                      "ground_truth": ["1"] * num})

        accelerator = Accelerator(mixed_precision="no")
        run = build_setup(cfg, accelerator, tokenizer, prompts(cfg.data.train_batch_size),
                          prompts(cfg.data.val_batch_size), *load_models(cfg, tmp))
        plan = plan_step(cfg, accelerator.mixed_precision)
        train_step(cfg, plan, accelerator, run, 1, Timer())  # the first: AdamW's moments, lazy set-up
        models = [m for m in run.models if hasattr(m, "parameters")]  # a LoRA run's reference holds no weights
        held = sum(p.numel() * p.element_size() for m in models for p in m.parameters())
        held += sum(t.numel() * t.element_size() for opt in run.optimizers if opt is not None
                    for state in opt.optimizer.state.values() for t in state.values() if torch.is_tensor(t))
        overhead = _status_kb("VmRSS") * 1024 - held
        probe = PhaseMemory()
        train_step(cfg, plan, accelerator, run, 2, probe)
        with probe("evaluation"):
            evaluate(cfg, accelerator, run, 2)
    return {phase: (max(peaks.get(n, 0) for n in names) - overhead) / GIB for phase, names in MEASURED_PHASES.items()
            if any(n in peaks for n in names)}


def validate() -> int:
    """Measure every case in a fresh process and print the model's error per phase; 1 if any is over 15%."""
    import tempfile

    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    worst = 0.0
    print("| case | phase | measured GiB | computed GiB | error | above static: measured / computed |")
    print("|---|---|---|---|---|---|")
    import importlib.util

    for case in VALIDATION_CASES:
        if case in LORA_RECIPES and importlib.util.find_spec("peft") is None:
            print(f"| {case} | not measured: peft is not installed (pip install -e \".[lora]\") | | | | |")
            continue
        measured = json.loads(subprocess.run([sys.executable, __file__, "--measure", case], env=env, check=True,
                                             capture_output=True, text=True).stdout.strip().splitlines()[-1])
        with tempfile.TemporaryDirectory() as tmp:
            computed = memory(validation_config(case, tmp, tmp), shape=VALIDATION_SHAPE, mixed_precision="no")
        for phase, value in measured.items():
            error = computed[phase] / value - 1
            worst = max(worst, abs(error))
            print(f"| {case} | {phase} | {value:.3f} | {computed[phase]:.3f} | {error:+.1%} | "
                  f"{value - computed['static']:.3f} / {computed[phase] - computed['static']:.3f} |", flush=True)
    # The CPU cannot run the recipes' bf16 autocast at speed, but it can count what autocast keeps: one layer's
    # activations at Qwen2.5-0.5B's width, with and without it.
    print("\n| Qwen2.5-0.5B's layer, per token | measured B | computed B | error |\n|---|---|---|---|")
    for name, autocast, weight, lora in (("float32", False, "float32", None), ("bf16 autocast", True, "float32", None),
                                         ("bf16 weights", True, "bfloat16", None),
                                         ("bf16 weights, LoRA rank 32", True, "bfloat16", LoRA(32))):
        measured = measured_layer_activations(QWEN2_5_0_5B, autocast, weight=weight, lora=lora)
        computed = layer_activations(QWEN2_5_0_5B, BYTES[weight], 2 if autocast else BYTES[weight], lora)
        worst = max(worst, abs(computed / measured - 1))
        print(f"| {name} | {measured:,.0f} | {computed:,} | {computed / measured - 1:+.1%} |")
    # The prompt pass's peak a token, at the same width: bf16 weights and PEFT's float32 adapters under autocast
    # as the LoRA recipes evaluate, each in a fresh process (the resident set's peak)
    print("\n| Qwen2.5-0.5B's prompt pass, per token | measured B | computed B | error |\n|---|---|---|---|")
    for name, (weight, autocast, lora) in PREFILL_SETTINGS.items():
        if lora and importlib.util.find_spec("peft") is None:
            print(f"| {name} | not measured: peft is not installed | | |")
            continue
        measured = json.loads(subprocess.run([sys.executable, __file__, "--measure-prefill", name], env=env, check=True,
                                             capture_output=True, text=True).stdout.strip().splitlines()[-1])
        computed = prefill_activations(QWEN2_5_0_5B, 128, 2 if autocast else BYTES[weight], lora)
        worst = max(worst, abs(computed / measured - 1))
        print(f"| {name} | {measured:,.0f} | {computed:,} | {computed / measured - 1:+.1%} |", flush=True)
    print(f"largest error: {worst:.1%} ({'within' if worst <= 0.15 else 'OVER'} 15%)")
    return 0 if worst <= 0.15 else 1


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", choices=sorted(RECIPES), default="ppo",
                        help="ppo: configs/gsm8k_qwen2.5_0.5b.yaml; grpo: configs/gsm8k_qwen2.5_0.5b_grpo.yaml")
    parser.add_argument("--validate", action="store_true", help="compare with peaks measured on this CPU")
    parser.add_argument("--measure", choices=sorted(VALIDATION_CASES), help=argparse.SUPPRESS)
    parser.add_argument("--measure-prefill", choices=sorted(PREFILL_SETTINGS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:
        print(json.dumps(measure_case(args.measure)))
        return 0
    if args.measure_prefill:
        print(json.dumps(measured_prefill_activations(args.measure_prefill)))
        return 0
    if args.validate:
        return validate()
    print(f"Qwen2.5-0.5B: {num_parameters() / 1e6:.1f}M parameters (tied embeddings); "
          f"{RECIPES[args.recipe].removeprefix(REPO + os.sep)}, prompts of {GSM8K_PROMPT_TOKENS} tokens (evaluation: "
          f"{GSM8K_TEST_PROMPT_TOKENS}); a card holds "
          f"its GB less {RESERVED_GIB:.0f} GiB (CUDA context, allocator slack)\n")
    print(table(recipe_columns(args.recipe)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
