"""`python -m lab.theory`: the exact estimator report (expectations.py: docs/kl.md's examples A, B and C), then
where each estimator x placement converges and how the trainer's advantage estimators move that
(fixed_point_tables.py), then what the big frameworks' default KL settings give (peers.py)."""

from lab.theory.expectations import report
from lab.theory.fixed_point_tables import advantage_report, fixed_point_report
from lab.theory.peers import peer_report

print(report())
print("\nWhere each estimator x placement converges (docs/kl.md, 'Where each estimator converges')\n")
print(fixed_point_report())
print("\nWhere the advantage estimator moves the fixed point (docs/kl.md, 'Where the advantage estimator moves the "
      "fixed point')\n")
print(advantage_report())
print("\nWhat the frameworks' default KL settings give (docs/kl.md, 'What the frameworks' defaults give')\n")
print(peer_report())
