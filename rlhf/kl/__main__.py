"""`python -m rlhf.kl`: the exact estimator report of `rlhf.kl.theory` (docs/kl.md's examples A, B and C).

A separate module so that `rlhf.kl` never imports `rlhf.kl.theory`, which imports it."""

from rlhf.kl.theory import report

print(report())
