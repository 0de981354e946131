"""rlhf: a compact PPO-on-GSM8K example built around a KL-estimator module.

Modules: `kl` (estimators, the `+` suffix, off-policy weighting, exact KL, coefficient controllers;
`python -m rlhf.kl` prints the report of `kl_theory`, exact expectations by enumeration), `ppo` (the
glue of one PPO step), `core_algos` (masked ops, GAE, PPO losses, loss aggregation, log-probs),
`rollout` (the decoding loop and the step's forward passes), `rewards.gsm8k` (the rule-based scorer),
`data` (GSM8K loading and prompts), `sampler` (the order of training prompts), `models` (loading policy,
reference and critic), `embedded` (the embedded default's data, tokenizer, tiny model and warm start),
`config` (the typed config schema), `setup` (building a run), `checkpoint` (atomic checkpoints, stopping), `tracking`
(metrics.jsonl, wandb, timing), `compare` (the estimator grid and its report), `habit` (the planted
habit's report).
"""
