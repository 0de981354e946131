"""Metrics: one JSON object per step in `<output_dir>/metrics.jsonl`, and wandb through accelerate.

wandb is a convenience, never a requirement: with no credentials it runs offline without prompting
(and we print how to `wandb sync`); if it is not installed or fails to start, training goes on with
`metrics.jsonl` alone after one warning.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import netrc
import os
import time
import warnings
from collections import defaultdict
from typing import Any


def has_wandb_credentials() -> bool:
    """Whether wandb could log in without asking: WANDB_API_KEY, or an api.wandb.ai entry in ~/.netrc."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def wandb_available() -> bool:
    """Whether `import wandb` works."""
    try:
        import wandb  # noqa: F401
    except Exception:  # a broken install is as good as none
        return False
    return True


def choose_wandb_mode() -> str:
    """Honour WANDB_MODE; otherwise online with credentials and offline without (never prompt)."""
    return os.environ.get("WANDB_MODE") or ("online" if has_wandb_credentials() else "offline")


@contextlib.contextmanager
def log_filter(logger_name: str, record_filter: logging.Filter):
    """Within the block, `record_filter` decides which records of the logger `logger_name` get through (a
    library's warning we have checked ourselves; rlhf.models, rlhf.checkpoint)."""
    logger = logging.getLogger(logger_name)
    logger.addFilter(record_filter)
    try:
        yield
    finally:
        logger.removeFilter(record_filter)


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl, one dict per logged step (blank lines skipped)."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def truncate_metrics(path: str, last_step: int) -> None:
    """Drop rows after `last_step` (written after the checkpoint we resume from), so no step repeats.

    A line that does not parse is the torn end of a run killed mid-write, and is dropped too.
    """
    if not os.path.exists(path):
        return
    rows = []
    with open(path) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    rows = [r for r in rows if r["step"] <= last_step]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    os.replace(tmp, path)


SAMPLES_FILE = "samples.jsonl"  # under the output directory: the rows MetricsLogger.log_samples writes (rlhf.samples)

class MetricsLogger:
    """`log(metrics, step)` appends to metrics.jsonl (main process only) and calls accelerator.log."""

    def __init__(self, accelerator, output_dir: str, use_wandb: bool):
        self.accelerator = accelerator
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self.samples_path = os.path.join(output_dir, SAMPLES_FILE)
        self.use_wandb = use_wandb
        self.wandb_run_id: str | None = None
        self.wandb_where = "off (trainer.logger=none, or wandb did not start)"  # for the run's summary

    def start(self, project: str, config: dict, run_name: str, group: str | None, tags: list[str],
              output_dir: str, resume_run_id: str | None = None) -> None:
        """Start the wandb run on the main process (continuing `resume_run_id` if given); if wandb fails to
        start, warn and go on with metrics.jsonl alone."""
        if not self.use_wandb or not self.accelerator.is_main_process:
            return
        mode = choose_wandb_mode()
        init_kwargs = dict(name=run_name, group=group, tags=tags, dir=output_dir, mode=mode)
        if resume_run_id:
            init_kwargs.update(id=resume_run_id, resume="allow")
        try:
            self.accelerator.init_trackers(project, config=config, init_kwargs={"wandb": init_kwargs})
            run = self.accelerator.get_tracker("wandb", unwrap=True)
            self.wandb_run_id = run.id
        except Exception as e:  # no disk space, bad settings, service down: keep training
            warnings.warn(f"wandb could not start ({type(e).__name__}: {e}); logging to {self.path} only.")
            self.use_wandb = False
            self.accelerator.trackers = []
            return
        self.wandb_where = (f"offline, in {os.path.dirname(run.dir)}; upload it with: wandb sync "
                            f"{os.path.dirname(run.dir)}" if mode == "offline" else f"{run.url}")
        if mode == "offline":
            print(f"wandb is offline (no credentials or WANDB_MODE=offline); the run is in {run.dir}.\n"
                  f"Upload it later with: wandb sync {os.path.dirname(run.dir)}")

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Append `{"step": step, **metrics}` to metrics.jsonl (non-finite values as null), then log to wandb;
        main process only."""
        if not self.accelerator.is_main_process:
            return
        row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.use_wandb:
            try:
                self.accelerator.log(metrics, step=step)
            except Exception as e:
                warnings.warn(f"wandb logging failed ({type(e).__name__}: {e}); continuing with {self.path} only.")
                self.use_wandb = False

    def log_samples(self, split: str, rows: list[dict] | None, step: int) -> None:
        """Append `rows` (rlhf.samples.sample_rows) to samples.jsonl as {"step", "split", **row}, and log them to
        wandb as the table samples/<split> ("train" or "val"); main process only."""
        if not rows or not self.accelerator.is_main_process:
            return
        with open(self.samples_path, "a") as f:
            f.writelines(json.dumps({"step": step, "split": split, **row}, ensure_ascii=False) + "\n" for row in rows)
        if self.use_wandb:
            try:
                import wandb

                table = wandb.Table(columns=["step", *rows[0]], data=[[step, *row.values()] for row in rows])
                self.accelerator.log({f"samples/{split}": table}, step=step)
            except Exception as e:
                warnings.warn(f"wandb could not log the samples ({type(e).__name__}: {e}); they are in {self.samples_path}.")

    def finish(self) -> None:
        """End the wandb run (main process) and the processes' group (accelerator.end_training): call it on
        every process, after their last collective operation."""
        try:
            self.accelerator.end_training()
        except Exception as e:
            warnings.warn(f"the run did not close cleanly ({type(e).__name__}: {e}).")


# ----------------------------------------------------------------------------- what a run prints

# An evaluation's line and the summary's table: these keys, in this order, where logged (val/pass@1 is the
# sampled accuracy; the habit is the embedded default's, lab/habit.py).
SHOWN = ("val/accuracy", "val/greedy_strict_accuracy", "val/greedy_flexible_accuracy", "val/greedy_no_answer_rate",
         "val/greedy_clip_ratio", "val/pass@1", "val/maj@", "val/greedy_habit_rate", "val/habit_rate",
         "theory/tv_to_fixed_point")


def _shown(metrics: dict[str, Any]) -> list[str]:
    return [key for prefix in SHOWN for key in sorted(metrics) if key.startswith(prefix)]


def eval_line(step: int, metrics: dict[str, Any]) -> str:
    """`step 10: val/accuracy 0.473, val/greedy_habit_rate 0.121, kl/full 0.019`: an evaluation, one line."""
    parts = [f"{key} {metrics[key]:.3f}" for key in _shown(metrics) if metrics[key] is not None]
    if metrics.get("kl/full") is not None:
        parts.append(f"kl/full {metrics['kl/full']:.4f}")
    return f"step {step}: " + ", ".join(parts)


def run_summary(rows: list[dict[str, Any]], seconds: float, where: dict[str, str]) -> str:
    """The end of a run: its first and last evaluation side by side, the last step's exact KL, then `where`
    ({what: path or command}, e.g. metrics, wandb, checkpoint, model, evaluate), one line each."""
    evals = [row for row in rows if "val/accuracy" in row]
    first, last = (evals[0], evals[-1]) if evals else ({}, {})
    minutes, secs = divmod(round(seconds), 60)
    lines = [f"done: step {rows[-1]['step'] if rows else 0} in {minutes} min {secs:02d} s"]
    if evals:
        keys = _shown(last)
        width = max(len(k) for k in [*keys, "kl/full (last step)"])
        lines.append(f"  {'':<{width}}  {'step ' + str(first['step']):>10}  {'step ' + str(last['step']):>10}")
        for key in keys:
            before = first.get(key)
            lines.append(f"  {key:<{width}}  {'' if before is None else format(before, '.3f'):>10}  "
                         f"{last[key]:>10.3f}")
    kl = next((row["kl/full"] for row in reversed(rows) if row.get("kl/full") is not None), None)
    if kl is not None:
        lines.append(f"  {'kl/full (last step)':<{width if evals else 0}}  {'':>10}  {kl:>10.4f}")
    label = max(len(k) for k in where) if where else 0
    lines += [f"{what + ':':<{label + 1}} {text}" for what, text in where.items()]
    return "\n".join(lines)


class Symptoms:
    """Problems a run sees in its own metrics, each warned about once, naming the page that explains it:
    every group of responses scoring the same for `equal_steps` steps in a row (critic/groups_with_equal_scores
    = 1: group-relative advantages are all 0, nothing is learned), and strict accuracy 0 while flexible is not
    (the model answers, but not on the `#### N` line the strict rule reads: format, not maths)."""

    PAGE = "docs/troubleshooting.md"

    def __init__(self, equal_steps: int = 5):
        self.equal_steps, self.streak, self.warned = equal_steps, 0, set()

    def check(self, step: int, metrics: dict[str, Any]) -> list[str]:
        """The warnings step `step`'s metrics raise for the first time."""
        out = []
        self.streak = self.streak + 1 if metrics.get("critic/groups_with_equal_scores") == 1.0 else 0
        if self.streak >= self.equal_steps and "equal" not in self.warned:
            self.warned.add("equal")
            out.append(f"steps {step - self.streak + 1}-{step}: every group of rollout.n responses scored the same "
                       "(critic/groups_with_equal_scores = 1), so their advantages are 0 and the actor does not "
                       f"learn; see {self.PAGE}#every-group-scores-the-same")
        strict, flexible = metrics.get("val/greedy_strict_accuracy"), metrics.get("val/greedy_flexible_accuracy")
        if strict == 0 and flexible and "format" not in self.warned:
            self.warned.add("format")
            out.append(f"step {step}: val/greedy_strict_accuracy is 0 while val/greedy_flexible_accuracy is "
                       f"{flexible:.3f}: the model finds answers but does not end with the '#### N' line the strict "
                       f"rule reads (format, not maths); see {self.PAGE}#the-reward-is-0-at-step-0")
        return out


def _plain(value: Any) -> Any:
    value = float(value) if not isinstance(value, (int, str)) else value
    return None if isinstance(value, float) and not math.isfinite(value) else value


class Timer:
    """Accumulates wall time per phase: `with timer("gen"): ...`; `timer.metrics()` -> timing_s/*."""

    def __init__(self):
        self.seconds = defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        yield
        self.seconds[name] += time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"timing_s/{k}": v for k, v in self.seconds.items()}


class Float32LogitsWatch:
    """While active (`with watch:`), records the largest float32 tensor whose last dim is `vocab_size` among
    the outputs of every op, forward and backward, as its number of rows (numel / vocab_size), its shape and
    the op. How tests/test_train.py and bench/rehearse_gpu_recipe.py check that no float32 copy of a
    (B, T, V) logits tensor is made where the code says it is not (rlhf.core_algos.LOGITS_CHUNK_ROWS)."""

    def __init__(self, vocab_size: int):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        self.rows, self.shape, self.op = 0, None, None
        watch = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_leaves(out):
                    if (isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.dim() >= 2
                            and t.shape[-1] == vocab_size and t.numel() // vocab_size > watch.rows):
                        watch.rows, watch.shape, watch.op = t.numel() // vocab_size, list(t.shape), str(func)
                return out

        self._mode = Mode()

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)
