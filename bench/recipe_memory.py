"""The GPU recipes' memory per GPU, computed from Qwen2.5-0.5B's shape and the config's sizes.

    python bench/recipe_memory.py                 # docs/gpu.md's table for the PPO recipe, per card size
    python bench/recipe_memory.py --recipe grpo   # the same for the GRPO recipe (no critic, rollout.n = 5)

Each row is one kind of tensor at its largest, in GiB per process:
- actor and critic (float32 master weights, model.dtype): weights, gradients, AdamW's two moments; a
  critic-free estimator (grpo, rloo) builds no critic, and its rows are left out of the table;
- the reference (model.ref_dtype, bfloat16), frozen;
- the bfloat16 copy autocast makes of the float32 weights of the model in use (kept for the backward, and
  across tokens while sampling);
- the KV cache while sampling: layers x 2 (K, V) x KV heads x head dim x (prompt + response) tokens x the
  process's rollout batch (train_batch_size x rollout.n / processes), in bfloat16 under autocast; and the
  prefill's MLP activations (gate, up and their product, bf16, for every prompt token of the batch), which
  exist while the cache holds only the prompts;
- the largest logits of a micro-batch, which is the larger of two moments: the rollout's log-prob pass
  (rollout.log_prob_micro_batch_size rows of the actor's and the reference's bf16 logits alive together,
  for the exact KL) and the update (actor.ppo_micro_batch_size: bf16 logits, their gradient, the
  reference's logits when the KL loss is `full`, and one float32 chunk of LOGITS_CHUNK_ROWS rows);
- checkpointed activations: one float32 hidden state per layer and token of a micro-batch, plus one
  layer's activations being recomputed (an estimate: 16 hidden-sized bf16 tensors and the MLP's 3).
What is not counted: the CUDA context and allocator slack (~1-2 GB in practice), the attention's own
buffers. Prompts are counted at data.max_prompt_length (GSM8K's word problems are shorter: less in practice).
Sampling, the log-prob pass and the update do not overlap (each one's tensors are freed before the next),
so the peak is static + the bf16 copy of the weights + the largest of the three moments.
"""

from __future__ import annotations

import os

from rlhf import core_algos, kl
from rlhf.config import Config, load_config
from rlhf.core_algos import LOGITS_CHUNK_ROWS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

GIB = 2**30
RECIPE = os.path.join(REPO, "configs", "gsm8k_qwen2.5_0.5b.yaml")
GRPO_RECIPE = os.path.join(REPO, "configs", "gsm8k_qwen2.5_0.5b_grpo.yaml")
# Qwen/Qwen2.5-0.5B-Instruct's config.json, the fields that set its shape, under Qwen2Config's names (the
# rehearsal and the benchmark build their models from this one dict)
QWEN2_5_0_5B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                    num_key_value_heads=2, vocab_size=151_936, tie_word_embeddings=True)
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Micro-batch sizes for each card (one GPU, or DDP); each recipe's own are its 24 GB column.
CARDS = {24: [],
         40: ["actor.ppo_micro_batch_size=8", "rollout.log_prob_micro_batch_size=16"],
         80: ["actor.ppo_micro_batch_size=16", "rollout.log_prob_micro_batch_size=32"]}
# The GRPO recipe has no critic, so its micro-batches start larger; actor.ppo_micro_batch_size divides a
# mini-batch's 16 x 5 = 80 responses.
GRPO_CARDS = {24: [],
              40: ["actor.ppo_micro_batch_size=16", "rollout.log_prob_micro_batch_size=32"],
              80: ["actor.ppo_micro_batch_size=40", "rollout.log_prob_micro_batch_size=64"]}
RECIPES = {"ppo": (RECIPE, CARDS), "grpo": (GRPO_RECIPE, GRPO_CARDS)}


def num_parameters(shape: dict = QWEN2_5_0_5B) -> int:
    """Parameters of a Qwen2 causal LM of this shape with tied embeddings (biases on q, k, v as in Qwen2);
    the critic's one-output score head is counted by the caller."""
    h = shape["hidden_size"]
    kv_dim = shape["num_key_value_heads"] * (h // shape["num_attention_heads"])
    attention = h * h + h + 2 * (h * kv_dim + kv_dim) + h * h  # q (+bias), k, v (+bias), o
    layer = attention + 3 * h * shape["intermediate_size"] + 2 * h  # gate, up, down; two RMSNorms
    return shape["vocab_size"] * h + shape["num_hidden_layers"] * layer + h


def memory(cfg: Config, shape: dict = QWEN2_5_0_5B) -> dict[str, float]:
    """GiB per process of each row (see the module docstring), plus 'static', 'peak'; one GPU, or DDP."""
    h, v, layers, mlp = (shape[k] for k in ("hidden_size", "vocab_size", "num_hidden_layers", "intermediate_size"))
    head_dim = h // shape["num_attention_heads"]
    weight_bytes = BYTES[cfg.model.dtype]
    actor = num_parameters(shape)
    critic = num_parameters(shape) + h + 1 if core_algos.needs_critic(cfg.algorithm.adv_estimator) else 0
    tokens = cfg.data.max_prompt_length + cfg.data.max_response_length
    rows = cfg.data.max_response_length + 1  # logits kept per response (train.py's response_logits)
    rollout_batch = cfg.data.train_batch_size * cfg.rollout.n
    full_loss = cfg.actor.use_kl_loss and kl.needs_logits(cfg.actor.kl_loss_type)
    micro = cfg.actor.ppo_micro_batch_size
    out = {
        "actor weights": actor * weight_bytes,
        "actor gradients": actor * weight_bytes,
        "actor AdamW states": 2 * actor * 4,
        "critic weights": critic * weight_bytes,
        "critic gradients": critic * weight_bytes,
        "critic AdamW states": 2 * critic * 4,
        "reference": num_parameters(shape) * BYTES[cfg.model.ref_dtype or cfg.model.dtype],
        "bf16 copy of the weights in use (autocast)": actor * 2 if weight_bytes == 4 else 0,
        "KV cache (sampling)": layers * 2 * shape["num_key_value_heads"] * head_dim * tokens * rollout_batch * 2,
        "prefill MLP activations (sampling, transient)": rollout_batch * cfg.data.max_prompt_length * mlp * 3 * 2,
        "logits, rollout log-prob pass": 2 * cfg.rollout.log_prob_micro_batch_size * rows * v * 2,
        "logits, update": (3 if full_loss else 2) * micro * rows * v * 2 + LOGITS_CHUNK_ROWS * v * 4,
        "activations, update (estimate)": micro * tokens * h * (layers * 4 + 16 * 2) + micro * tokens * mlp * 3 * 2,
    }
    out = {key: value / GIB for key, value in out.items()}
    out["static"] = sum(v for k, v in out.items() if k.startswith(("actor", "critic", "reference")))
    prompt_share = cfg.data.max_prompt_length / tokens  # of the KV cache, when the prefill runs
    sampling = max(out["KV cache (sampling)"], out["KV cache (sampling)"] * prompt_share
                   + out["prefill MLP activations (sampling, transient)"])
    update = out["logits, update"] + out["activations, update (estimate)"]
    out["peak"] = (out["static"] + out["bf16 copy of the weights in use (autocast)"]
                   + max(sampling, out["logits, rollout log-prob pass"], update))
    return out


def table(columns: dict[str, dict[str, float]]) -> str:
    """Markdown: one row per kind of tensor, one column per setting; rows that are 0 in every column (the
    critic's, without one) are left out."""
    keys = [key for key in next(iter(columns.values())) if any(col[key] for col in columns.values())]
    lines = ["| GiB per GPU | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for key in keys:
        name = f"**{key}**" if key in ("static", "peak") else key
        lines.append(f"| {name} | " + " | ".join(f"{col[key]:.2f}" for col in columns.values()) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", choices=sorted(RECIPES), default="ppo",
                        help="ppo: configs/gsm8k_qwen2.5_0.5b.yaml; grpo: configs/gsm8k_qwen2.5_0.5b_grpo.yaml")
    args = parser.parse_args(argv)
    path, cards = RECIPES[args.recipe]
    columns = {}
    for card, overrides in cards.items():
        cfg = load_config(path, overrides)
        label = (f"{card} GB card: micro {cfg.actor.ppo_micro_batch_size}, "
                 f"log-prob micro {cfg.rollout.log_prob_micro_batch_size}")
        columns[label] = memory(cfg)
    print(f"Qwen2.5-0.5B: {num_parameters() / 1e6:.1f}M parameters (tied embeddings); "
          f"{path.removeprefix(REPO + os.sep)}, one GPU or DDP\n")
    print(table(columns))


if __name__ == "__main__":
    main()
