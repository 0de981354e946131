"""The exact analysis of the KL estimators: every expectation a sum over a small vocabulary, no sampling.

- expectations.py: each estimator's exact mean, std and expected loss/reward gradient, on- and off-policy, on
  docs/kl.md's examples A, B and C, and the estimator table (`report`);
- fixed_points.py: where training by exact expected gradients converges, for each estimator x placement, on a
  bandit and a two-token tree (`bandit_fixed_point`, `tree_fixed_point`);
- advantage_models.py: the trainer's advantage estimators (rloo, grpo, drgrpo, gae) in expectation, for the
  solver;
- optima.py: the analytic optima the fixed points are compared with, and which one each setting reaches;
- examples.py: the bandit and tree examples of the fixed-point tables (the synthetic tree task uses the tree);
- fixed_point_tables.py: the fixed-point and advantage-estimator tables;
- peers.py: what the big frameworks' default KL settings give, and their table.

`python -m lab.theory` prints the tables docs/kl.md quotes. The trainer imports this package only for the
synthetic tasks (lab/landing.py, lab/synthetic.py); the KL module itself is rlhf.kl. The expectations and the
two solvers are re-exported here: `from lab import theory; theory.expected_loss_grad(...)`.
"""

from lab.theory.expectations import (
    EXAMPLES,
    OFF_POLICY_EXAMPLES,
    REPORT_ESTIMATORS,
    divergence_grad,
    estimator_std,
    example,
    expected_loss_grad,
    expected_off_policy_loss_grad,
    expected_off_policy_value,
    expected_reward_grad,
    expected_value,
    forward_kl,
    off_policy_example,
    report,
    reverse_kl,
    total_variation,
)
from lab.theory.fixed_points import bandit_fixed_point, tree_fixed_point
