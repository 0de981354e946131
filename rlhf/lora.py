"""LoRA adapters (PEFT) on the policy and, where asked, the critic; the reference as the policy with its adapters
off; the adapters merged for export.

    actor = add_adapters(actor, cfg.model.lora)          # a peft.PeftModel: only the adapters train
    ref = Reference(accelerator.unwrap_model(actor))     # the base model: the same weights, adapters off
    state = merged_state(peft_state)                     # plain transformers names, W + (alpha / r) B A

With LoRA on, no second model is loaded for the reference: `Reference` runs the policy's PEFT model inside
`disable_adapter()`, where every LoRA layer returns its frozen base layer's output and nothing else, so its
logits are the base model's bit for bit (tests/test_lora.py), and every KL estimator gets what a separate
reference would give (docs/kl.md#lora). That holds because the adapters have no dropout (model.lora.dropout
must be 0) and are never merged into the base weights during training.

peft is an optional extra (pip install -e ".[lora]"), imported here only when LoRA is on.
"""

from __future__ import annotations

import re

import torch

INSTALL = 'pip install -e ".[lora]"'
TIED = ("lm_head", "embed_tokens")  # the module names of the embeddings a tie_word_embeddings config ties


def peft_missing() -> bool:
    """Whether peft cannot be imported (the config check refuses LoRA then)."""
    try:
        import peft  # noqa: F401
    except ImportError:
        return True
    return False


def check_target_modules(lora, model_path: str) -> None:
    """ConfigError unless every name in model.lora.target_modules is a module of the model at `model_path`, and
    none is a tied embedding (an adapter on `lm_head` or `embed_tokens` of a model whose config ties them would
    adapt one shared weight two ways, which no merged export can hold); run before any weight loads, on the
    model's config alone (built on the meta device: no weights read, no memory)."""
    import copy

    from transformers import AutoConfig, AutoModelForCausalLM

    from rlhf.errors import ConfigError

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config))
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules() if name}
    missing = [name for name in lora.target_modules if name not in names]
    if missing:
        linear = sorted(n for n in names if n.endswith("_proj")) or sorted(names)
        raise ConfigError(f"model.lora.target_modules: {', '.join(missing)} is not a module of {model_path}; its "
                          f"projection layers are {', '.join(linear)} (all its module names: "
                          f"{', '.join(sorted(names))}).")
    tied = [name for name in lora.target_modules if name in TIED and getattr(config, "tie_word_embeddings", False)]
    if tied:
        raise ConfigError(f"model.lora.target_modules: {', '.join(tied)} is a tied embedding of {model_path} "
                          "(tie_word_embeddings: the input embedding and lm_head are one weight), which the merged "
                          "export cannot hold adapted one way only; leave it out (the default targets are the "
                          f"projection layers: {', '.join(sorted(n for n in names if n.endswith('_proj')))}).")


def add_adapters(model, lora, seed: int, head: str | None = None):
    """`model` as a peft.PeftModel with LoRA adapters (rank, alpha, target modules of `lora`, the config's
    model.lora) on its target modules, everything else frozen, except the module named `head` (the critic's value
    head), which stays fully trainable. PEFT's initialisation (A random, B zero: the model starts unchanged) draws
    from `seed` alone, so a run does not depend on what drew random numbers before. What trains is float32
    whatever the base's dtype: the adapters (PEFT's default) and the head, cast here, whose input is cast to
    float32 (an AdamW step on a bf16 weight is lost when it is under half a bf16 ulp)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=0.0,
                        target_modules=list(lora.target_modules), bias="none")
    # No task_type: the bare PeftModel forwards every argument (logits_to_keep, position_ids) to the model, and a
    # value head is made trainable here by name instead of being copied by modules_to_save.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        peft_model = get_peft_model(model, config)
    if head is not None:
        value_head = getattr(peft_model.get_base_model(), head).float().requires_grad_(True)
        value_head.register_forward_pre_hook(lambda module, args: tuple(a.to(module.weight.dtype) for a in args))
    return peft_model


def is_peft(model) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "get_base_model")


def plain_model(model):
    """The transformers model inside a PEFT model (its LoRA layers in place), else `model`: what rlhf.decode runs."""
    return model.get_base_model() if is_peft(model) else model


class Reference:
    """The reference model of a LoRA run: the policy's PEFT model with its adapters off, without gradients.
    Called as a model is (`ref(input_ids=..., ...)`); holds no weights of its own."""

    def __init__(self, peft_model):
        self.policy = peft_model  # unwrapped (not DDP's wrapper): a reference forward takes no part in a sync

    def __call__(self, **kwargs):
        with torch.no_grad(), self.policy.disable_adapter():
            return self.policy(**kwargs)


def parameter_line(model) -> str:
    """"0.52M, trainable 0.012M float32": the parameters, and the trainable ones by dtype."""
    total = sum(p.numel() for p in model.parameters())
    by_dtype: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.requires_grad:
            by_dtype[p.dtype] = by_dtype.get(p.dtype, 0) + p.numel()
    trainable = ", ".join(f"{n / 1e6:.3f}M {str(dtype).removeprefix('torch.')}" for dtype, n in by_dtype.items())
    return f"{total / 1e6:.2f}M, trainable {trainable or 'none'}"


# ----------------------------------------------------------------------------- merge for export

_PREFIX = "base_model.model."
_LORA = re.compile(r"^(.*)\.lora_([AB])\.[^.]+\.weight$")


def merged_state(state: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A PEFT model's state dict (names under base_model.model., each adapted layer's frozen weight as
    `<layer>.base_layer.weight` beside `<layer>.lora_A.<adapter>.weight` (r, in) and `lora_B` (out, r)) ->
    the plain transformers state dict in float32, every adapted weight W + scaling * B @ A (scaling = alpha /
    rank). float32, not the base's dtype: a small adapter's change is below half a bf16 ulp of most weights, so
    rounding W + BA to bf16 would lose most of it (docs/training.md#your-trained-model)."""
    plain, factors = {}, {}
    for name, value in state.items():
        name = name.removeprefix(_PREFIX)
        found = _LORA.match(name)
        if found:
            factors.setdefault(found.group(1), {})[found.group(2)] = value
        else:
            plain[name.replace(".base_layer.", ".")] = value.float() if value.is_floating_point() else value
    for layer, ab in factors.items():
        plain[f"{layer}.weight"] = plain[f"{layer}.weight"] + scaling * (ab["B"].float() @ ab["A"].float())
    return plain


def adapter_names(model) -> set[str]:
    """The names (in `model`'s own state dict) of what a LoRA run trains and checkpoints: its trainable
    parameters (the adapters, a critic's value head)."""
    return {name for name, p in model.named_parameters() if p.requires_grad}
