"""rlhf: a compact PPO-on-GSM8K example built around a KL-estimator module.

Modules: `kl` (estimators, exact KL, coefficient controllers), `core_algos` (masked ops, GAE,
PPO losses, loss aggregation, log-probs), `rewards.gsm8k` (the rule-based scorer), `data`
(GSM8K loading and the built-in generator), `models` (tiny tokenizer/model, critic, warm start),
`config` (the typed config schema).
"""
