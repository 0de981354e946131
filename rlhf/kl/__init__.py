"""KL estimators, the exact KL from logits, and the KL-coefficient controllers.

Per token, with `d = logprob - ref_logprob` (log pi(x) - log pi_ref(x), x sampled from pi), each estimator
targets the reverse KL(pi || pi_ref) = E_{x~pi}[d]. Names are verl's, which users already type:

| name(s)            | value                      | E[value] - KL       | d/d(lp)     | E[loss gradient]   | rho        |
|--------------------|----------------------------|---------------------|-------------|--------------------|------------|
| `k1`, `kl`         | d                          | 0                   | 1           | 0 (use in reward)  | in graph   |
| `k2`, `mse`        | d^2 / 2                    | 3rd order, any sign | d           | grad KL(pi || ref) | detached   |
| `k3`, `low_var_kl` | exp(-d) - 1 + d            | 0 (unless clamped)  | 1 - exp(-d) | grad KL(ref || pi) | as `k3+`   |
| `abs`              | abs(d)                     | >= 0                | sign(d)     | 2 grad TV(pi, ref) | detached   |
| `X+` (any above)   | X's value                  | X's bias            | d (k2's)    | grad KL(pi || ref) | detached   |
| `full` (full_kl)   | sum_v pi_v log(pi_v/ref_v) | none (uses logits)  | exact       | grad KL(pi || ref) | none       |

`E[loss gradient]` is on-policy; `rho` is how kl_penalty weights the term off-policy (below; `full` sums
over the vocabulary, so it needs no weight). k3's value is clamped to 10 where d < -2.61087 or d > 10.99998
(verl's clamp, K3_CLAMP_EDGES): there the value is flat, so a sample past an edge adds nothing to k3's loss
gradient (its logit still moves, through the softmax, with the other samples' terms), and in the reward its
value is the constant 10. k3 is unbiased only where pi's support holds all of ref's
mass (not under top-k/top-p sampling).

In the reward (detached log-probs) `X+` is the same as `X`; only k1 there gives grad KL(pi || ref). `full` in
the reward is the same number for every token of a state, so it moves no token at its own state: it reaches
earlier tokens only through the return.

Off-policy (PPO after the first optimizer step: x ~ pi_old, not pi), `kl_penalty(..., old_logprob=...)`
returns rho * X in value, rho = pi(x) / pi_old(x), with a gradient whose mean over x ~ pi_old is grad KL(pi ||
ref) at every d, for every estimator but abs (off_policy_rule), while rho's own exponent clamp leaves it exact
(|log pi - log pi_old| <= 20):
- rho in the graph for k1 (unbiased, unclamped): E_old[rho X] = KL(pi || ref) as a function of theta, so its
  gradient is exact. Not a no-op at rho = 1: the gradient gains X * grad log pi, which turns k1's 0 into
  grad KL(pi || ref).
- as `k3+` for k3: rho k3 in the graph would have the gradient rho (k3 + k3') grad log pi = rho d grad log pi,
  k2's (DeepSeek-V3.2's unbiased KL, report section 3.1), wherever k3 is not clamped; past an edge autograd
  would give rho * 10 instead, which pushes a token pi gives far less than ref further down. So the value is
  rho k3 and the gradient sg(rho) d grad log pi at every d: the same inside the clamp, right past it.
- rho detached for k2 and every `X+`: E_old[sg(rho) d grad log pi] = E_pi[d grad log pi] = grad KL(pi || ref).
- rho detached for abs: that keeps abs's on-policy gradient, 2 grad TV (in the graph would give grad E_pi|d|,
  the gradient of a value biased high, a KL gradient no more), so old_logprob only undoes the sampling shift.
Any weighted value has mean E_pi[X], X's on-policy mean.

Sources: J. Schulman, "Approximating KL Divergence" (2020) for k1/k2/k3; Shao et al. arXiv:2402.03300 (GRPO
uses k3 as a loss); Tang & Munos arXiv:2506.09477 and Zhang et al. arXiv:2505.17508 (which gradient each
placement gives); Liu et al. arXiv:2510.01555 (k2 as a loss == k1 in the reward); Amini et al.
arXiv:2504.10637 (full-vocabulary KL); DeepSeek-V3.2 report, section 3.1 (importance-weighted k3). The maths,
the off-policy section and the numbers the tests use are in docs/kl.md; the exact analysis (expectations by
enumeration, where each estimator x placement converges, the frameworks' defaults) is the package lab.theory,
which `python -m lab.theory` prints and which this module never imports.

The code, re-exported here: estimators.py (the sampled estimators, every estimator's name and off-policy
rule, kl_penalty, parse_estimator: a name parsed once into the KLEstimator the step calls, needs_logits,
kl_panel), exact.py (full_kl), controllers.py (the KL coefficient in the reward).
"""

from rlhf.kl.controllers import (
    KL_CTRL_TYPES,
    AdaptiveKLController,
    FixedKLController,
    build_kl_controller,
    check_kl_ctrl,
)
from rlhf.kl.estimators import (
    AS_PLUS,
    BASE_ESTIMATOR_NAMES,
    DETACHED,
    ESTIMATOR_NAMES,
    FULL,
    IN_GRAPH,
    K3_CLAMP_EDGES,
    OFF_POLICY_RULES,
    PANEL_ESTIMATORS,
    Estimator,
    KLEstimator,
    canonical,
    check_estimator,
    kl_abs,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_panel,
    kl_penalty,
    needs_logits,
    off_policy_rule,
    parse_estimator,
    register_estimator,
)
from rlhf.kl.exact import full_kl
