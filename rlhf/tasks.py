"""Tasks: where a run's problems, model, held-out metrics and per-step metrics come from.

    task = get_task(cfg.task.name)       # "embedded", "gsm8k", or "<module>:<attribute>" (lab.tasks:bandit)
    task.check(cfg)                      # by rlhf.config.validate, before anything loads (ValueError)
    data = task.load(cfg, accelerator)   # TaskData: tokenizer, train and held-out prompt rows, model path

A task is a `Task`: it overrides what it needs. The trainer knows nothing else about it, so a task of your own
(or the lab's synthetic ones) plugs in by naming it in the config, `task.name=my_module:my_task`, with its
options under `task.options` (checked against the task's `options` dataclass, as the rest of the config).
Built in: `embedded` (the GSM8K-shaped problems and the tiny model this project builds, rlhf/embedded.py) and
`gsm8k` (GSM8K from the hub or local files, data.train_files / data.val_files).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rlhf import embedded
from rlhf.errors import ConfigError
from rlhf.schema import build

# A held-out metric: (the responses' texts, their held-out row indices) -> one value per response.
ResponseMetric = Callable[[Sequence[str], Sequence[int]], Sequence[float]]


@dataclass
class TaskData:
    """What a task loads for a run: the tokenizer, the prompt rows (datasets.Dataset with input_ids, the task's
    prompt fields and, optionally, prompt: their text, which the reward function receives) and the directory or
    hub name the actor, critic and reference load from."""

    tokenizer: object
    train_set: object
    val_set: object
    model_path: str


class Task:
    """The interface; every method has a default but `load`."""

    name = "task"
    options: type | None = None  # the dataclass of `task.options`; None: the task takes none
    prompt_fields: tuple[str, ...] = ("ground_truth",)  # the prompt rows' columns the reward function receives
    has_held_out = True  # whether `python -m rlhf.evaluate` can evaluate on its held-out rows

    def check(self, cfg) -> None:
        """Raise ValueError for a config this task cannot run (called before anything loads)."""

    def load(self, cfg, accelerator) -> TaskData:
        raise NotImplementedError

    def val_metrics(self, cfg, val_set) -> dict[str, ResponseMetric]:
        """The task's own metrics of held-out responses, logged as val/<name> (sampled) and val/greedy_<name>."""
        return {}

    def step_metrics(self, cfg, accelerator, run):
        """An object with `metrics(actor) -> dict` (logged at step 0 and every step) and `finish(output_dir,
        actor)` (at the end), or None. Built once, before any checkpoint loads: `run.models[0]` is the start."""
        return None

    def base_model(self, cfg, output_dir: str) -> str:
        """The directory or hub name the run's actor started from (rlhf.export): model.path by default."""
        return cfg.model.path

    def load_tokenizer(self, path: str):
        from rlhf.models import load_tokenizer

        return load_tokenizer(path)


class GSM8KTask(Task):
    """GSM8K-schema problems (question, answer ending in `#### N`) from data.train_files and data.val_files: a
    hub dataset (openai/gsm8k) or local .jsonl/.json/.parquet files; "embedded" names the embedded default's
    files, and model.path "embedded" its model (built with its default options)."""

    name = "gsm8k"

    def check(self, cfg) -> None:
        from rlhf.data import check_data_file, looks_like_path

        for key, source in (("data.train_files", cfg.data.train_files), ("data.val_files", cfg.data.val_files)):
            if source != "embedded" and looks_like_path(source):
                try:
                    check_data_file(source, (cfg.data.question_key, cfg.data.answer_key))
                except ValueError as e:
                    raise ConfigError(f"config key {key!r}: {e}") from None

    def load(self, cfg, accelerator) -> TaskData:
        from rlhf.data import load_held_out, load_prompts
        from rlhf.models import load_tokenizer

        model_path, train_source, val_source = cfg.model.path, cfg.data.train_files, cfg.data.val_files
        if "embedded" in (model_path, train_source, val_source):
            with accelerator.main_process_first():  # rank 0 builds the cache; the others then read it
                artifacts = embedded.prepare_embedded_default(embedded.embedded_cache_dir(cfg),
                                                              embedded.embedded_options(cfg), log=accelerator.print)
            model_path = artifacts.model_dir if model_path == "embedded" else model_path
            train_source = artifacts.train_file if train_source == "embedded" else train_source
            val_source = artifacts.val_file if val_source == "embedded" else val_source
        tokenizer = load_tokenizer(model_path)
        train_set, dropped_train = load_prompts(cfg, tokenizer, train_source, cfg.data.train_split)
        val_set, dropped_val = load_held_out(cfg, tokenizer, val_source)
        if dropped_train or dropped_val:
            accelerator.print(f"filtered prompts longer than data.max_prompt_length={cfg.data.max_prompt_length}: "
                              f"{dropped_train} train, {dropped_val} held-out")
        return TaskData(tokenizer, train_set, val_set, model_path)

    def val_metrics(self, cfg, val_set) -> dict[str, ResponseMetric]:
        """GSM8K's two rules side by side and the share without an answer line (rlhf.rewards.gsm8k.answer_metrics),
        whatever the run's reward."""
        from rlhf.rewards.gsm8k import answer_metrics

        return answer_metrics(val_set["ground_truth"])

    def base_model(self, cfg, output_dir: str) -> str:
        if cfg.model.path != "embedded":
            return cfg.model.path
        cache_dir = cfg.trainer.cache_dir or os.path.join(output_dir, "embedded")
        return os.path.join(embedded.cache_entry(cache_dir, embedded.embedded_options(cfg)), "model")


class EmbeddedTask(GSM8KTask):
    """The embedded default (rlhf/embedded.py): GSM8K-shaped problems and a tiny warm-started model built on
    the machine, options `rlhf.embedded.EmbeddedConfig`; held-out metric `habit_rate` (its planted habit)."""

    name = "embedded"
    options = embedded.EmbeddedConfig

    def val_metrics(self, cfg, val_set) -> dict[str, ResponseMetric]:
        metrics = super().val_metrics(cfg, val_set)
        if cfg.data.val_files != "embedded":
            return metrics
        answers = embedded.held_out_problems(cfg)[1]["answer"]  # the cache is built by now
        if len(answers) != len(val_set):  # prompts filtered by length: rows would not line up with answers
            raise ValueError(f"{len(answers) - len(val_set)} held-out prompts are longer than "
                             f"data.max_prompt_length={cfg.data.max_prompt_length}; the habit metric needs every "
                             "embedded problem")
        return {**metrics, "habit_rate": embedded.habit_metric(answers, cfg.data.reward_method)}


BUILT_IN = {"embedded": EmbeddedTask(), "gsm8k": GSM8KTask()}


def get_task(name: str) -> Task:
    """The task `name` names: a built-in one, or the Task object at `<module>:<attribute>`. ValueError (naming
    the valid choices) for anything else."""
    if name in BUILT_IN:
        return BUILT_IN[name]
    choices = f"valid: {', '.join(BUILT_IN)}, or '<module>:<attribute>' naming a rlhf.tasks.Task (lab.tasks:bandit)"
    module_name, sep, attribute = name.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"unknown task {name!r}; {choices}")
    try:
        task = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"task {name!r} does not import ({type(e).__name__}: {e}); {choices}") from None
    if not isinstance(task, Task):
        raise ValueError(f"task {name!r} is a {type(task).__name__}, not a rlhf.tasks.Task")
    return task


def task_options(cfg):
    """The run's `task.options` as its task's options dataclass (defaults for what the config leaves out);
    None for a task without options. ConfigError for an unknown key or a wrong type."""
    task = get_task(cfg.task.name)
    if task.options is None:
        if cfg.task.options:
            raise ConfigError(f"task {cfg.task.name!r} takes no options; got task.options={cfg.task.options!r}")
        return None
    return build(task.options, cfg.task.options, prefix="task.options.")
