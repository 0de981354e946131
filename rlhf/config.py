"""The one typed config schema, YAML loading and dotted overrides.

    cfg = load_config("configs/tiny.yaml", ["actor.kl_loss_type=k3+", "trainer.total_steps=50"])

Defaults live in the dataclasses below (one comment per field); YAML files hold only what differs. Keys and
types are checked here, values by rlhf.config_checks (`validate`, which load_config runs, and `warnings_for`,
both re-exported here), all before any model or data loads, so a typo costs seconds, not a model load.
Names of the KL options follow verl (`algorithm.use_kl_in_reward`, `algorithm.kl_penalty`,
`algorithm.kl_ctrl.*`, `actor.use_kl_loss`, `actor.kl_loss_type`, `actor.kl_loss_coef`) so verl users
can carry their overrides over.

We hand-write the ~150 lines of parsing instead of using OmegaConf/Hydra: the schema is small, and we
want every error to be one paragraph naming the key, the bad value and the valid choices.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass, field
from typing import Any

import yaml

from rlhf.config_checks import check_batch_sizes, validate, warnings_for  # noqa: F401  (re-exported for the rest)
from rlhf.errors import ConfigError  # noqa: F401  (raised here, and imported from here by the rest)
from rlhf.rewards.gsm8k import INSTRUCTION
from rlhf.schema import _build, _check_key, _coerce


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # Qwen2's and Llama's


@dataclass
class LoraConfig:
    rank: int = 0  # LoRA rank r of the adapters (PEFT); 0 = off: every weight trains (docs/training.md#lora)
    alpha: float = 16.0  # LoRA alpha: the adapters' update is scaled by alpha / rank
    dropout: float = 0.0  # must be 0: the reference is the policy with its adapters off, and the log-probs come from eval mode (docs/kl.md#lora)
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))  # the linear layers that get adapters (by name: every module whose name ends so)
    critic: bool = False  # adapters on the critic's backbone too (its value head still trains fully); false = the critic trains every weight


@dataclass
class ModelConfig:
    path: str = "embedded"  # "embedded" (the tiny local model, built and warm-started here), a hub name or a local path; a task that builds its own model (lab.synthetic's) does not read it
    critic_path: str | None = None  # backbone for the critic; None = same as `path`
    dtype: str = "float32"  # float32 | bfloat16 | float16: the weights; float32 for a model trained whole (others refused: train in bf16 with trainer.mixed_precision), with LoRA the frozen base's (what trains stays float32)
    ref_dtype: str | None = None  # the frozen reference's weights; None = same as dtype
    gradient_checkpointing: bool = False  # trade compute for memory on long responses
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class DataConfig:
    train_files: str = "embedded"  # "embedded", a hub dataset name ("openai/gsm8k") or a local .jsonl/.json/.parquet
    val_files: str = "embedded"  # same choices, for the held-out split
    subset: str = "main"  # hub config name (GSM8K has "main" and "socratic")
    train_split: str = "train"  # split name for hub datasets (a local file is the whole split)
    val_split: str = "test"  # held-out split name for hub datasets
    question_key: str = "question"  # the data's column holding the question (a local file's or a hub dataset's)
    answer_key: str = "answer"  # the data's column holding the answer, ending in "#### <number>" (the reference)
    instruction: str = INSTRUCTION  # appended to each question after a space (rlhf.data.INSTRUCTION, verl's GSM8K instruction); "" = the question alone
    system_prompt: str | None = None  # a system turn before the question (in the chat template; plain-text prompts: before it, then a blank line); None = none
    max_val_samples: int | None = None  # evaluate on the first N held-out problems (None = all)
    max_prompt_length: int = 256  # longer prompts are filtered (and counted), never cut
    max_response_length: int = 256  # generation stops at EOS or here
    train_batch_size: int = 64  # prompts per PPO step, over all processes
    val_batch_size: int = 64  # prompts per greedy-evaluation batch on each process
    val_prefill_batch_size: int | None = None  # prompts per forward of the evaluation's prompt pass, whose keys and values go into the decoding's cache one sub-batch at a time, so the pass holds one sub-batch's activations (the same tokens; not under FSDP2, whose decoding loop runs it whole); None = a whole batch (x trainer.val_samples when sampling) at once
    reward_method: str = "strict"  # GSM8K's rule (the default reward.function): strict: last "#### N"; flexible: last number


@dataclass
class RewardConfig:
    function: str = "rlhf.rewards.gsm8k:reward_func"  # <module>:<callable> that scores the responses: fn(prompts=, completions=, completion_ids=, **fields) -> one number per response (TRL's reward_funcs convention, docs/training.md#rewards); the default is GSM8K's rule
    functions: list[str] = field(default_factory=list)  # several reward functions (<module>:<callable> each) in place of reward.function, TRL's reward_funcs: the score is their sum weighted by reward.weights, each part logged as reward/<name>/mean (<name>: the callable's name); the first one judges correctness (val/accuracy, reward.correct_threshold), the others only shape the reward (docs/training.md#rewards); [] = reward.function alone
    weights: list[float] = field(default_factory=list)  # one weight per entry of reward.functions (TRL's reward_weights); [] = 1.0 each
    correct_threshold: float = 1.0  # a held-out response counts as right (val/accuracy, val/pass@k, val/maj@n) when its score is at least this; GSM8K's rule scores 1 or 0


@dataclass
class RolloutConfig:
    temperature: float = 1.0  # sampling temperature; log-probs are computed at the same temperature
    top_k: int = 0  # 0 = off. Truncated sampling makes tokens non-samples of pi: KL estimates get biased
    top_p: float = 1.0  # 1.0 = off (same caveat)
    ignore_eos: bool = False  # sample exactly data.max_response_length tokens (benchmarks); EOS stops generation otherwise
    log_prob_micro_batch_size: int = 16  # sequences per forward pass when computing log-probs/values
    n: int = 1  # responses sampled per prompt (the group of grpo/rloo)
    paired_noise: bool = False  # each step's sampling noise from (trainer.seed, step, process): same-seed runs share it (paired comparisons)
    logprobs_from_sampler: bool | None = None  # keep each sampled token's log-prob from the decoding loop (softmax(logits / temperature), before top-k/top-p): the old log-probs where no forward pass is needed for them, else compared with the recomputed ones (rollout/logprob_*); None = on for float32 weights without mixed precision, where the two agree to float rounding (docs/training.md)


@dataclass
class KLCtrlConfig:
    type: str = "fixed"  # fixed | adaptive (Ziegler et al. 2019)
    kl_coef: float = 0.001  # beta, the KL-in-reward coefficient (initial value when adaptive)
    target_kl: float = 0.1  # adaptive only: the KL the controller steers to (per-token mean of each response, averaged over responses, as verl)
    horizon: int = 10000  # adaptive only: how fast it steers (in samples)


@dataclass
class AlgorithmConfig:
    gamma: float = 1.0  # GAE discount
    lam: float = 1.0  # GAE lambda (verl's default: Monte-Carlo returns, unbiased by a young critic)
    adv_estimator: str = "gae"  # gae (critic, GAE, whitened) | grpo | rloo (critic-free, relative to the prompt's rollout.n responses)
    norm_adv_by_std_in_grpo: bool = True  # grpo: divide by the group's std; false = Dr. GRPO (arXiv:2503.20783)
    use_kl_in_reward: bool = True  # token_reward_t = score_t - beta * kl_t
    kl_penalty: str = "k1"  # estimator for the reward (k1 is the principled choice there)
    kl_ctrl: KLCtrlConfig = field(default_factory=KLCtrlConfig)


@dataclass
class ActorConfig:
    lr: float = 1e-6  # AdamW learning rate of the policy
    lr_scheduler_type: str = "constant"  # constant | linear | cosine: the lr over trainer.total_steps, one step of the schedule per PPO step as in verl (docs/training.md#learning-rate-schedule)
    lr_warmup_steps: int = 0  # PPO steps of linear warmup: step k <= lr_warmup_steps trains at lr * k / lr_warmup_steps
    min_lr_ratio: float = 0.0  # linear | cosine: the decay's floor, as a fraction of lr (reached after the last step)
    weight_decay: float = 0.0  # AdamW weight decay of the policy
    ppo_epochs: int = 1  # passes over each rollout batch
    ppo_mini_batch_size: int = 16  # prompts per optimizer step, over all processes (x rollout.n responses, as verl)
    ppo_micro_batch_size: int = 8  # responses per forward/backward on each process (at most its mini-batch share)
    clip_ratio: float = 0.2  # PPO epsilon
    clip_ratio_c: float = 3.0  # dual-clip constant (Ye et al. 2020), > 1
    entropy_coeff: float = 0.0  # entropy bonus weight
    loss_agg_mode: str = "token-mean"  # token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm
    grad_clip: float = 1.0  # max gradient norm
    use_kl_loss: bool = False  # add kl_loss_coef * agg(kl(logprobs, ref_logprobs)) to the actor loss
    kl_loss_type: str = "low_var_kl"  # estimator for the loss (verl's default; see the KL table)
    kl_loss_coef: float = 0.001  # weight of the KL loss
    kl_loss_off_policy_correction: bool = False  # weight the KL loss by rho = pi/pi_old (exact after the first optimizer step; docs/kl.md)
    recompute_old_logprobs: str = "auto"  # auto: the actor's old-log-prob forward runs only when nothing else gives the old log-probs (rlhf.step.old_logprobs_from, docs/training.md); always: every step


@dataclass
class CriticConfig:
    lr: float = 1e-5  # AdamW learning rate of the critic
    lr_scheduler_type: str = "constant"  # constant | linear | cosine: the critic's lr over trainer.total_steps (as actor.lr_scheduler_type)
    lr_warmup_steps: int = 0  # PPO steps of linear warmup of the critic's lr (as actor.lr_warmup_steps)
    min_lr_ratio: float = 0.0  # linear | cosine: the floor of the critic's lr, as a fraction of critic.lr
    weight_decay: float = 0.0  # AdamW weight decay of the critic
    cliprange_value: float = 0.5  # value clipping around the rollout values
    grad_clip: float = 1.0  # max gradient norm of the critic


@dataclass
class TrainerConfig:
    total_steps: int = 100  # PPO steps (one rollout batch each)
    output_dir: str = "outputs/run"  # metrics.jsonl, the resolved config, checkpoints, wandb files
    cache_dir: str | None = None  # where the embedded default's warm start is cached; None = <output_dir>/embedded
    seed: int = 42  # seeds sampling, mini-batch order and the prompt order (+ process index for sampling)
    project_name: str = "rlhf-kl"  # wandb project
    experiment_name: str = "ppo"  # wandb run name
    group: str | None = None  # wandb group (runs to compare side by side); None = project default
    logger: str = "wandb"  # wandb | none. wandb runs offline when there are no credentials
    test_freq: int = 10  # greedy evaluation every N steps (also at step 0 and at the end); 0 = only those
    val_samples: int = 0  # n > 0: also n responses per held-out problem at the rollout temperature, for val/pass@k and val/maj@n (n times the evaluation's cost); 0 = off
    log_samples: int = 8  # responses shown at each evaluation (the first greedy held-out ones) and every log_samples_freq steps (the training batch's first): prompt, response, reward and its parts, correct, length, cut; a wandb table (samples/val, samples/train) and <output_dir>/samples.jsonl, from the main process; 0 = off
    log_samples_freq: int = 10  # the training batch's samples every N steps; 0 = only the evaluations'
    save_freq: int = 0  # checkpoint every N steps (always at the end); 0 = only at the end
    max_ckpt_to_keep: int = 2  # older checkpoints are deleted
    save_model_with_checkpoints: bool = False  # also write a Hugging Face model directory (model/) inside each checkpoint; <output_dir>/model/ is written at the end of every run
    export_critic: bool = False  # also export the critic (model/critic/: its backbone and value head), where there is one
    export_dtype: str | None = None  # float32 | bfloat16 | float16: the exported weights' dtype; None = float32, the trained weights' (a LoRA run's merged ones too; bf16 loses most of a small adapter's change: docs/training.md#your-trained-model)
    resume_from: str | None = None  # a checkpoint directory, or "auto" for the latest in output_dir
    max_bad_steps: int = 3  # stop after this many consecutive steps with a non-finite loss or gradient
    log_kl_panel: bool = True  # log kl/k1, kl/k2, kl/k3, kl/abs, kl/full, kl/full_forward every step (loads the reference even with no KL on)
    mixed_precision: str | None = None  # no | bf16 | fp16 (autocast); None = whatever `accelerate launch` says


@dataclass
class TaskConfig:
    name: str = "embedded"  # embedded (GSM8K-shaped problems and a tiny model built here, rlhf/embedded.py) | gsm8k (GSM8K from data.train_files / data.val_files) | <module>:<attribute>, a rlhf.tasks.Task of your own (the lab's: lab.tasks:bandit, lab.tasks:tree)
    options: dict = field(default_factory=dict)  # the task's own options, checked against its options dataclass (the embedded default's: docs/config.md#task-options)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    task: TaskConfig = field(default_factory=TaskConfig)


# ----------------------------------------------------------------------------- loading


def load_config(path: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults <- YAML file <- `key=value` overrides, then `validate`. Raises ConfigError."""
    raw: dict[str, Any] = {}
    if path is not None:
        if not os.path.isfile(path):
            raise ConfigError(f"config file {path!r} does not exist. Configs shipped: {_shipped_configs()}.")
        with open(path) as f:
            try:
                raw = yaml.safe_load(f) or {}
            except yaml.YAMLError as e:
                mark = getattr(e, "problem_mark", None)
                where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
                problem = getattr(e, "problem", None) or " ".join(str(e).split())
                raise ConfigError(f"config file {path!r} is not valid YAML{where}: {problem}.") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {path!r} must hold a mapping of sections, got {type(raw).__name__}.")
    cfg = _build(Config, raw, prefix="")
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. actor.kl_loss_type=k3+).")
        try:
            parsed = yaml.safe_load(value) if value.strip() else None
        except yaml.YAMLError:
            parsed = value  # not YAML (e.g. "[run"): kept as text, which the type check refuses for non-str keys
        set_value(cfg, key.strip(), parsed, text=value.strip())
    validate(cfg)
    return cfg


def set_value(cfg: Config, dotted_key: str, value: Any, text: str | None = None) -> None:
    """Set `a.b.c` on cfg with the same type checks as the YAML loader. `text` is the override as typed:
    a text field takes it as is where YAML would read a boolean (`trainer.mixed_precision=no`)."""
    *parents, name = dotted_key.split(".")
    node, prefix = cfg, ""
    if parents[:2] == ["task", "options"]:  # the task's own keys: checked against its options by validate
        options = cfg.task.options
        for part in parents[2:]:
            options = options.setdefault(part, {})
        options[name] = value
        return
    for part in parents:
        _check_key(node, part, prefix)
        node, prefix = getattr(node, part), f"{prefix}{part}."
        if not dataclasses.is_dataclass(node):
            raise ConfigError(f"unknown config key {dotted_key!r}: {prefix[:-1]!r} is a value, not a section.")
    _check_key(node, name, prefix)
    hint = typing.get_type_hints(type(node))[name]
    if text is not None and isinstance(value, bool) and str in (hint, *typing.get_args(hint)):
        value = text
    setattr(node, name, _coerce(value, hint, prefix + name))


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def from_dict(raw: dict[str, Any]) -> Config:
    """A Config from a mapping such as a run's saved config.yaml, with the loader's type checks but without
    `validate` (the files a finished run names may be gone)."""
    return _build(Config, raw, prefix="")


def _shipped_configs() -> str:
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
    names = sorted(f for f in os.listdir(here) if f.endswith(".yaml")) if os.path.isdir(here) else []
    return ", ".join(f"configs/{n}" for n in names) or "none"


def config_table(cls: type = None, prefix: str = "") -> str:
    """docs/config.md's table of config keys: `| key | default | meaning |`, from the dataclasses above (or the
    options dataclass `cls` of a task, under `prefix`, e.g. "task.options.") and the comment on each field's
    line (`python -c "from rlhf.config import config_table; print(config_table())"`)."""
    import inspect
    import re

    rows = ["| key | default | meaning |", "|---|---|---|"]

    def walk(cls: type, prefix: str) -> None:
        comments = dict(re.findall(r"^    (\w+):[^#\n]*#\s*(.*)$", inspect.getsource(cls), flags=re.M))
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            if dataclasses.is_dataclass(default):
                walk(type(default), f"{prefix}{f.name}.")
                continue
            shown = yaml.safe_dump(default, default_flow_style=True).strip().removesuffix("...").strip()
            meaning = comments.get(f.name, "").replace("|", "\\|")
            rows.append(f"| `{prefix}{f.name}` | `{shown}` | {meaning} |")

    walk(cls or Config, prefix)
    return "\n".join(rows)
