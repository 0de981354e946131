"""rlhf: the trainer's package, what a GSM8K run needs; train.py is the run. It never imports the lab (lab/).

The step: `step` (one PPO step top to bottom: rollout, score, KL, advantages, PPO epochs, metrics), `rollout`
(the decoding loop and the `Sequences` it returns), `kl` (the estimators, the `+` suffix, the exact KL, the
coefficient controllers), `core_algos` (masked ops, token rewards, GAE, GRPO/RLOO, PPO losses, loss aggregation,
log-probs), `processes` (reductions over processes, each one's share, the backward and the optimizer steps).
Around it: `tasks` (the task interface and the built-in tasks, embedded and gsm8k), `data` (GSM8K loading and
prompts), `embedded` (the embedded default: problems, tokenizer, tiny model, warm start, its habit metric),
`rewards` (the pluggable reward and GSM8K's rule), `config`, `schema`, `config_checks` (the typed config, its
loader, its value checks), `setup` (building a run), `models`, `prompt_order`, `registry`, `errors`, `checkpoint`
(atomic checkpoints, stopping), `tracking` (metrics.jsonl, wandb, timing, the run's summary), `samples` (the
sample rows a run logs), `held_out` (greedy accuracy, pass@k, maj@k on the held-out problems), `evaluate` and
`export` (python -m rlhf.evaluate, python -m rlhf.export), `stats` (a mean over seeds or problems and its
Student t interval).
"""
