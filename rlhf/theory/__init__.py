"""Exact expectations of the KL estimators by enumeration: the public name of `rlhf.kl.theory`.

Docs, tests and the notebook call `rlhf.kl_theory.report`, `rlhf.kl_theory.expected_loss_grad`, ...; the
code lives in rlhf/kl/theory.py (its docstring says what each function computes) and this module re-exports
its public names.
"""

from rlhf.kl.fixed_points import bandit_fixed_point, tree_fixed_point
from rlhf.kl.theory import (
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

