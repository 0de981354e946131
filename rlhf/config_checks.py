"""The config's value checks, run before any model or data loads: `validate` (load_config runs it) raises
ConfigError for a value that cannot work, `check_batch_sizes` (train.py, for the processes launched) for batch
sizes that do not divide over the processes; `warnings_for` lists legal settings that are almost certainly a
mistake, printed once at start.

All take an rlhf.config.Config. Not imported: rlhf.config's load_config calls validate, and the import would
tie the two into a circle; rlhf.config re-exports validate, check_batch_sizes and warnings_for.
"""

from __future__ import annotations

import math
import os

from rlhf.errors import ConfigError

LR_SCHEDULER_TYPES = ("constant", "linear", "cosine")  # actor/critic.lr_scheduler_type (rlhf.setup.lr_factor)


def _choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"config key {key!r} got {value!r}; valid choices: {', '.join(choices)}.")


def _positive(key: str, value: float | int, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"config key {key!r} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}.")


def _divides(small_key: str, small: int, big_key: str, big: int) -> None:
    if big % small:
        low = [d for d in range(1, math.isqrt(big) + 1) if big % d == 0]
        divisors = ", ".join(str(d) for d in sorted(set(low + [big // d for d in low])))
        raise ConfigError(f"{big_key}={big} is not divisible by {small_key}={small}; choose sizes that divide "
                          f"(divisors of {big}: {divisors}).")


def validate(cfg) -> None:
    """Check values (not just types), the batch sizes for one process (`check_batch_sizes`; train.py checks them
    again for the processes launched). Raises ConfigError before anything expensive happens."""
    from rlhf import core_algos  # local imports: keep `rlhf.config` importable on its own
    from rlhf.kl import controllers, estimators
    from rlhf.data import looks_like_path
    from rlhf.models import DTYPE_NAMES
    from rlhf.tasks import get_task, task_options

    def checked(key: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ConfigError:
            raise
        except (ValueError, TypeError) as e:
            raise ConfigError(f"config key {key!r}: {e}") from None

    m, d, r, a, ac, t = cfg.model, cfg.data, cfg.rollout, cfg.algorithm, cfg.actor, cfg.trainer
    _choice("model.dtype", m.dtype, DTYPE_NAMES)
    if m.ref_dtype is not None:
        _choice("model.ref_dtype", m.ref_dtype, DTYPE_NAMES)
    if t.mixed_precision is not None:
        _choice("trainer.mixed_precision", t.mixed_precision, ("no", "bf16", "fp16"))
    _choice("data.reward_method", d.reward_method, ("strict", "flexible"))
    _choice("trainer.logger", t.logger, ("wandb", "none"))
    if t.export_dtype is not None:
        _choice("trainer.export_dtype", t.export_dtype, DTYPE_NAMES)
    _choice("actor.recompute_old_logprobs", ac.recompute_old_logprobs, ("auto", "always"))
    for section in ("actor", "critic"):
        learner = getattr(cfg, section)
        _choice(f"{section}.lr_scheduler_type", learner.lr_scheduler_type, LR_SCHEDULER_TYPES)
        _positive(f"{section}.lr_warmup_steps", learner.lr_warmup_steps, allow_zero=True)
        if learner.lr_warmup_steps > t.total_steps:
            raise ConfigError(f"{section}.lr_warmup_steps={learner.lr_warmup_steps} is more than trainer.total_steps="
                              f"{t.total_steps}: the lr would never reach {section}.lr; warm up for at most "
                              f"{t.total_steps} steps (0 = no warmup).")
        if not 0.0 <= learner.min_lr_ratio <= 1.0:
            raise ConfigError(f"config key '{section}.min_lr_ratio' must be in [0, 1] (a fraction of {section}.lr), "
                              f"got {learner.min_lr_ratio!r}.")
    for key in ("data.max_prompt_length", "data.max_response_length", "data.train_batch_size",
                "data.val_batch_size", "rollout.log_prob_micro_batch_size", "rollout.n", "actor.ppo_epochs",
                "actor.ppo_mini_batch_size", "actor.ppo_micro_batch_size", "trainer.total_steps",
                "trainer.max_ckpt_to_keep", "trainer.max_bad_steps", "rollout.temperature",
                "actor.lr", "critic.lr", "actor.clip_ratio", "actor.grad_clip", "critic.grad_clip"):
        section, name = key.split(".")
        _positive(key, getattr(getattr(cfg, section), name))
    for key in ("trainer.test_freq", "trainer.save_freq", "trainer.val_samples", "trainer.log_samples",
                "trainer.log_samples_freq", "rollout.top_k", "actor.entropy_coeff",
                "actor.kl_loss_coef", "algorithm.kl_ctrl.kl_coef", "critic.cliprange_value",
                "actor.weight_decay", "critic.weight_decay"):
        *path, name = key.split(".")
        node = cfg
        for p in path:
            node = getattr(node, p)
        _positive(key, getattr(node, name), allow_zero=True)
    if d.max_val_samples is not None:
        _positive("data.max_val_samples", d.max_val_samples)
    if d.val_prefill_batch_size is not None:
        _positive("data.val_prefill_batch_size", d.val_prefill_batch_size)
    if not 0.0 < r.top_p <= 1.0:
        raise ConfigError(f"config key 'rollout.top_p' must be in (0, 1], got {r.top_p!r}.")
    if not 0.0 <= a.gamma <= 1.0 or not 0.0 <= a.lam <= 1.0:
        raise ConfigError(f"algorithm.gamma and algorithm.lam must be in [0, 1], got {a.gamma!r} and {a.lam!r}.")
    if ac.clip_ratio_c <= 1.0:
        raise ConfigError(f"config key 'actor.clip_ratio_c' (dual clip) must be > 1, got {ac.clip_ratio_c!r}.")
    if not math.isfinite(cfg.reward.correct_threshold):
        raise ConfigError("config key 'reward.correct_threshold' must be a finite number, "
                          f"got {cfg.reward.correct_threshold!r}.")
    checked("actor.loss_agg_mode", core_algos.check_loss_agg_mode, ac.loss_agg_mode)
    checked("algorithm.adv_estimator", core_algos.check_adv_estimator, a.adv_estimator)
    checked("algorithm.kl_penalty", estimators.parse_estimator, a.kl_penalty)  # parsed once: the step gets the object back
    checked("actor.kl_loss_type", estimators.parse_estimator, ac.kl_loss_type)
    kc = a.kl_ctrl
    checked("algorithm.kl_ctrl", controllers.check_kl_ctrl, kc.type, kc.kl_coef, kc.target_kl, kc.horizon)

    check_lora(cfg.model)
    check_trained_dtype(cfg.model, core_algos.needs_critic(a.adv_estimator))
    check_batch_sizes(cfg, num_processes=1)
    task = checked("task.name", get_task, cfg.task.name)
    task_options(cfg)  # the task's own keys and their types
    checked(f"task.name={cfg.task.name}", task.check, cfg)
    from rlhf.rewards import load_reward

    load_reward(cfg, task.prompt_fields)  # imports reward.function and checks that it takes the trainer's keyword call
    if t.resume_from not in (None, "auto") and not os.path.isdir(t.resume_from):
        raise ConfigError(f"trainer.resume_from={t.resume_from!r} is not a directory (use a checkpoint dir or 'auto').")
    for key, path in (("model.path", m.path), ("model.critic_path", m.critic_path)):
        if path not in (None, "embedded") and looks_like_path(path) and not os.path.isdir(path):
            raise ConfigError(f"config key {key!r}: local model path {path!r} does not exist "
                              "(give a directory written by save_pretrained, a hub name like "
                              "'Qwen/Qwen2.5-0.5B-Instruct', or 'embedded').")


def check_lora(m) -> None:
    """model.lora: a rank >= 0, and with LoRA on (rank > 0) no dropout, a positive alpha, target modules, the
    reference in the policy's dtype, and peft installed. Whether the model has the target modules is checked once
    its config is known, before its weights load (rlhf.lora.check_target_modules)."""
    lora = m.lora
    _positive("model.lora.rank", lora.rank, allow_zero=True)
    if not lora.rank:
        return
    if lora.dropout != 0:
        raise ConfigError(f"model.lora.dropout={lora.dropout!r}: LoRA dropout must be 0. The reference is the policy "
                          "with its adapters off, and the old, new and reference log-probs must all come from one "
                          "deterministic function (the models run in eval mode); dropout on the adapters would make "
                          "the policy's log-probs noisy and the KL estimates biased (docs/kl.md#lora).")
    _positive("model.lora.alpha", lora.alpha)
    if not lora.target_modules:
        raise ConfigError("model.lora.target_modules is empty: name the layers that get adapters (default: q_proj, "
                          "k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj).")
    if m.ref_dtype is not None and m.ref_dtype != m.dtype:
        raise ConfigError(f"model.ref_dtype={m.ref_dtype} with LoRA (model.lora.rank={lora.rank}): the reference is "
                          f"the policy's own weights with the adapters off, in model.dtype={m.dtype}; leave "
                          "model.ref_dtype unset.")
    from rlhf.lora import INSTALL, peft_missing

    if peft_missing():
        raise ConfigError(f"model.lora.rank={lora.rank} needs the peft library, which is not installed: {INSTALL} "
                          "(or set model.lora.rank=0 to train every weight).")


def check_trained_dtype(m, has_critic: bool) -> None:
    """Every trained weight is float32: model.dtype other than float32 is the frozen base of a LoRA run, never a
    model that trains whole (an AdamW update below half a bf16 ulp of its weight is lost: with lr 1e-6 that is
    nearly every update). LoRA's adapters and a critic's value head are float32 whatever model.dtype."""
    if m.dtype == "float32":
        return
    trained_whole = ("the actor" if not m.lora.rank else
                     "the critic (model.lora.critic=false)" if has_critic and not m.lora.critic else None)
    if trained_whole:
        raise ConfigError(f"model.dtype={m.dtype} would train every weight of {trained_whole} in {m.dtype}, where "
                          "AdamW updates smaller than half a unit in the last place are lost. Keep model.dtype=float32 "
                          "and train in bf16 with trainer.mixed_precision=bf16 (float32 master weights), or train "
                          "LoRA adapters (model.lora.rank > 0, with model.lora.critic=true for a critic), which are "
                          "float32 over a base in model.dtype.")


def check_batch_sizes(cfg, num_processes: int) -> None:
    """The batch arithmetic: the global batch (prompts) -> per-process shares -> mini-batches (prompts, each with
    its rollout.n responses) -> micro-batches (responses). Raises ConfigError naming sizes that divide."""
    d, ac = cfg.data, cfg.actor
    _divides("actor.ppo_mini_batch_size", ac.ppo_mini_batch_size, "data.train_batch_size", d.train_batch_size)
    _divides("number of processes", num_processes, "actor.ppo_mini_batch_size", ac.ppo_mini_batch_size)
    per_process_mini = ac.ppo_mini_batch_size // num_processes * cfg.rollout.n
    # A micro-batch larger than the process's share of the mini-batch is that share, in one pass: a config
    # runs unchanged on more processes.
    _divides("actor.ppo_micro_batch_size", min(ac.ppo_micro_batch_size, per_process_mini),
             "actor.ppo_mini_batch_size per process x rollout.n", per_process_mini)


def _corrected_k3_warning(ac) -> list[str]:
    """The off-policy correction turns a k3 loss into k3+ (rlhf.kl's AS_PLUS rule): say so, since the
    configured name still reads as GRPO's forward-KL loss."""
    from rlhf.kl import estimators as kl

    name = ac.kl_loss_type
    if not (ac.use_kl_loss and ac.kl_loss_off_policy_correction) or kl.needs_logits(name):
        return []
    if kl.off_policy_rule(name) != kl.AS_PLUS:
        return []
    return [f"actor.kl_loss_type={name} with actor.kl_loss_off_policy_correction=true trains bit for "
            "bit as k3+ (k3's value, k2's gradient, rho detached): a reverse-KL regulariser on every update, the "
            "first included, not k3's forward-KL loss. The correction weights k3 so because rho in the graph would "
            "push a token past k3's clamp (d < -2.611) further down. Write actor.kl_loss_type=k3+ to say so "
            "(uncorrected, k3 follows the forward KL on each step's first update only, neither KL after it)."]


def warnings_for(cfg) -> list[str]:
    """Legal settings that are almost certainly a mistake; printed once at start."""
    from rlhf.kl import estimators as kl

    out = []
    a, ac, r = cfg.algorithm, cfg.actor, cfg.rollout
    kl_on = a.use_kl_in_reward or ac.use_kl_loss
    if ac.use_kl_loss and kl.canonical(ac.kl_loss_type) == "k1":
        out.append(f"actor.kl_loss_type={ac.kl_loss_type}: k1 as a loss has zero expected gradient; "
                   "this does not regularise (use k2, k3+ or full; or k1 in the reward).")
    if a.use_kl_in_reward and kl.canonical(a.kl_penalty) == "k3":
        out.append(f"algorithm.kl_penalty={a.kl_penalty}: k3 in the reward gives a biased gradient "
                   "(grad KL(pi||ref) - grad KL(ref||pi)); k1 is the principled choice there.")
    if kl_on and (r.top_k > 0 or r.top_p < 1.0):
        out.append(f"rollout.top_k={r.top_k}, rollout.top_p={r.top_p} with a KL option on: sampled tokens are "
                   "not samples of the policy, so the KL estimates are biased (k1 can go negative).")
    if a.use_kl_in_reward and a.kl_ctrl.kl_coef == 0:
        out.append("algorithm.use_kl_in_reward=true with algorithm.kl_ctrl.kl_coef=0: the penalty does nothing.")
    if a.adv_estimator != "gae" and r.n == 1:
        out.append(f"algorithm.adv_estimator={a.adv_estimator} with rollout.n=1: every group is one response, "
                   "whose advantage is its own score (no baseline); sample several (rollout.n=4, say).")
    if ac.use_kl_loss and ac.kl_loss_coef == 0:
        out.append("actor.use_kl_loss=true with actor.kl_loss_coef=0: the KL loss does nothing.")
    out += _corrected_k3_warning(ac)
    for section in ("actor", "critic"):
        learner = getattr(cfg, section)
        if learner.lr_scheduler_type == "constant" and learner.min_lr_ratio > 0:
            out.append(f"{section}.min_lr_ratio={learner.min_lr_ratio} with {section}.lr_scheduler_type=constant: "
                       "there is no decay for it to floor (use linear or cosine).")
    from rlhf.rewards import GSM8K_REWARD

    if cfg.data.reward_method != "strict" and cfg.reward.function != GSM8K_REWARD:
        out.append(f"data.reward_method={cfg.data.reward_method} with reward.function={cfg.reward.function}: the "
                   f"method is GSM8K's rule's ({GSM8K_REWARD}), which this run does not use.")
    return out
