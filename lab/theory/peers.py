"""What the big RLHF frameworks' default KL settings give, written in this module's estimators and placements.

Each PeerDefault row is one framework setting, read from that framework's code at the commit in SOURCES: the
estimator (this module's name for it), where it goes (the reward or the actor loss), the coefficient, and the
weight on the KL term. Three weights occur:
- "none": the term as is, k(x);
- "rho":  rho * k(x) with rho = pi(x) / pi_old(x) inside the autograd graph and unclipped, pi_old being the
          policy that sampled x (DeepSeek-V3.2's "unbiased KL estimate", report section 3.1). On-policy pi_old
          is pi detached, so rho == 1 in value but adds k(x) grad log pi(x) to the gradient;
- "unit": exp(lp - lp.detach()) * k(x), value 1 with that same extra gradient and no off-policy reweighting.
A reward-placed KL is computed once from the sampling policy's log-probs and enters the policy loss through
the advantage, which the PPO ratio reweights (inside the clip range). Each row also has the framework's own
clamp: `clamp` 10 means the term, weight included, is clamped to [-10, 10] (flat past it: no gradient), None
that it is not clamped at all (TRL writes k3 without one; slime clamps only low_var_kl; verl and SkyRL only k3).

For each row, on docs/kl.md's examples, `peer_kl_grad` gives the exact expected gradient of the KL term per unit
coefficient (the sum over the vocabulary, no sampling): (a) on-policy, example A; (b) after the first optimizer
step, example C (tokens from pi_old != pi); each is compared with grad KL(pi || ref) by `verdict`. (c) the
bandit fixed point, where the policy stops (there pi_old == pi, so the on-policy gradient decides it), from
lab.theory.fixed_points. `peer_report()` prints the table docs/kl.md carries, with the sources.
"""

from dataclasses import dataclass

import torch

from lab.theory.advantage_models import AdvantageModel
from lab.theory.expectations import (
    OFF_POLICY_EXAMPLES,
    divergence_grad,
    example,
    forward_kl,
    off_policy_example,
    reverse_kl,
)
from lab.theory.fixed_points import bandit_fixed_point
from lab.theory.optima import argmax_optimum, forward_kl_optimum, reverse_kl_optimum, tv

PLACEMENTS = ("reward", "loss")
CORRECTIONS = ("none", "rho", "unit")


@dataclass(frozen=True)
class Source:
    """Where a framework's rows were read: repository, commit, its date and the version it declares."""

    repo: str
    commit: str
    date: str
    version: str


SOURCES: dict[str, Source] = {
    "verl": Source("verl-project/verl", "1dda039b9c6311889a9c9a26040677e1254814f9", "2026-08-22", "0.10.0.dev"),
    "TRL": Source("huggingface/trl", "f2cd57710ae345ea6428ae95363267fcf38a3dc8", "2026-07-24", "1.10.0.dev0"),
    "OpenRLHF": Source("OpenRLHF/OpenRLHF", "3c3be6234e0cb353e76bb8019947db9dfe99fca7", "2026-08-13", "0.11.0"),
    "NeMo-RL": Source("NVIDIA-NeMo/RL", "7ea279abfbeb698b092856d0dab61e7cf39bc909", "2026-08-22", "0.6.0"),
    "slime": Source("THUDM/slime", "624b824a898ab0ec1fcb4d373004c7f3852bf515", "2026-08-21", "0.3.1"),
    "SkyRL": Source("NovaSky-AI/SkyRL", "a9564572eb8e91076be43c1bd5e4615e3de17265", "2026-08-21", "0.3.0"),
}


@dataclass(frozen=True)
class PeerDefault:
    """One framework setting: `estimator` is this module's name (kl_penalty), `placement` one of PLACEMENTS,
    `correction` one of CORRECTIONS and `clamp` the bound on the weighted term or None (the module docstring),
    `kl_coef` the coefficient that setting uses and `default_on` whether the framework's default configuration
    has this term on at all. `advantage` is the
    advantage estimator its policy gradient uses by default, as lab.theory.advantage_models models it (None where
    none models it), read in `advantage_files`."""

    framework: str
    setting: str
    files: tuple[str, ...]
    estimator: str
    placement: str
    kl_coef: float
    correction: str
    default_on: bool
    notes: str
    clamp: float | None
    advantage: AdvantageModel | None = None
    advantage_files: tuple[str, ...] = ()
    advantage_notes: str = ""


PEERS: tuple[PeerDefault, ...] = (
    PeerDefault(
        "verl", "GRPO recipes: actor.use_kl_loss=True",
        ("verl/trainer/config/actor/actor.yaml:103-116", "verl/workers/utils/losses.py:132-140",
         "verl/trainer/ppo/core_algos.py:2187-2252", "examples/grpo_trainer/run_qwen2-7b_math_megatron_fsdp.sh:50-52"),
        "k3", "loss", 0.001, "none", False,
        "use_kl_loss is off in the config; the GRPO examples turn it on with these values. The rollout-correction "
        "weights reach only the policy loss.",
        clamp=10.0,
        advantage=AdvantageModel("grpo", 5),
        advantage_files=("verl/trainer/config/ppo_trainer.yaml:74-77",
                         "verl/trainer/ppo/core_algos.py:268-330",
                         "examples/grpo_trainer/run_qwen3_5_2b_openr1_fsdp.sh:60,91-94,128"),
        advantage_notes=(
            "grpo divided by the group's torch.std + 1e-6 (norm_adv_by_std_in_grpo defaults to True); most GRPO "
            "examples sample rollout.n=5 (the one above, 2).")),
    PeerDefault(
        "verl", "algorithm.use_kl_in_reward=True",
        ("verl/trainer/config/ppo_trainer.yaml:98-113", "verl/trainer/ppo/ray_trainer.py:78-110"),
        "k1", "reward", 0.001, "none", False,
        "fixed controller; computed from old_log_probs; the PPO (gae) examples leave both KLs off.",
        clamp=None,
        advantage=AdvantageModel("gae"), advantage_files=("verl/trainer/config/ppo_trainer.yaml:74-77",),
        advantage_notes="adv_estimator defaults to gae, whitened."),
    PeerDefault(
        "TRL", "GRPOTrainer, beta > 0, use_bias_correction_kl=True",
        ("trl/trainer/grpo_config.py:179-182,359-362,671,962-963",
         "trl/trainer/grpo_trainer.py:3037,3066,3069-3076,3121"),
        "k3", "loss", 0.001, "rho", False,
        "beta defaults to 0.0 (no KL, no reference model), 0.001 is the value its docstring cites. The flag is "
        "False at this commit; TRL PR #6503 (merged after it) makes True the default. The ratio is "
        "exp(logp - old_logp), with old_logp = logp.detach() under the defaults (num_iterations=1, one generation "
        "per optimizer step), which are on-policy; importance_sampling_level='sequence' puts a sequence-mean "
        "ratio there instead.",
        clamp=None,
        advantage=AdvantageModel("grpo", 8),
        advantage_files=("trl/trainer/grpo_config.py:474-480,779-790",
                         "trl/trainer/grpo_trainer.py:2687-2707"),
        advantage_notes=(
            "scale_rewards='group' (the default): divided by the group's unbiased std + 1e-4 (the model's 1e-6 moves "
            "nothing at these reward gaps), num_generations=8.")),
    PeerDefault(
        "TRL", "GRPOTrainer, beta > 0, use_bias_correction_kl=False",
        ("trl/trainer/grpo_config.py:179-182,359-362", "trl/trainer/grpo_trainer.py:3069-3076,3121"),
        "k3", "loss", 0.001, "none", False,
        "the default at this commit and before PR #6503; k3 written without clamps.",
        clamp=None,
        advantage=AdvantageModel("grpo", 8),
        advantage_notes="as in the row above."),
    PeerDefault(
        "TRL", "RLOOTrainer",
        ("trl/trainer/rloo_config.py:494-495", "trl/trainer/rloo_trainer.py:1526-1535"),
        "k1", "reward", 0.05, "none", True,
        "the per-sequence sum of k1 from old_per_token_logps, subtracted from the sequence reward.",
        clamp=None,
        advantage=AdvantageModel("rloo", 2), advantage_files=("trl/trainer/rloo_config.py:297-303,523-526",),
        advantage_notes="num_generations defaults to 2, normalize_advantages to False."),
    PeerDefault(
        "TRL", "PPOTrainer (trl.experimental.ppo)",
        ("trl/experimental/ppo/ppo_config.py:240-252", "trl/experimental/ppo/ppo_trainer.py:773-775"),
        "k1", "reward", 0.05, "none", True,
        "kl_estimator='k3' is the other choice; per-token penalty from the rollout's log-probs.",
        clamp=None,
        advantage=AdvantageModel("gae"), advantage_files=("trl/experimental/ppo/ppo_trainer.py:786-797",),
        advantage_notes="GAE, whitened (masked_whiten, + 1e-8)."),
    PeerDefault(
        "OpenRLHF", "default, every advantage estimator (gae, group_norm = GRPO, ...)",
        ("openrlhf/cli/train_ppo_ray.py:417-429", "openrlhf/trainer/ppo_utils/experience_maker.py:205-212",
         "openrlhf/models/utils.py:64-111", "openrlhf/trainer/ppo_trainer.py:171-176"),
        "k1", "reward", 0.01, "none", True,
        "from the rollout's log-probs; fixed unless --algo.kl.target is set; every estimator clamped to [-10, 10].",
        clamp=10.0,
        advantage=AdvantageModel("gae"),
        advantage_files=("openrlhf/cli/train_ppo_ray.py:477-483",
                         "openrlhf/trainer/ppo_utils/experience_maker.py:314-328"),
        advantage_notes="--algo.advantage.estimator defaults to gae, whitened over the batch."),
    PeerDefault(
        "OpenRLHF", "--algo.kl.use_loss, estimator left at its default",
        ("openrlhf/cli/train_ppo_ray.py:422-429,485,683-685", "openrlhf/trainer/ray/ppo_actor.py:319-337"),
        "k1", "loss", 0.01, "none", False,
        "a printed hint recommends k2 or k3 as a loss; the example script passes k2.",
        clamp=10.0,
        advantage=AdvantageModel("gae"),
        advantage_notes="the default gae."),
    PeerDefault(
        "NeMo-RL", "GRPO: grpo_math_1B.yaml, ClippedPGLossConfig",
        ("examples/configs/grpo_math_1B.yaml:79-90", "nemo_rl/algorithms/loss/loss_functions.py:128-153,469-500",
         "nemo_rl/algorithms/utils.py:42-100"),
        "k3", "loss", 0.01, "unit", True,
        "the weight exp(logp - logp.detach()) since NeMo-RL PR #2506 (2026-06-24; a constant 1 before): per sample "
        "its gradient is k2's, since k3 + k3' = d. The PPO recipe (ppo_math_1B.yaml:67) sets the coefficient to 0.",
        clamp=10.0,
        advantage=None,
        advantage_files=("examples/configs/grpo_math_1B.yaml:4-9",
                         "nemo_rl/algorithms/advantage_estimator.py:80-98", "nemo_rl/algorithms/utils.py:149-194"),
        advantage_notes=(
            "normalize_rewards and use_leave_one_out_baseline are true (16 per prompt): the leave-one-out mean, "
            "divided by the other samples' std where it is > 0; not modelled here.")),
    PeerDefault(
        "NeMo-RL", "use_on_policy_kl_approximation=True",
        ("nemo_rl/algorithms/loss/loss_functions.py:153,482-500", "nemo_rl/algorithms/utils.py:42-100"),
        "k3", "loss", 0.01, "rho", False,
        "rho = exp(logp - generation_logp) against the sampler's log-probs, unclipped (nan_to_num); detached "
        "before PR #2506.",
        clamp=10.0,
        advantage=None,
        advantage_notes="as in the row above."),
    PeerDefault(
        "NeMo-RL", "use_kl_in_reward=True (Reinforce++, GAE)",
        ("nemo_rl/algorithms/loss/loss_functions.py:135,240-242",
         "nemo_rl/algorithms/advantage_estimator.py:193-255,384-393"),
        "k3", "reward", 0.01, "none", False,
        "the reward uses reference_policy_kl_type, k3 unless changed.",
        clamp=10.0,
        advantage=None,
        advantage_notes="Reinforce++ is not modelled here."),
    PeerDefault(
        "slime", "GRPO scripts: --use-kl-loss --kl-loss-type low_var_kl",
        ("slime/utils/arguments.py:934-938,981-994", "slime/backends/megatron_utils/loss.py:1116-1130",
         "slime/utils/ppo_utils.py:11-51", "scripts/run-qwen3-4B.sh:91-95"),
        "k3", "loss", 0.0, "none", False,
        "the scripts pass --kl-loss-coef 0.00 (the default), so the term is computed and weighs nothing.",
        clamp=10.0,
        advantage=AdvantageModel("grpo", 8),
        advantage_files=("slime/utils/arguments.py:941-951,1004-1009",
                         "slime/ray/rollout.py:612-631", "scripts/run-qwen3-4B.sh:58,92"),
        advantage_notes=(
            "--advantage-estimator grpo (the default), divided by the group's torch.std + 1e-6 unless "
            "--disable-grpo-std-normalization; the script's --n-samples-per-prompt 8.")),
    PeerDefault(
        "slime", "--use-kl-loss, --kl-loss-type left at its default",
        ("slime/utils/arguments.py:934-938,981-988", "slime/backends/megatron_utils/loss.py:1116-1130"),
        "k1", "loss", 0.0, "none", False,
        "--kl-loss-type defaults to k1; the coefficient to 0.0.",
        clamp=None,
        advantage=AdvantageModel("grpo", 8),
        advantage_notes="as in the GRPO scripts."),
    PeerDefault(
        "slime", "--use-kl-loss --use-unbiased-kl (low_var_kl)",
        ("slime/utils/arguments.py:989-994", "slime/backends/megatron_utils/loss.py:1116-1130",
         "slime/utils/ppo_utils.py:43-49"),
        "k3", "loss", 0.0, "rho", False,
        "rho = exp(logp - old_logp), unclipped; for low_var_kl the product is clamped to [-10, 10].",
        clamp=10.0,
        advantage=AdvantageModel("grpo", 8),
        advantage_notes="as in the GRPO scripts."),
    PeerDefault(
        "slime", "--kl-coef > 0 (advantage estimator ppo or reinforce_plus_plus)",
        ("slime/utils/arguments.py:909-913,934-938,1846", "slime/backends/megatron_utils/loss.py:743-776",
         "slime/utils/ppo_utils.py:361-368"),
        "k1", "reward", 0.0, "none", False,
        "the reward KL uses --kl-loss-type (k1 by default); the grpo estimator ignores it.",
        clamp=None,
        advantage=AdvantageModel("gae"),
        advantage_notes="ppo's (GAE, whitened); reinforce_plus_plus is not modelled here."),
    PeerDefault(
        "SkyRL", "default (grpo and gae alike)",
        ("skyrl/train/config/config.py:823-836", "skyrl/backends/skyrl_train/utils/ppo_utils.py:89-120",
         "skyrl/backends/skyrl_train/workers/worker.py:1070-1080"),
        "k3", "loss", 0.001, "none", True,
        "use_kl_loss defaults to True; the GRPO and PPO examples keep it.",
        clamp=10.0,
        advantage=AdvantageModel("grpo", 5),
        advantage_files=(
                         "skyrl/train/config/config.py:823,892-894,1225",
                         "skyrl/backends/skyrl_train/utils/ppo_utils.py:1344-1390"),
        advantage_notes=(
            "advantage_estimator defaults to grpo, divided by the group's torch.std + 1e-6 (grpo_norm_by_std=True), "
            "n_samples_per_prompt=5.")),
    PeerDefault(
        "SkyRL", "use_kl_in_reward=True (use_kl_loss=False)",
        ("skyrl/train/config/config.py:828-836", "skyrl/train/trainer.py:1410-1436"),
        "k3", "reward", 0.001, "none", False,
        "the reward uses kl_estimator_type, k3 unless changed.",
        clamp=10.0,
        advantage=AdvantageModel("grpo", 5),
        advantage_notes="as in the default row."),

)


def _unclamped(estimator: str, logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """The estimator's value as Schulman writes it, no clamp (kl_penalty's k3 carries verl's)."""
    d = logprob - ref_logprob
    return {"k1": d, "k2": d**2 / 2, "k3": torch.expm1(-d) + d}[estimator]


def peer_term(peer: PeerDefault, logprob: torch.Tensor, ref_logprob: torch.Tensor, weight: torch.Tensor
              ) -> torch.Tensor:
    """The framework's per-token KL term: weight * k, clamped to [-peer.clamp, peer.clamp] where it clamps."""
    term = weight * _unclamped(peer.estimator, logprob, ref_logprob)
    return term if peer.clamp is None else term.clamp(-peer.clamp, peer.clamp)


def peer_kl_grad(
    peer: PeerDefault, logits: torch.Tensor, ref_probs: torch.Tensor, old_probs: torch.Tensor | None = None
) -> torch.Tensor:
    """Expected gradient (V,) w.r.t. the policy logits of `peer`'s KL term per unit coefficient, exact over the
    vocabulary, for tokens sampled from old_probs (V,) or, if None, from pi = softmax(logits) itself.

    The term is what the framework adds to the loss: peer_term with weight c for a loss-placed KL (CORRECTIONS),
    and rho(x) * sg(k_old(x)) for a reward-placed one (the policy-loss surrogate -rho * A with A = -k_old, rho in
    the graph; k_old is the framework's k at the sampling policy, frozen at rollout).
    """
    if peer.placement not in PLACEMENTS or peer.correction not in CORRECTIONS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, correction one of {CORRECTIONS}: {peer}")
    leaf = logits.detach().requires_grad_(True)
    logprobs = torch.log_softmax(leaf, dim=-1)
    sampler = logprobs.detach() if old_probs is None else old_probs.log()
    ratio = torch.exp(logprobs - sampler)  # pi / pi_old in the graph, 1 in value on-policy
    ref_logprobs = ref_probs.log()
    if peer.placement == "reward":
        term = ratio * peer_term(peer, sampler, ref_logprobs, torch.ones_like(sampler)).detach()
    else:
        weight = {
            "none": torch.ones_like(logprobs),
            "rho": ratio,
            "unit": torch.exp(logprobs - logprobs.detach()),
        }[peer.correction]
        term = peer_term(peer, logprobs, ref_logprobs, weight)
    (grad,) = torch.autograd.grad((sampler.exp() * term).sum(), leaf)
    return grad


def verdict(grad: torch.Tensor, logits: torch.Tensor, ref_probs: torch.Tensor, atol: float = 1e-10) -> str:
    """'exact' (grad KL(pi || ref) to atol), 'zero', 'forward KL' (grad KL(ref || pi) = pi - ref), or
    'biased, cos=.., norm x..' (cosine with grad KL(pi || ref) and the ratio of the norms)."""
    target = divergence_grad(reverse_kl, logits, ref_probs)
    if grad.abs().max() <= atol:
        return "zero"
    if (grad - target).abs().max() <= atol:
        return "exact"
    if (grad - divergence_grad(forward_kl, logits, ref_probs)).abs().max() <= atol:
        return "forward KL"
    cos = torch.dot(grad, target) / (grad.norm() * target.norm())
    return f"biased, cos={cos.item():.4f}, norm x{(grad.norm() / target.norm()).item():.2f}"


def on_policy_value(peer: PeerDefault):
    """`peer`'s term on-policy as a value function (logprob, ref_logprob) -> k for lab.theory.fixed_points:
    in the reward its value; in the loss with its weight, whose value is 1 on-policy (rho and unit alike are
    exp(lp - sg(lp)) there) and whose gradient adds k grad log pi, the clamp applied after the weight. Unclamped,
    rho- and unit-weighted k3 and k1 have k2's per-sample gradient (k3 + k3' = d, k1 + k1' = d + 1); a weighted
    term past its clamp has none. It stays a loss term, outside the advantage: an advantage estimator that
    rescales the policy gradient (grpo's std) leaves it as it is."""
    def value(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
        weighted = peer.placement == "loss" and peer.correction != "none"
        weight = torch.exp(logprob - logprob.detach()) if weighted else torch.ones_like(logprob)
        return peer_term(peer, logprob, ref_logprob, weight)

    return value


# The bandit for the fixed-point column: example A's reference (uniform over 4 arms), rewards and coefficient.
# One beta for every row, so the rows differ only in what they converge to; a framework's own coefficient
# only rescales the rewards (the optimum for beta and r is the one for 1 and r / beta).
BANDIT_REWARDS = (1.0, 0.5, 0.25, 0.0)
BANDIT_BETA = 0.5


def bandit() -> tuple[torch.Tensor, torch.Tensor, float]:
    """The fixed-point column's bandit as (ref_probs (K,), rewards (K,), beta), float64."""
    _, ref_probs = example("A")
    return ref_probs, torch.tensor(BANDIT_REWARDS, dtype=torch.float64), BANDIT_BETA


def peer_fixed_point(peer: PeerDefault, with_advantage: bool = False) -> torch.Tensor:
    """Where `peer`'s setting stops on bandit() (K,): bandit_fixed_point of its on_policy_value, with the
    idealised advantage or, if `with_advantage`, with peer.advantage (raises ValueError where that is None)."""
    estimator, placement = on_policy_value(peer), peer.placement
    ref_probs, rewards, beta = bandit()
    if not with_advantage:
        return bandit_fixed_point(ref_probs, rewards, beta, estimator, placement)
    if peer.advantage is None:
        raise ValueError(f"{peer.framework}, {peer.setting}: its advantage estimator is not modelled")
    return bandit_fixed_point(ref_probs, rewards, beta, estimator, placement, advantage=peer.advantage.advantage,
                              n=peer.advantage.n)


def fixed_point_verdict(
    probs: torch.Tensor, ref_probs: torch.Tensor, rewards: torch.Tensor, beta: float, atol: float = 1e-10
) -> str:
    """Which analytic optimum of lab.theory.optima `probs` is (to atol): 'reverse-KL optimum', 'forward-KL
    optimum', 'argmax' (all mass on the best arm, as with no KL at all), else 'other, max|pi - reverse opt| = ..'."""
    candidates = {
        "reverse-KL optimum": reverse_kl_optimum(ref_probs, rewards, beta),
        "forward-KL optimum": forward_kl_optimum(ref_probs, rewards, beta),
        "argmax": argmax_optimum(ref_probs, rewards, beta),
    }
    for name, optimum in candidates.items():
        if (probs - optimum).abs().max() <= atol:
            return name
    gap = (probs - candidates["reverse-KL optimum"]).abs().max().item()
    return f"other, max|pi - reverse opt| = {gap:.3f}"


def advantage_verdict(peer: PeerDefault, atol: float = 1e-10) -> str:
    """Where `peer` stops on bandit() with its own advantage estimator, against the idealised advantage's point:
    'not modelled', '<model>: the same' (to atol), or '<model>: best arm p, TV t from it'."""
    if peer.advantage is None:
        return "not modelled"
    probs, idealised = peer_fixed_point(peer, with_advantage=True), peer_fixed_point(peer)
    if (probs - idealised).abs().max() <= atol:
        return f"{peer.advantage.label}: the same"
    return f"{peer.advantage.label}: best arm {probs.max().item():.3f}, TV {tv(probs, idealised):.3f} from it"


def peer_cells(peer: PeerDefault) -> dict[str, str]:
    """The table's computed cells for `peer`: on_policy (example A), off_policy (example C), fixed_point,
    with_advantage (advantage_verdict)."""
    logits, ref_probs = example("A")
    c_logits, c_ref, c_old = off_policy_example("C")
    return {
        "on_policy": verdict(peer_kl_grad(peer, logits, ref_probs), logits, ref_probs),
        "off_policy": verdict(peer_kl_grad(peer, c_logits, c_ref, c_old), c_logits, c_ref),
        "fixed_point": fixed_point_verdict(peer_fixed_point(peer), *bandit()),
        "with_advantage": advantage_verdict(peer),
    }


def peer_report() -> str:
    """The markdown table of PEERS with the computed cells, what the cells mean, then the sources and files."""
    pi_old = OFF_POLICY_EXAMPLES["C"][1]
    lines = [
        "| framework | setting | on by default | estimator, placement | coef | weight | clamp | on-policy (A) "
        "| after the first step (C) | bandit fixed point | with its advantage estimator |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for peer in PEERS:
        cells = peer_cells(peer)
        lines.append(
            f"| {peer.framework} | {peer.setting} | {'yes' if peer.default_on else 'no'} "
            f"| {peer.estimator}, {peer.placement} | {peer.kl_coef:g} | {peer.correction} "
            f"| {'none' if peer.clamp is None else f'{peer.clamp:g}'} | {cells['on_policy']} "
            f"| {cells['off_policy']} | {cells['fixed_point']} | {cells['with_advantage']} |"
        )
    lines += [
        "",
        "Gradients: of the KL term per unit coefficient, exact over the vocabulary, against grad KL(pi || ref); "
        f"(A) on-policy on example A, (C) on example C (tokens from pi_old = {pi_old}). Fixed point: on the "
        f"bandit ref = example A's, r = {BANDIT_REWARDS}, beta = {BANDIT_BETA}, with the idealised advantage "
        "r_x - E_pi r, then with the advantage estimator the setting runs by default (lab.theory.advantage_models; "
        "'TV from it': to the idealised advantage's point).",
        "",
        "Sources (file:lines at the commit named):",
        "",
    ]
    for framework, source in SOURCES.items():
        lines.append(f"- {framework}: {source.repo} @ {source.commit[:7]} ({source.date}, {source.version})")
        for peer in PEERS:
            if peer.framework == framework:
                lines.append(f"  - {peer.setting}: {', '.join(peer.files)}. {peer.notes}")
                files = f"{', '.join(peer.advantage_files)}. " if peer.advantage_files else ""
                lines.append(f"    Advantage: {files}{peer.advantage_notes}")
    return "\n".join(lines)
