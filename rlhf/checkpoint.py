"""Checkpoints: `accelerator.save_state` written atomically, the last N kept, the latest found.

A checkpoint is `<output_dir>/checkpoints/step_<k>/`. It is written to `step_<k>.tmp` and renamed only
when complete, so a run killed while saving never leaves a directory that resume would pick and then
fail on. Everything needed to continue exactly is inside: models, optimizers, RNG states (accelerate)
and the `TrainerState` registered for checkpointing (step, data position, KL coefficient, the count of
non-finite steps in a row, wandb id).

Also the two ways a run stops early and keeps its work: `StopOnSignal` (SIGTERM / Ctrl-C: finish the
step, checkpoint, exit) and `BadStepsError` (too many non-finite steps in a row, naming the checkpoint
to resume from).
"""

from __future__ import annotations

import ast
import contextlib
import json
import logging
import os
import re
import shutil
import signal
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import torch

from rlhf.errors import ConfigError
from rlhf.tracking import log_filter

if TYPE_CHECKING:  # annotations only
    from rlhf.config import Config

_STEP_DIR = re.compile(r"^step_(\d+)$")


@dataclass
class TrainerState:
    """The loop's own state; registered with `accelerator.register_for_checkpointing`."""

    step: int = 0
    prompt_order: dict = field(default_factory=dict)
    kl_ctrl: dict = field(default_factory=dict)
    bad_steps: int = 0
    wandb_run_id: str | None = None

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, "prompt_order" if key == "sampler" else key, value)  # "sampler": its earlier name


def checkpoint_root(output_dir: str) -> str:
    """`<output_dir>/checkpoints`, where every `step_<k>` directory lives."""
    return os.path.join(output_dir, "checkpoints")


def list_checkpoints(output_dir: str) -> list[str]:
    """Complete checkpoints, oldest first (temporary `.tmp` directories are ignored)."""
    root = checkpoint_root(output_dir)
    if not os.path.isdir(root):
        return []
    found = [(int(m.group(1)), name) for name in os.listdir(root) if (m := _STEP_DIR.match(name))]
    return [os.path.join(root, name) for _, name in sorted(found)]


def checkpoint_step(path: str) -> int:
    """`.../checkpoints/step_12` -> 12."""
    return int(_STEP_DIR.match(os.path.basename(os.path.normpath(path))).group(1))


def latest_checkpoint(output_dir: str) -> str | None:
    """The complete checkpoint of the highest step under `output_dir`, or None (what resume_from=auto takes)."""
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


RUN_INFO = "run_info.json"  # what a checkpoint holds, readable before accelerate loads it


def save_checkpoint(accelerator, output_dir: str, step: int, keep: int, info: dict | None = None) -> str:
    """Write `checkpoints/step_<step>` atomically on every process's behalf (with `info` as run_info.json);
    prune to `keep`."""
    final = os.path.join(checkpoint_root(output_dir), f"step_{step}")
    tmp = final + ".tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        with open(os.path.join(tmp, RUN_INFO), "w") as f:
            json.dump(info or {}, f)
    accelerator.wait_for_everyone()
    # accelerator._models: the prepared models save_state writes (accelerate has no public name for them)
    with tied_weights_stored_once([accelerator.unwrap_model(m) for m in accelerator._models]):
        accelerator.save_state(tmp)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in list_checkpoints(output_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def tied_parameter_names(models) -> set[str]:
    """Every name of a parameter that a model holds under more than one name (one nn.Parameter: the input
    embedding and a tied `lm_head.weight`, as `tie_word_embeddings` makes them)."""
    names = set()
    for model in models:
        by_parameter: dict[int, list[str]] = {}
        for name, parameter in model.named_parameters(remove_duplicate=False):
            by_parameter.setdefault(id(parameter), []).append(name)
        names.update(n for group in by_parameter.values() if len(group) > 1 for n in group)
    return names


class _TiedWeightsFilter(logging.Filter):
    """Drops accelerate's "Removed shared tensor {...} while saving" when every name removed is a tied
    parameter of the saved models; any other shared storage (say, a buffer that is a view of a weight, which
    loading would not restore) is still reported."""

    MESSAGE = re.compile(r"Removed shared tensor (\{.*?\}) while saving")

    def __init__(self, tied: set[str]):
        super().__init__()
        self.tied = tied

    def filter(self, record: logging.LogRecord) -> bool:
        found = self.MESSAGE.search(record.getMessage())
        if not found:
            return True
        try:
            removed = ast.literal_eval(found.group(1))
        except (ValueError, SyntaxError):
            return True
        return not (isinstance(removed, set) and removed <= self.tied)


@contextlib.contextmanager
def tied_weights_stored_once(models):
    """Silence the warning accelerate's safetensors save gives for tied embeddings, inside the block.

    safetensors refuses two names for one storage, so accelerate keeps the first name of each tied group
    (`model.embed_tokens.weight`) and warns that it removed the other (`lm_head.weight`) on every
    checkpoint. That is harmless here: the tie is one nn.Parameter of the model object, so loading the kept
    name fills both (tests/test_reliability.py: after a resume `lm_head.weight` is the embedding, with the
    saved values). The filter matches only that message and only those names."""
    # accelerate.utils.other: where clean_state_dict_for_safetensors logs
    with log_filter("accelerate.utils.other", _TiedWeightsFilter(tied_parameter_names(models))):
        yield


def adapters_only(accelerator) -> None:
    """Make a LoRA run's checkpoints hold what it trains, not the frozen base: save_state writes each model's
    trainable parameters only (the adapters, a critic's value head; rlhf.lora.adapter_names), with their optimizer
    states as always; load_state (which must then be called with strict=False) first checks that each saved model
    holds exactly those names, so that nothing trained is silently left unloaded. The base weights come from the
    model path at every start, as they did at the first."""
    from rlhf.lora import adapter_names

    def keep_trainable(models, weights, output_dir):
        for model, state in zip(models, weights):
            keep = adapter_names(model)
            for name in [n for n in state if n not in keep]:
                del state[name]

    def check_saved(models, input_dir):
        from safetensors import safe_open

        for i, model in enumerate(models):
            path = os.path.join(input_dir, "model.safetensors" if i == 0 else f"model_{i}.safetensors")
            with safe_open(path, "pt") as f:
                saved = set(f.keys())
            want = adapter_names(model)
            if saved != want:
                more = sorted(saved ^ want)[:3]
                raise ConfigError(f"checkpoint {input_dir} does not hold this LoRA run's trainable weights (model {i}: "
                                  f"{len(saved)} saved, {len(want)} trained; differing: {', '.join(more)}): it was "
                                  "written with other model.lora settings. Resume with the settings it was written "
                                  "with, or start fresh in another trainer.output_dir.")

    accelerator.register_save_state_pre_hook(keep_trainable)
    accelerator.register_load_state_pre_hook(check_saved)


def run_info(cfg: Config) -> dict:
    """What a checkpoint's run_info.json records of its run: the settings that decide which weights a run trains
    and what they compute, which a resume must share (check_resumable)."""
    lora = cfg.model.lora
    info = {"adv_estimator": cfg.algorithm.adv_estimator, "lora_rank": lora.rank}
    if lora.rank:
        info.update(lora_alpha=lora.alpha, lora_target_modules=sorted(lora.target_modules), lora_critic=lora.critic)
    return info


def check_resumable(path: str, cfg: Config) -> None:
    """Refuse, before accelerate tries to load it, a checkpoint written by a run whose run_info differs from this
    run's: another advantage estimator (a critic or not), another LoRA rank (0: full weights), alpha (the same
    adapters computing another policy), target modules or critic adapters; the message names each such key.
    Checkpoints without run_info.json pass; a key the checkpoint does not record is not compared."""
    info_path = os.path.join(path, RUN_INFO)
    if not os.path.exists(info_path):
        return
    with open(info_path) as f:
        saved = json.load(f)
    saved.setdefault("lora_rank", 0)
    differing = [(key, saved[key], value) for key, value in run_info(cfg).items()
                 if key in saved and saved[key] != value]
    if differing:
        keys = {"adv_estimator": "algorithm.adv_estimator", "lora_rank": "model.lora.rank",
                "lora_alpha": "model.lora.alpha", "lora_target_modules": "model.lora.target_modules",
                "lora_critic": "model.lora.critic"}
        said = "; ".join(f"{keys[key]}={old} there, {keys[key]}={new} here" for key, old, new in differing)
        raise ConfigError(f"checkpoint {path} was written by a run with other settings ({said}): a run resumes only "
                          "with the weights it trains and the settings they were trained with. Set them as the "
                          "checkpoint has them, or start fresh in another trainer.output_dir.")


class StopOnSignal:
    """SIGTERM / Ctrl-C: finish the step, checkpoint, exit cleanly; a second one stops at once."""

    def __init__(self):
        self.signal: str | None = None

    def __enter__(self):
        self.previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}
        return self

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, _frame):
        if self.signal:  # the second one: stop now, without a checkpoint
            raise KeyboardInterrupt
        self.signal = signal.Signals(signum).name
        print(f"{self.signal} received: finishing this step, then saving a checkpoint "
              "(send it again to stop at once).", flush=True)

    def requested(self, accelerator) -> bool:
        """True on every process if any of them got a signal, so that all stop after the same step."""
        flag = torch.tensor([float(self.signal is not None)], device=accelerator.device)
        return accelerator.reduce(flag, "sum").item() > 0


class BadStepsError(RuntimeError):
    """trainer.max_bad_steps steps in a row had a non-finite loss or gradient."""


def bad_steps_message(cfg: Config, first_bad: int, step: int) -> str:
    """What went wrong and how to resume from the last checkpoint before the bad steps."""
    out_dir = cfg.trainer.output_dir
    before = [c for c in list_checkpoints(out_dir) if checkpoint_step(c) < first_bad]
    where = (f"The latest checkpoint from before them is {before[-1]}; resume from it with a lower actor.lr / "
             f"critic.lr or grad_clip: python train.py ... trainer.output_dir={out_dir} trainer.resume_from=auto"
             if before else f"No checkpoint was saved before them (trainer.save_freq={cfg.trainer.save_freq}).")
    return (f"steps {first_bad}..{step} all had a non-finite loss or gradient (trainer.max_bad_steps="
            f"{cfg.trainer.max_bad_steps}); stopping. Their non-finite updates were skipped, so no NaN or inf "
            f"reached the weights. {where}")
