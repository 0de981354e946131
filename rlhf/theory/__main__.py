"""`python -m rlhf.kl`: the exact estimator report of `rlhf.kl.theory` (docs/kl.md's examples A, B and C),
then where each estimator x placement converges (`rlhf.kl.fixed_points`) and how the trainer's advantage
estimators move that, then what the big frameworks' default KL settings give (`rlhf.kl.peers`).

A separate module so that `rlhf.kl` never imports `rlhf.kl.theory`, which imports it."""

from rlhf.kl.fixed_points import advantage_report, fixed_point_report
from rlhf.kl.peers import peer_report
from rlhf.kl.theory import report

print(report())
print("\nWhere each estimator x placement converges (docs/kl.md, 'Where each estimator converges')\n")
print(fixed_point_report())
print("\nWhere the advantage estimator moves the fixed point (docs/kl.md, 'Where the advantage estimator moves the "
      "fixed point')\n")
print(advantage_report())
print("\nWhat the frameworks' default KL settings give (docs/kl.md, 'What the frameworks' defaults give')\n")
print(peer_report())
