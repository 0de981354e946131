"""The lab's tasks for the trainer: the bandit and the tree of lab.synthetic, with lab.landing's exact theory/*
metrics every step, plugged in through rlhf.tasks' interface.

    python train.py --config configs/bandit.yaml     # task.name: lab.tasks:bandit
    python train.py --config configs/tree.yaml       # task.name: lab.tasks:tree
"""

from __future__ import annotations

import os

from lab import landing, synthetic
from rlhf.tasks import Task, TaskData, task_options


class SyntheticTask(Task):
    """The bandit or the tree (lab.synthetic) as a task of the trainer (`task.name: lab.tasks:bandit`): it builds its own
    tokenizer, model (cached under trainer.cache_dir) and prompt rows, carries the reward table as a prompt
    field, and logs where the run stands against the theory every step (lab.landing)."""

    options = synthetic.SyntheticConfig
    prompt_fields = ("ground_truth", "rewards")
    has_held_out = False

    def __init__(self, kind: str):
        self.synthetic_kind, self.name = kind, f"{__name__}:{kind}"

    def check(self, cfg) -> None:
        synthetic.check_config(cfg)

    def cache_dir(self, cfg, output_dir: str) -> str:
        return cfg.trainer.cache_dir or os.path.join(output_dir, "synthetic")

    def load(self, cfg, accelerator) -> TaskData:
        options = task_options(cfg)
        with accelerator.main_process_first():
            model_dir = synthetic.prepare_synthetic(self.cache_dir(cfg, cfg.trainer.output_dir), self.synthetic_kind, options,
                                          log=accelerator.print)
        tokenizer = synthetic.load_tokenizer(model_dir)
        return TaskData(tokenizer, *synthetic.build_datasets(self.synthetic_kind, options, tokenizer), model_dir)

    def step_metrics(self, cfg, accelerator, run):
        return landing.start_landing(cfg, accelerator, run)

    def base_model(self, cfg, output_dir: str) -> str:
        return os.path.join(synthetic.cache_entry(self.cache_dir(cfg, output_dir), self.synthetic_kind, task_options(cfg)), "model")

    def load_tokenizer(self, path: str):
        return synthetic.load_tokenizer(path)


bandit = SyntheticTask("bandit")
tree = SyntheticTask("tree")
