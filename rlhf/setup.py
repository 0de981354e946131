"""Building a run: data and models through the hub code path, optimizers and their lr schedules, the prompt
order, KL controller, reward.

    run = setup(cfg, accelerator)       # what train.py's main() uses
    run = build_setup(cfg, accelerator, tokenizer, train_set, val_set, *load_models(cfg, model_path))
                                        # the same from data and models loaded elsewhere (bench/)
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, set_seed
from transformers.modeling_layers import GradientCheckpointingLayer

from rlhf import core_algos, kl, lora
from rlhf.config import Config
from rlhf.models import load_causal_lm, load_critic
from rlhf.rewards import RewardFn, load_reward
from rlhf.prompt_order import PromptOrder
from rlhf.tasks import get_task


@dataclass
class Setup:
    """Everything a step needs, built by `setup` (or `build_setup`, which the benchmarks call)."""

    tokenizer: object
    train_set: object  # datasets.Dataset with input_ids and ground_truth
    val_set: object
    models: tuple  # (actor, critic, ref); critic None for grpo/rloo, ref None without a KL or the KL panel (with LoRA a lora.Reference: the actor, adapters off)
    optimizers: tuple  # (actor_opt, critic_opt), critic_opt None without a critic
    prompt_order: PromptOrder  # which prompts each step draws
    kl_ctrl: kl.FixedKLController | kl.AdaptiveKLController
    reward: RewardFn  # reward.function, which scores the responses (rlhf/rewards)
    lr_schedulers: tuple  # (actor's, critic's) LambdaLR, stepped once per PPO step; the critic's None without a critic
    val_metrics: dict = field(default_factory=dict)  # the task's own metrics of held-out responses (rlhf.tasks)


def setup(cfg: Config, accelerator: Accelerator) -> Setup:
    """The task's data and models (prepare_data_and_models), optimizers, prompt order, KL controller and reward."""
    tokenizer, train_set, val_set, actor, critic, ref = prepare_data_and_models(cfg, accelerator)
    adapters = f" (LoRA rank {cfg.model.lora.rank})" if cfg.model.lora.rank else ""
    critic_line = f"; critic parameters: {lora.parameter_line(critic)}" if critic is not None else ""
    accelerator.print(f"train prompts: {len(train_set)}, held-out: {len(val_set)}, "
                      f"processes: {accelerator.num_processes} ({accelerator.distributed_type.value}), "
                      f"device: {accelerator.device}\n"
                      f"actor parameters: {lora.parameter_line(actor)}{adapters}{critic_line}")
    run = build_setup(cfg, accelerator, tokenizer, train_set, val_set, actor, critic, ref)
    run.val_metrics = get_task(cfg.task.name).val_metrics(cfg, val_set)
    return run


def prepare_data_and_models(cfg: Config, accelerator: Accelerator):
    """(tokenizer, train_set, val_set, actor, critic, ref): the task's data (rlhf.tasks: the embedded default
    and GSM8K through the hub code path, or a task of the config's own) and the models loaded from its model
    path (load_models)."""
    data = get_task(cfg.task.name).load(cfg, accelerator)
    return (data.tokenizer, data.train_set, data.val_set, *load_models(cfg, data.model_path))


def build_setup(cfg: Config, accelerator: Accelerator, tokenizer, train_set, val_set, actor, critic, ref) -> Setup:
    """Everything after loading: seed, optimizers, accelerate's wrapping, lr schedules, prompt order, KL
    controller, reward."""
    # Seeded after the models load: building the embedded cache (or not, when it exists) draws random
    # numbers, and the run must not depend on whether it did. Seed + process index: ranks sample differently.
    set_seed(cfg.trainer.seed, device_specific=True)
    actor_opt, critic_opt = build_optimizers(cfg, actor, critic)
    # One model and its optimizer per prepare call: FSDP2 takes no more (it rebuilds the optimizer's parameter
    # list after sharding the model). Critic-free estimators: nothing of a critic is built, prepared or saved.
    actor, actor_opt = accelerator.prepare(actor, actor_opt)
    if critic is not None:
        critic, critic_opt = accelerator.prepare(critic, critic_opt)
    # Under mixed precision, prepare() makes each forward pass autocast *and* convert its outputs to float32:
    # a float32 copy of the (B, T, V) logits (2.5 GB for the GPU recipe's micro-batch, 8 x 513 x 151,936),
    # which the chunked log-prob, entropy and KL functions exist to avoid. unwrap_model(keep_fp32_wrapper=False)
    # takes that wrapper off the model (in place, inside any DDP or FSDP wrapper); rlhf/step.py runs its forward
    # passes in accelerator.autocast() instead (tests/test_train.py checks no such copy is made).
    for model in (m for m in (actor, critic) if m is not None):
        drop_own_forward(accelerator.unwrap_model(model, keep_fp32_wrapper=False))
    if ref is not None and not isinstance(ref, lora.Reference):  # a Reference is the actor, which prepare moved
        ref = ref.to(accelerator.device)
    kc = cfg.algorithm.kl_ctrl
    return Setup(tokenizer, train_set, val_set, (actor, critic, ref), (actor_opt, critic_opt),
                 PromptOrder(len(train_set), cfg.data.train_batch_size, cfg.trainer.seed),
                 kl.build_kl_controller(kc.type, kc.kl_coef, kc.target_kl, kc.horizon), load_reward(cfg, get_task(cfg.task.name).prompt_fields),
                 build_lr_schedulers(cfg, actor_opt, critic_opt))


def drop_own_forward(model) -> None:
    """unwrap_model puts a forward back on the model as a method bound to the model, in its own attributes: a
    reference cycle (model -> forward -> model) that only a full garbage collection frees, so a model let go
    keeps its memory (on a GPU, its weights and AdamW moments) until one runs. Dropped, the class's forward
    answers: the one a run without mixed precision calls (the copy unwrap_model binds is that function with
    transformers' argument decorators peeled off)."""
    if getattr(model.__dict__.get("forward"), "__self__", None) is model:
        del model.forward


def shard_on_cpu(accelerator: Accelerator) -> None:
    """Turn an FSDP launch on CPU processes back into FSDP. accelerate keeps its FSDP plugin only for GPU-like
    devices: on the CPU it quietly falls back to DDP (AcceleratorState, accelerate 1.15). torch's FSDP2
    (`fully_shard`) runs on the CPU over gloo, so we set back what accelerate dropped: the plugin, built from
    the FSDP_* variables `accelerate launch` sets from the config file, and the distributed type (in both of
    accelerate's shared states: AcceleratorState copies PartialState's on every construction). From there on
    it is accelerate's own FSDP2 code, the GPU path: `prepare` shards each decoder layer, `save_state` writes
    sharded checkpoints. tests/test_multiprocess.py runs it with 2 processes."""
    plugin = FullyShardedDataParallelPlugin()
    if accelerator.mixed_precision != "no":
        plugin.set_mixed_precision(accelerator.mixed_precision)
    accelerator.state.fsdp_plugin = plugin
    accelerator.state.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP


def load_models(cfg: Config, model_path: str):
    """(actor, critic, ref) in eval mode (no dropout: old and new log-probs must come from the same
    function); the critic None for a critic-free advantage estimator, the reference frozen, or None when there
    is no KL in the reward or the loss and no KL panel.

    With LoRA (model.lora.rank > 0) the actor is a PEFT model whose adapters alone train (and the critic's
    backbone too with model.lora.critic), and the reference is no second model: a lora.Reference, the actor with
    its adapters off. The target modules are checked against the model's config before any weight loads."""
    lora_cfg, critic_path = cfg.model.lora, cfg.model.critic_path or model_path
    has_critic = core_algos.needs_critic(cfg.algorithm.adv_estimator)
    if lora_cfg.rank:
        lora.check_target_modules(lora_cfg, model_path)
        if has_critic and lora_cfg.critic and critic_path != model_path:
            lora.check_target_modules(lora_cfg, critic_path)
    actor = load_causal_lm(model_path, cfg.model.dtype)
    critic = load_critic(critic_path, cfg.model.dtype) if has_critic else None
    need_ref = cfg.algorithm.use_kl_in_reward or cfg.actor.use_kl_loss or cfg.trainer.log_kl_panel
    ref = None
    if need_ref and not lora_cfg.rank:
        ref = load_causal_lm(model_path, cfg.model.ref_dtype or cfg.model.dtype).eval().requires_grad_(False)
    for model in (m for m in (actor, critic) if m is not None):
        model.eval()
        if cfg.model.gradient_checkpointing:
            enable_gradient_checkpointing(model)
    if lora_cfg.rank:
        actor = lora.add_adapters(actor, lora_cfg, cfg.trainer.seed)
        ref = lora.Reference(actor) if need_ref else None
        if critic is not None and lora_cfg.critic:
            head = "score" if hasattr(critic, "score") else "classifier"  # the value head (rlhf.models.load_critic)
            critic = lora.add_adapters(critic, lora_cfg, cfg.trainer.seed + 1, head=head)
    return actor, critic, ref


def enable_gradient_checkpointing(model) -> None:
    """Recompute each decoder layer in the backward instead of storing its activations, with the model in
    eval mode. transformers checkpoints a layer only while that layer is in training mode, and our models stay
    in eval mode (no dropout: old and new log-probs must come from the same function), where
    `gradient_checkpointing_enable()` alone does nothing. So the checkpointed layers' own flag is set: it is
    what decides the checkpointing, while every module inside them (attention, MLP, dropout) stays in eval
    mode. (A layer whose own forward applied dropout would start dropping out; Qwen2's does not.)
    transformers 5.24 renamed the switch to `activation_checkpointing_enable` (the old name goes in v6)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for module in model.modules():
        if isinstance(module, GradientCheckpointingLayer):
            module.training = True


def build_optimizers(cfg: Config, actor, critic):
    """AdamW for actor and critic (None without a critic), over their trainable parameters. fused=True: one
    kernel per step instead of a loop over tensors (measured 2.2 ms vs 11.8 ms per step for the 1M-parameter
    benchmark model on CPU)."""
    def adamw(model, lr, weight_decay):  # the trainable parameters: all of them, or LoRA's adapters
        trainable = [p for p in model.parameters() if p.requires_grad]
        return torch.optim.AdamW(trainable, lr=lr, weight_decay=weight_decay, fused=True)

    critic_opt = None if critic is None else adamw(critic, cfg.critic.lr, cfg.critic.weight_decay)
    return adamw(actor, cfg.actor.lr, cfg.actor.weight_decay), critic_opt


def lr_factor(step: int, total_steps: int, scheduler_type: str, warmup_steps: int = 0,
              min_lr_ratio: float = 0.0) -> float:
    """The lr of PPO step `step` (1, 2, ..., total_steps) as a fraction of the configured lr.

    Warmup, steps k <= W = warmup_steps: k / W, so step 1 trains at lr / W and step W at lr (HF's and verl's
    warmups start at 0, which spends step 1 at lr 0). Then, with p = (k - 1 - W) / (N - W) going from 0 at
    step W + 1 to (N - W - 1) / (N - W) at step N = total_steps, and m = min_lr_ratio:
    constant 1; linear m + (1 - m)(1 - p); cosine m + (1 - m)(1 + cos(pi p)) / 2 (HF's and verl's decay
    with its floor, which the lr would reach one step after the last).
    """
    if step <= warmup_steps:
        return step / warmup_steps
    if scheduler_type == "constant":
        return 1.0
    progress = min(1.0, (step - 1 - warmup_steps) / max(1, total_steps - warmup_steps))
    if scheduler_type == "linear":
        return min_lr_ratio + (1.0 - min_lr_ratio) * (1.0 - progress)
    if scheduler_type == "cosine":
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown lr_scheduler_type {scheduler_type!r}; valid choices: constant, linear, cosine")


def build_lr_schedulers(cfg: Config, actor_opt, critic_opt):
    """(actor's, critic's) torch LambdaLR over lr_factor (the critic's None without a critic), on the optimizers
    accelerate prepared. Each is stepped once per PPO step (rlhf.step.train_step) and registered for
    checkpointing by train.py's main(), so that save_state/load_state restore it. Not accelerate.prepare: its
    AcceleratedScheduler steps once per optimizer step, and as many times as there are processes (it assumes
    per-process batches), where the schedule here counts PPO steps, as verl's does."""
    total = cfg.trainer.total_steps

    def schedule(opt, learner):
        if opt is None:
            return None
        return torch.optim.lr_scheduler.LambdaLR(getattr(opt, "optimizer", opt), functools.partial(
            lr_factor_after, total_steps=total, scheduler_type=learner.lr_scheduler_type,
            warmup_steps=learner.lr_warmup_steps, min_lr_ratio=learner.min_lr_ratio))

    return schedule(actor_opt, cfg.actor), schedule(critic_opt, cfg.critic)


def lr_factor_after(done: int, **settings) -> float:
    """lr_factor of the PPO step after `done` steps: what LambdaLR calls, with the steps taken (0 for step 1)."""
    return lr_factor(done + 1, **settings)
