"""Checkpoints: `accelerator.save_state` written atomically, the last N kept, the latest found.

A checkpoint is `<output_dir>/checkpoints/step_<k>/`. It is written to `step_<k>.tmp` and renamed only
when complete, so a run killed while saving never leaves a directory that resume would pick and then
fail on. Everything needed to continue exactly is inside: models, optimizers, RNG states (accelerate)
and the `TrainerState` registered for checkpointing (step, data position, KL coefficient, wandb id).
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import asdict, dataclass, field

_STEP_DIR = re.compile(r"^step_(\d+)$")


@dataclass
class TrainerState:
    """The loop's own state; registered with `accelerator.register_for_checkpointing`."""

    step: int = 0
    sampler: dict = field(default_factory=dict)
    kl_ctrl: dict = field(default_factory=dict)
    bad_steps: int = 0
    wandb_run_id: str | None = None

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


def checkpoint_root(output_dir: str) -> str:
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
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


def save_checkpoint(accelerator, output_dir: str, step: int, keep: int) -> str:
    """Write `checkpoints/step_<step>` atomically on every process's behalf; prune to `keep`."""
    final = os.path.join(checkpoint_root(output_dir), f"step_{step}")
    tmp = final + ".tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    accelerator.wait_for_everyone()
    accelerator.save_state(tmp)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in list_checkpoints(output_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final
