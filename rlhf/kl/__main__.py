"""`python -m rlhf.kl`: the exact estimator report of `rlhf.kl_theory` (docs/kl.md's examples A, B and C).

A separate module so that `rlhf.kl` never imports `rlhf.kl_theory`, which imports it."""

from rlhf.kl_theory import report

print(report())
