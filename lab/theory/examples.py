"""The worked examples of docs/kl.md's fixed-point tables: a bandit, a two-token tree and a six-armed bandit.

The tables (fixed_point_tables.py), the tests and the synthetic tree task (lab/synthetic.py) share them.
"""

import torch

# The highest reward on the least likely arm, so that the optima differ visibly.
BANDIT_EXAMPLE = {"ref_probs": (0.4, 0.3, 0.2, 0.1), "rewards": (0.0, 0.3, 0.6, 1.0), "beta": 0.25}
# After prefix 0, R = 2 needs a token the reference gives 1%; prefix 1 earns about 0.6 whatever follows.
TREE_EXAMPLE = {
    "ref_first": (0.4, 0.35, 0.25),
    "ref_second": ((0.01, 0.59, 0.4), (0.3, 0.4, 0.3), (0.5, 0.3, 0.2)),
    "rewards": ((2.0, 0.0, 0.1), (0.5, 0.6, 0.7), (0.0, 0.2, 0.4)),
    "beta": 0.5,
}

# Six arms, the best reward on the least likely one, for the advantage estimators' table; binary_rewards is the
# same bandit with a 0/1 reward (1 on arms 2, 4 and 5, a third of ref's mass).
BANDIT6_EXAMPLE = {
    "ref_probs": (0.3, 0.25, 0.18, 0.12, 0.1, 0.05),
    "rewards": (0.2, 0.0, 0.5, 0.4, 0.7, 1.0),
    "binary_rewards": (0.0, 0.0, 1.0, 0.0, 1.0, 1.0),
    "beta": 0.3,
}


def example(example: dict) -> dict:
    """BANDIT_EXAMPLE, TREE_EXAMPLE or BANDIT6_EXAMPLE with float64 tensors for its tuples."""
    return {k: v if isinstance(v, float) else torch.tensor(v, dtype=torch.float64) for k, v in example.items()}
