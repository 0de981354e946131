"""The trainer's glue: rlhf/ppo.py by hand, and train.py's rollout and update against a reference.

The reference (`reference_update`) is PPO written straight from the algorithm with the tested pieces
(kl_penalty, compute_gae, masked_whiten, policy_loss, value_loss): whole mini-batches, no micro-batches,
no accelerate, plain SGD. train.update, with SGD optimizers in place of AdamW (so that the weights after
the update are a direct function of the gradients, which AdamW's first step is not), must reach the same
weights. Deleting or altering any line of the glue that changes what is learned (the KL penalty in the
rewards, the KL term or the entropy bonus in the loss, whitening, GAE's gamma/lambda, the micro-batch
normalisers, the mini-batch order, clipping, zero_grad) makes the weights differ.
"""

import copy

import pytest
import torch
from accelerate import Accelerator
from helpers import in_processes, tiny_overrides

import rlhf.setup
import train
from rlhf import core_algos, kl, ppo, rewards
from rlhf.config import ActorConfig, load_config
from rlhf.rewards import load_reward
from rlhf.rewards.gsm8k import compute_score
from rlhf.rollout import (SamplingParams, build_batch, generate, left_pad, logprobs_and_logits, response_mask_from_ids,
                          response_values)
from rlhf.tracking import Timer

pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------- rlhf/ppo.py by hand

MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])


def test_token_rewards_put_the_score_last_and_the_kl_penalty_on_every_valid_token():
    scores = torch.tensor([1.0, 0.0, 0.5])
    kl_values = torch.tensor([[0.1, 0.2, 0.3, 9.0], [0.4, 9.0, 9.0, 9.0], [9.0, 9.0, 9.0, 9.0]], requires_grad=True)
    rewards = ppo.token_rewards(scores, MASK, kl_values, kl_coef=0.5)
    expected = torch.tensor([[-0.05, -0.1, 1.0 - 0.15, 0.0],
                             [-0.2, 0.0, 0.0, 0.0],
                             [0.5, 0.0, 0.0, 0.0]])  # an empty response: score at 0, where GAE ignores it
    torch.testing.assert_close(rewards, expected)
    rewards.sum().backward()  # d reward / d kl: -coef on valid tokens, exactly 0 elsewhere
    assert torch.equal(kl_values.grad, -0.5 * MASK.float())
    torch.testing.assert_close(ppo.token_rewards(scores, MASK),  # no KL in the reward: the scores alone
                               torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0] * 4, [0.5, 0.0, 0.0, 0.0]]))


def test_sequence_mean_weights_every_response_once_over_all_processes():
    values = torch.tensor([[1.0, 1.0, 1.0, 1.0], [3.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    assert ppo.sequence_mean(values, mask) == pytest.approx(2.0)  # (1 + 3) / 2; the token mean is 7 / 5
    assert core_algos.masked_mean(values, mask).item() == pytest.approx(1.4)
    # Two processes holding one sequence each give the one-process answer.
    shards = [(values[:1], mask[:1]), (values[1:], mask[1:])]
    assert in_processes(lambda s, reduce_sum: ppo.sequence_mean(*s, reduce_sum), shards) == pytest.approx([2.0, 2.0])


ESTIMATOR_GRAD = {  # d estimator / d logprob, with d = logprob - ref_logprob (docs/kl.md)
    "k1": lambda d: torch.ones_like(d), "k2": lambda d: d, "k3": lambda d: 1 - torch.exp(-d),
    "abs": torch.sign, "k3+": lambda d: d, "low_var_kl+": lambda d: d, "full": None,
}


@pytest.mark.parametrize("estimator", [*ESTIMATOR_GRAD, None])
@pytest.mark.parametrize("entropy_coeff", [0.0, 0.3])
def test_actor_loss_gradient_is_the_policy_gradient_plus_the_kl_and_entropy_terms(estimator, entropy_coeff):
    """d loss / d logprobs = d pg_loss / d logprobs + coef * (the estimator's gradient) / num_tokens, and
    d loss / d entropy = -entropy_coeff / num_tokens, on valid tokens only (token-mean)."""
    gen = torch.Generator().manual_seed(1)
    shape = (3, 4)
    old = torch.randn(shape, generator=gen) - 2
    ref = old + 0.5 * torch.randn(shape, generator=gen)  # |d| small: k3's clamp (gradient 0) stays out of it
    logprobs = (old + 0.1 * torch.randn(shape, generator=gen)).requires_grad_()
    advantages, mask = torch.randn(shape, generator=gen), torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    entropy = torch.rand(shape, generator=gen).requires_grad_()
    full = torch.rand(shape, generator=gen).requires_grad_()  # stands for kl.full_kl of the logits
    cfg = ActorConfig(use_kl_loss=estimator is not None, kl_loss_type=estimator or "k1", kl_loss_coef=0.7,
                      entropy_coeff=entropy_coeff)
    loss, metrics = ppo.actor_loss(cfg, logprobs, old, advantages, mask, entropy, ref, full)
    loss.backward()

    pg_logprobs = logprobs.detach().requires_grad_()
    pg_loss, _ = core_algos.policy_loss(old, pg_logprobs, advantages, mask, cfg.clip_ratio, cfg.clip_ratio_c)
    pg_loss.backward()
    num_tokens = mask.sum()
    expected = pg_logprobs.grad.clone()
    if estimator not in (None, "full"):
        expected += 0.7 * ESTIMATOR_GRAD[estimator](logprobs.detach() - ref) * mask / num_tokens
    torch.testing.assert_close(logprobs.grad, expected)
    torch.testing.assert_close(entropy.grad if entropy_coeff else torch.zeros(shape),
                               -entropy_coeff * mask / num_tokens)
    if estimator == "full":
        torch.testing.assert_close(full.grad, 0.7 * mask / num_tokens)
    assert ("actor/kl_loss" in metrics) == (estimator is not None)
    if estimator is not None:
        value = full if estimator == "full" else kl.kl_penalty(logprobs.detach(), ref, estimator)
        assert metrics["actor/kl_loss"] == pytest.approx(core_algos.masked_mean(value.detach(), mask).item())


@pytest.mark.parametrize("estimator", ["k3", "k3+", "k1"])
def test_actor_loss_with_the_off_policy_correction_weights_the_kl_term_by_rho(estimator):
    """d loss / d logprobs gains coef * d(rho * k)/d logprob / num_tokens, rho = exp(logprob - old_logprob):
    in the graph for k1 and k3 (rho * k + rho * k'), detached for k3+ (rho * d); docs/kl.md, off-policy."""
    gen = torch.Generator().manual_seed(2)
    shape = (3, 4)
    old = torch.randn(shape, generator=gen) - 2
    ref = old + 0.5 * torch.randn(shape, generator=gen)
    logprobs = (old + 0.3 * torch.randn(shape, generator=gen)).requires_grad_()
    advantages, mask = torch.randn(shape, generator=gen), torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    grads = []
    for corrected in (False, True):
        cfg = ActorConfig(use_kl_loss=True, kl_loss_type=estimator, kl_loss_coef=0.7,
                          kl_loss_off_policy_correction=corrected)
        logprobs.grad = None
        ppo.actor_loss(cfg, logprobs, old, advantages, mask, torch.zeros(shape), ref)[0].backward()
        grads.append(logprobs.grad.clone())
    d, rho = logprobs.detach() - ref, torch.exp(logprobs.detach() - old)
    value = kl.kl_penalty(logprobs.detach(), ref, estimator)
    weighted = {"k3": rho * value + rho * (1 - torch.exp(-d)), "k1": rho * value + rho, "k3+": rho * d}[estimator]
    torch.testing.assert_close(grads[1] - grads[0],
                               0.7 * (weighted - ESTIMATOR_GRAD[estimator](d)) * mask / mask.sum())


def test_minibatches_cover_the_batch_once_per_epoch_in_an_order_fixed_by_seed_and_step():
    epochs = ppo.minibatches(8, 4, num_epochs=3, seed=7, step=5)
    assert len(epochs) == 6 and all(len(index) == 4 for index in epochs)
    for e in range(3):
        assert sorted(torch.cat(epochs[2 * e:2 * e + 2]).tolist()) == list(range(8))
    assert [i.tolist() for i in epochs] == [i.tolist() for i in ppo.minibatches(8, 4, 3, seed=7, step=5)]
    assert [i.tolist() for i in epochs] != [i.tolist() for i in ppo.minibatches(8, 4, 3, seed=7, step=6)]
    assert epochs[0].tolist() != epochs[2].tolist()  # a fresh permutation per epoch


def test_repeat_prompts_keeps_each_prompts_group_together():
    rows = {"input_ids": [[1], [2, 3]], "ground_truth": ["4", "5"]}
    repeated, group_ids = ppo.repeat_prompts(rows, 3)
    assert repeated == {"input_ids": [[1], [1], [1], [2, 3], [2, 3], [2, 3]], "ground_truth": ["4"] * 3 + ["5"] * 3}
    assert group_ids.tolist() == [0, 0, 0, 1, 1, 1]
    assert ppo.repeat_prompts(rows, 1)[0] == rows and ppo.repeat_prompts(rows, 1)[1].tolist() == [0, 1]


def test_groups_with_equal_scores_counts_groups_without_signal():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5])
    group_ids = torch.tensor([0, 0, 1, 1, 2, 2, 3])  # equal, mixed, equal, alone (not a group)
    assert ppo.groups_with_equal_scores(scores, group_ids) == pytest.approx(2 / 3)
    assert ppo.groups_with_equal_scores(scores[-1:], group_ids[-1:]) == 0.0


def test_when_to_evaluate_and_checkpoint():
    assert [s for s in range(1, 11) if ppo.should_evaluate(s, 10, test_freq=4)] == [4, 8, 10]
    assert [s for s in range(1, 11) if ppo.should_evaluate(s, 10, test_freq=0)] == [10]
    assert [s for s in range(1, 11) if ppo.should_checkpoint(s, 10, 3, stopping=False, bad_steps=0)] == [3, 6, 9, 10]
    assert [s for s in range(1, 11) if ppo.should_checkpoint(s, 10, 0, stopping=False, bad_steps=0)] == [10]
    assert ppo.should_checkpoint(4, 10, 0, stopping=True, bad_steps=0)
    assert not ppo.should_checkpoint(6, 10, 3, stopping=False, bad_steps=1)  # not during a run of bad steps
    assert ppo.should_checkpoint(10, 10, 3, stopping=False, bad_steps=1) and ppo.should_checkpoint(5, 10, 3, True, 2)


# ----------------------------------------------------------------------------- train.py against the reference

CASES = {
    # reward KL with an adaptive coefficient, k3+ in the loss, entropy bonus, token-mean
    "reward_k1+loss_k3+": ["algorithm.use_kl_in_reward=true", "algorithm.kl_penalty=k1", "actor.use_kl_loss=true",
                           "actor.kl_loss_type=k3+", "actor.entropy_coeff=0.05", "algorithm.kl_ctrl.type=adaptive",
                           "algorithm.kl_ctrl.horizon=40", "algorithm.kl_ctrl.target_kl=0.01"],
    # the exact KL in both places, per-sequence loss normalisation
    "full_both": ["algorithm.use_kl_in_reward=true", "algorithm.kl_penalty=full", "actor.use_kl_loss=true",
                  "actor.kl_loss_type=full", "actor.loss_agg_mode=seq-mean-token-mean", "actor.grad_clip=0.05"],
    # k3+ with the off-policy correction (the tokens are off-policy after the first optimizer step)
    "loss_k3+_corrected": ["algorithm.use_kl_in_reward=false", "actor.use_kl_loss=true", "actor.kl_loss_type=k3+",
                           "actor.kl_loss_off_policy_correction=true", "actor.kl_loss_coef=5.0"],
    # grpo: two responses per prompt, no critic, k3 in the loss (GRPO's recipe) and k1 in the reward
    "grpo": ["algorithm.adv_estimator=grpo", "rollout.n=2", "algorithm.use_kl_in_reward=true",
             "algorithm.kl_penalty=k1", "actor.use_kl_loss=true", "actor.kl_loss_type=k3"],
    # k3 in the loss only, Dr. GRPO's constant normaliser, no clipping (it would hide the normaliser's scale)
    "loss_k3": ["algorithm.use_kl_in_reward=false", "actor.use_kl_loss=true", "actor.kl_loss_type=k3",
                "actor.loss_agg_mode=seq-mean-token-sum-norm", "actor.grad_clip=1e6", "critic.grad_clip=1e6"],
}
COMMON = ["algorithm.gamma=0.9", "algorithm.lam=0.8", "algorithm.kl_ctrl.kl_coef=0.5", "actor.kl_loss_coef=0.5",
          "actor.ppo_epochs=2", "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size=2",
          "rollout.temperature=0.7", "rollout.log_prob_micro_batch_size=3", "trainer.logger=none"]
LR = 0.05


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=LR)


def weights(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.fixture
def setup_run(artifacts, tmp_path):
    """A config, an accelerator, the trainer's models and a rollout batch with non-trivial scores. The actor is
    perturbed so that it differs from the reference (else every KL is 0), and the critic's head so that the
    values are not all 0 (else GAE could not tell gamma from lambda, nor value clipping act)."""

    def make(*extra):
        cfg = load_config(None, tiny_overrides(artifacts, str(tmp_path), *COMMON, *extra))
        accelerator = Accelerator(cpu=True)
        tokenizer, train_set, _, actor, critic, ref = rlhf.setup.prepare_data_and_models(cfg, accelerator)
        torch.manual_seed(0)
        with torch.no_grad():
            for p in actor.parameters():
                p.add_(0.05 * torch.randn_like(p))
            if critic is not None:
                critic.score.weight.normal_(std=0.1)
        rows, group_ids = ppo.repeat_prompts(train_set[list(range(cfg.data.train_batch_size))], cfg.rollout.n)
        batch = train.rollout(cfg, accelerator, (actor, critic, ref), tokenizer, rows, Timer())
        batch["group_ids"] = group_ids
        # The tiny model scores 0: scores by hand, with every kind of group (mixed, all 0, all 1) when n > 1.
        batch["scores"] = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0] * cfg.rollout.n)
        return cfg, accelerator, (actor, critic, ref), tokenizer, rows, batch

    return make


def reference_update(cfg, actor, critic, ref, batch, kl_coef: float, step: int):
    """PPO from the algorithm: rewards -> GAE -> whitening -> per mini-batch, loss, backward, clip, SGD step."""
    a, ac, temperature = cfg.algorithm, cfg.actor, cfg.rollout.temperature
    mask, old, ref_lp = batch["response_mask"], batch["old_logprobs"], batch["ref_logprobs"]
    rewards = torch.zeros_like(old)
    rewards[torch.arange(len(mask)), mask.sum(1) - 1] = batch["scores"]
    if a.use_kl_in_reward:
        reward_kl = batch["full_kl"] if a.kl_penalty == "full" else kl.kl_penalty(old, ref_lp, a.kl_penalty)
        rewards = rewards - kl_coef * reward_kl * mask
    if a.adv_estimator == "gae":
        advantages, returns = core_algos.compute_gae(rewards, batch["values"], mask, a.gamma, a.lam)
        advantages = core_algos.masked_whiten(advantages, mask)
    else:  # grpo: each response's summed reward against its prompt's group (mean, unbiased std)
        totals = (rewards * mask).sum(1)
        group = [totals[batch["group_ids"] == g] for g in batch["group_ids"]]
        advantages = torch.stack([(t - g.mean()) / (g.std() + 1e-6) for t, g in zip(totals, group)])
        advantages = advantages[:, None] * mask
    actor_opt, critic_opt = sgd(actor), critic and sgd(critic)
    mini_size = ac.ppo_mini_batch_size * cfg.rollout.n
    for index in ppo.minibatches(len(mask), mini_size, ac.ppo_epochs, cfg.trainer.seed, step):
        mb = {k: v[index] for k, v in batch.items()}
        m = mb["response_mask"]
        logprobs, logits = logprobs_and_logits(actor, mb, temperature)
        loss = core_algos.policy_loss(mb["old_logprobs"], logprobs, advantages[index], m, ac.clip_ratio,
                                      ac.clip_ratio_c, ac.loss_agg_mode)[0]
        loss = loss - ac.entropy_coeff * core_algos.agg_loss(core_algos.entropy_from_logits(logits, temperature), m,
                                                             ac.loss_agg_mode)
        if ac.use_kl_loss:
            if ac.kl_loss_type == "full":
                kl_mat = kl.full_kl(logits, logprobs_and_logits(ref, mb, temperature)[1].detach(), temperature)
            else:
                old_logprob = mb["old_logprobs"] if ac.kl_loss_off_policy_correction else None
                kl_mat = kl.kl_penalty(logprobs, mb["ref_logprobs"], ac.kl_loss_type, old_logprob=old_logprob)
            loss = loss + ac.kl_loss_coef * core_algos.agg_loss(kl_mat, m, ac.loss_agg_mode)
        learners = [(actor, actor_opt, loss, ac.grad_clip)]
        if critic is not None:
            vf_loss = core_algos.value_loss(response_values(critic, mb), mb["values"], returns[index], m,
                                            cfg.critic.cliprange_value, ac.loss_agg_mode)[0]
            learners.append((critic, critic_opt, vf_loss, cfg.critic.grad_clip))
        for model, opt, objective, clip in learners:
            objective.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()


def sgd_update(cfg, accelerator, actor, critic, ref, batch, kl_ctrl):
    """train.update at step 3 with SGD optimizers (the module docstring says why), in place on the models.
    Returns (metrics, skipped updates)."""
    learners = [actor] + ([critic] if critic is not None else [])
    prepared = accelerator.prepare(*learners, *[sgd(model) for model in learners])
    half = len(prepared) // 2
    models = (prepared[0], prepared[1] if half == 2 else None, ref)
    optimizers = (prepared[half], prepared[3] if half == 2 else None)
    return train.update(cfg, accelerator, models, optimizers, batch, kl_ctrl, step=3, timer=Timer())


@pytest.mark.parametrize("case", CASES)
def test_update_reaches_the_weights_of_the_reference_ppo(setup_run, case):
    cfg, accelerator, models, _, _, batch = setup_run(*CASES[case])
    actor, critic, ref = models
    expected_actor, expected_critic = copy.deepcopy(actor), copy.deepcopy(critic)
    kl_ctrl = kl.build_kl_controller(cfg.algorithm.kl_ctrl.type, 0.5, cfg.algorithm.kl_ctrl.target_kl,
                                     cfg.algorithm.kl_ctrl.horizon)
    reference_update(cfg, expected_actor, expected_critic, ref, dict(batch), kl_ctrl.value, step=3)

    learners = [(actor, expected_actor)] + ([(critic, expected_critic)] if critic is not None else [])
    start = [weights(model) for model, _ in learners]
    metrics, skipped = sgd_update(cfg, accelerator, actor, critic, ref, dict(batch), kl_ctrl)

    assert skipped == 0
    assert ("critic/vf_loss" in metrics) == (critic is not None)
    for (model, expected), before in zip(learners, start):
        moved = (weights(expected) - before).abs().max().item()
        assert moved > 1e-4  # ~100x the tolerance, so the comparison means something
        torch.testing.assert_close(weights(model), weights(expected), rtol=1e-5, atol=1e-6)

    if cfg.algorithm.use_kl_in_reward:
        old, ref_lp, mask = batch["old_logprobs"], batch["ref_logprobs"], batch["response_mask"]
        reward_kl = batch["full_kl"] if cfg.algorithm.kl_penalty == "full" else kl.kl_penalty(old, ref_lp, "k1")
        per_sequence = [reward_kl[i, mask[i].bool()].mean().item() for i in range(len(mask))]
        current = sum(per_sequence) / len(per_sequence)
        assert current > 0 and metrics["actor/reward_kl_penalty"] == pytest.approx(current, rel=1e-5)
        if cfg.algorithm.kl_ctrl.type == "adaptive":  # Ziegler et al.: one update with n_steps = prompts per step
            error = min(max(current / 0.01 - 1, -0.2), 0.2)
            assert kl_ctrl.value == pytest.approx(0.5 * (1 + error * cfg.data.train_batch_size / 40), rel=1e-6)
            assert kl_ctrl.value != 0.5


def test_old_logprobs_come_from_the_pass_only_where_nothing_else_has_them():
    """ppo.old_logprobs_source over the configurations that decide it (defaults: the KL panel on, k1 in the
    reward, one epoch of 4 mini-batches), without and with the sampler's log-probs kept."""
    quiet, no_reward, on_policy = "trainer.log_kl_panel=false", "algorithm.use_kl_in_reward=false", "actor.ppo_mini_batch_size=64"
    cases = [  # overrides, source without / with the sampler's log-probs, whether the rollout computes the exact KL
        ([], "pass", "pass", True),  # the panel's kl/full needs the actor's logits
        ([quiet], "pass", "sampler", False),  # k1 in the reward: needed before the update
        ([quiet, no_reward], "pass", "sampler", False),  # 4 optimizer steps: the tokens go off-policy
        ([quiet, no_reward, on_policy], "update", "update", False),
        ([quiet, no_reward, on_policy, "actor.use_kl_loss=true", "actor.kl_loss_type=full"], "update", "update", False),
        ([quiet, no_reward, on_policy, "actor.recompute_old_logprobs=always"], "pass", "pass", False),
        ([quiet, no_reward, on_policy, "actor.ppo_epochs=2"], "pass", "sampler", False),
        ([quiet, on_policy], "pass", "sampler", False),
        ([quiet, on_policy, "algorithm.kl_penalty=full"], "pass", "pass", True),  # the reward's exact KL
    ]
    for overrides, without, with_sampler, full in cases:
        cfg = load_config(None, overrides)
        assert (ppo.old_logprobs_source(cfg), ppo.old_logprobs_source(cfg, True)) == (without, with_sampler), overrides
        assert ppo.needs_rollout_full_kl(cfg) == full, overrides
    default = load_config(None, [])
    assert ppo.keeps_sampler_logprobs(default, "no") and not ppo.keeps_sampler_logprobs(default, "bf16")
    assert not ppo.keeps_sampler_logprobs(load_config(None, ["model.dtype=bfloat16"]), "no")
    assert ppo.keeps_sampler_logprobs(load_config(None, ["rollout.logprobs_from_sampler=true"]), "bf16")
    assert not ppo.keeps_sampler_logprobs(load_config(None, ["rollout.logprobs_from_sampler=false"]), "no")


ON_POLICY = {  # one epoch of one mini-batch of 8 (grpo: 16) responses in micro-batches of 2, no reward KL, no panel
    "grpo": ["algorithm.adv_estimator=grpo", "rollout.n=2", "actor.use_kl_loss=true", "actor.kl_loss_type=k3",
             "actor.kl_loss_off_policy_correction=true", "actor.kl_loss_coef=5.0"],
    "gae": ["actor.use_kl_loss=true", "actor.kl_loss_type=k3+", "actor.entropy_coeff=0.05"],
}


@pytest.mark.parametrize("case", ON_POLICY)
def test_an_exactly_on_policy_update_needs_no_old_logprob_pass(setup_run, case):
    """Without the old-log-prob pass (the update's own log-probs, detached, are the old ones) the update reaches
    the weights, old log-probs and metrics it reaches with the pass, and the reference PPO's weights."""
    cfg, accelerator, (actor, critic, ref), tokenizer, rows, sampled = setup_run(
        *ON_POLICY[case], "actor.ppo_epochs=1", "actor.ppo_mini_batch_size=8", "algorithm.use_kl_in_reward=false",
        "trainer.log_kl_panel=false", "rollout.logprobs_from_sampler=false")
    always = copy.deepcopy(cfg)
    always.actor.recompute_old_logprobs = "always"
    assert (ppo.old_logprobs_source(cfg), ppo.old_logprobs_source(always)) == ("update", "pass")
    kl_ctrl = kl.build_kl_controller("fixed", 0.5, 0.1, 1)
    runs = {}
    for name, c in (("skip", cfg), ("pass", always)):
        timer = Timer()
        torch.manual_seed(7)
        batch = train.rollout(c, accelerator, (actor, critic, ref), tokenizer, rows, timer)
        batch.update(group_ids=sampled["group_ids"], scores=sampled["scores"])
        assert ("old_logprobs" in batch) == ("timing_s/old_log_prob" in timer.metrics()) == (name == "pass")
        learned = copy.deepcopy(actor), copy.deepcopy(critic)
        metrics, skipped = sgd_update(c, accelerator, *learned, ref, batch, kl_ctrl)
        assert skipped == 0
        metrics.update(train.batch_metrics(c, accelerator, batch, tokenizer.eos_token_id))
        runs[name] = batch, learned, metrics
    (skip, skip_models, skip_metrics), (full, pass_models, pass_metrics) = runs["skip"], runs["pass"]
    assert torch.equal(skip["response_ids"], full["response_ids"])
    torch.testing.assert_close(skip["old_logprobs"], full["old_logprobs"])  # the update's own, at the rollout's weights
    expected = copy.deepcopy(actor), copy.deepcopy(critic)
    reference_update(always, *expected, ref, full, kl_ctrl.value, step=3)
    for start, model, with_pass, reference in zip((actor, critic), skip_models, pass_models, expected):
        if start is not None:
            assert (weights(with_pass) - weights(start)).abs().max() > 1e-4
            torch.testing.assert_close(weights(model), weights(with_pass), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(weights(model), weights(reference), rtol=1e-5, atol=1e-6)
    assert skip_metrics.keys() == pass_metrics.keys()
    for key, value in pass_metrics.items():
        assert skip_metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    assert skip_metrics["actor/ppo_kl"] == 0 and skip_metrics["actor/importance_ratio/max"] == 1  # exactly
    two_epochs = copy.deepcopy(cfg)  # a forward after an optimizer step is not at the rollout's weights
    two_epochs.actor.ppo_epochs = 2
    without = {key: value for key, value in skip.items() if key != "old_logprobs"}
    with pytest.raises(ValueError, match="not exactly on-policy"):
        sgd_update(two_epochs, accelerator, copy.deepcopy(actor), None, ref, without, kl_ctrl)


def test_the_sampler_logprobs_are_the_old_ones_or_are_compared_with_them(setup_run):
    """rollout.logprobs_from_sampler: with the pass (the KL panel on) both are kept and their mismatch logged, in
    float32 float noise; where only the sampler's are needed (two epochs, no panel) they are the old ones."""
    cfg, accelerator, models, tokenizer, rows, batch = setup_run("rollout.logprobs_from_sampler=true")
    assert "rollout_logprobs" in batch and "old_logprobs" in batch
    torch.testing.assert_close(batch["rollout_logprobs"], batch["old_logprobs"], rtol=0, atol=1e-4)
    batch["token_rewards"] = ppo.token_rewards(batch["scores"], batch["response_mask"])
    batch["advantages"] = batch["returns"] = torch.zeros(batch["response_mask"].shape)
    metrics = train.batch_metrics(cfg, accelerator, batch, tokenizer.eos_token_id)
    assert 0 < metrics["rollout/logprob_abs_diff/max"] < 1e-4 and 0 <= metrics["rollout/logprob_mismatch_kl"] < 1e-9
    timer = Timer()
    torch.manual_seed(3)
    cfg.trainer.log_kl_panel = False
    sampled = train.rollout(cfg, accelerator, models, tokenizer, rows, timer)
    assert ppo.old_logprobs_source(cfg, True) == "sampler" and "rollout_logprobs" not in sampled
    assert "timing_s/old_log_prob" not in timer.metrics() and "full_kl" not in sampled
    with torch.no_grad():
        recomputed = logprobs_and_logits(models[0], sampled, cfg.rollout.temperature)[0]
    mask = sampled["response_mask"].bool()
    torch.testing.assert_close(sampled["old_logprobs"][mask], recomputed[mask], rtol=0, atol=1e-4)


def test_rollout_forward_passes_are_the_models_at_the_sampling_temperature(setup_run):
    """Old and reference log-probs, the exact KL and the values of the whole batch (here computed in chunks of
    3 of 8), and the default reward's scores of the decoded responses (rewards.score_responses); the tokens are
    those `generate` samples with the configured temperature from the same seed."""
    cfg, accelerator, (actor, critic, ref), tokenizer, rows, _ = setup_run("algorithm.use_kl_in_reward=true")
    torch.manual_seed(123)
    batch = train.rollout(cfg, accelerator, (actor, critic, ref), tokenizer, rows, Timer())
    torch.manual_seed(123)
    prompt_ids, prompt_mask = left_pad(rows["input_ids"], tokenizer.pad_token_id)
    sampled = generate(actor, tokenizer, prompt_ids, prompt_mask, SamplingParams(16, temperature=0.7))
    assert torch.equal(batch["response_ids"], sampled["response_ids"])

    with torch.no_grad():
        logprobs, logits = logprobs_and_logits(actor, batch, 0.7)
        ref_logprobs, ref_logits = logprobs_and_logits(ref, batch, 0.7)
        torch.testing.assert_close(batch["old_logprobs"], logprobs)
        torch.testing.assert_close(batch["ref_logprobs"], ref_logprobs)
        torch.testing.assert_close(batch["full_kl"], kl.full_kl(logits, ref_logits, 0.7))
        torch.testing.assert_close(batch["values"], response_values(critic, batch))
    assert not torch.allclose(batch["old_logprobs"], logprobs_and_logits(actor, batch, 1.0)[0])
    texts = tokenizer.batch_decode(batch["response_ids"], skip_special_tokens=True)
    scores = rewards.score_responses(load_reward(cfg), tokenizer, batch, rows)
    assert scores.tolist() == [compute_score(t, g) for t, g in zip(texts, rows["ground_truth"])]


def test_batch_metrics_are_the_batch_numbers(setup_run):
    cfg, accelerator, _, tokenizer, _, batch = setup_run()
    mask = batch["response_mask"]
    batch["token_rewards"] = ppo.token_rewards(batch["scores"], mask, torch.full(mask.shape, 0.1), 1.0)
    batch["returns"] = batch["values"] + 1
    batch["advantages"] = torch.where(mask.bool(), torch.arange(mask.numel()).reshape(mask.shape).float(), 99.0)
    metrics = train.batch_metrics(cfg, accelerator, batch, tokenizer.eos_token_id)
    lengths = mask.sum(1).float()
    valid = batch["advantages"][mask.bool()]
    assert (metrics["critic/advantages/min"], metrics["critic/advantages/max"]) == (valid.min(), valid.max())
    assert metrics["critic/advantages/mean"] == pytest.approx(valid.mean().item())
    assert "critic/groups_with_equal_scores" not in metrics  # one response per prompt: no groups
    assert metrics["critic/score/mean"] == pytest.approx(0.5)
    assert metrics["critic/rewards/mean"] == pytest.approx((batch["scores"] - 0.1 * lengths).mean().item(), rel=1e-5)
    assert metrics["response_length/mean"] == pytest.approx(lengths.mean().item())
    assert metrics["kl/full"] == pytest.approx(core_algos.masked_mean(batch["full_kl"], mask).item(), rel=1e-5)
    d = batch["old_logprobs"] - batch["ref_logprobs"]
    assert metrics["kl/k1"] == pytest.approx(core_algos.masked_mean(d, mask).item(), rel=1e-5)
    assert metrics["kl/full"] > 0


def test_kl_panel_is_the_exact_kl_of_each_real_token_computed_by_hand(setup_run, monkeypatch):
    """The panel on a batch with padding on both sides (prompts of different lengths, responses that stopped
    early): kl/full, kl/full_forward and kl/k1 equal the KLs of the two models' next-token distributions at
    the sampling temperature, computed one unpadded sequence at a time in float64 and averaged over the real
    response tokens only."""
    cfg, accelerator, models, tokenizer, rows, sampled = setup_run()
    actor, _, ref = models
    # responses 1, 4 and 6 end at an EOS (at positions 0, 3 and 9), the rest run to the length limit
    response_ids = sampled["response_ids"].clone()
    for row, position in ((1, 0), (4, 3), (6, 9)):
        response_ids[row, position] = tokenizer.eos_token_id
        response_ids[row, position + 1:] = tokenizer.pad_token_id
    response_mask = response_mask_from_ids(response_ids, tokenizer.eos_token_id)
    fixed = build_batch(sampled["prompt_ids"], sampled["prompt_mask"], response_ids, response_mask)
    monkeypatch.setattr(train, "generate", lambda *args, **kwargs: dict(fixed))
    batch = train.rollout(cfg, accelerator, models, tokenizer, rows, Timer())
    mask = batch["response_mask"]
    assert mask.sum(1)[[1, 4, 6]].tolist() == [1, 4, 10] and (batch["prompt_mask"] == 0).any()
    batch["scores"] = sampled["scores"]
    batch["token_rewards"] = ppo.token_rewards(batch["scores"], mask)
    batch["advantages"] = batch["returns"] = torch.zeros(mask.shape)
    metrics = train.batch_metrics(cfg, accelerator, batch, tokenizer.eos_token_id)

    reverse, forward, k1 = [], [], []
    temperature = cfg.rollout.temperature
    for i in range(len(mask)):
        prompt = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()]
        response = batch["response_ids"][i][: int(mask[i].sum())]
        sequence = torch.cat([prompt, response])[None]
        with torch.no_grad():  # logits at the positions that predict the response tokens
            z = actor(input_ids=sequence).logits[0, len(prompt) - 1 : -1].double() / temperature
            u = ref(input_ids=sequence).logits[0, len(prompt) - 1 : -1].double() / temperature
        logp, logq = z.log_softmax(-1), u.log_softmax(-1)
        reverse += (logp.exp() * (logp - logq)).sum(-1).tolist()
        forward += (logq.exp() * (logq - logp)).sum(-1).tolist()
        k1 += (logp - logq).gather(-1, response[:, None])[:, 0].tolist()
    assert len(reverse) == mask.sum()
    assert metrics["kl/full"] == pytest.approx(sum(reverse) / len(reverse), rel=1e-4)
    assert metrics["kl/full_forward"] == pytest.approx(sum(forward) / len(forward), rel=1e-4)
    assert metrics["kl/k1"] == pytest.approx(sum(k1) / len(k1), rel=1e-4, abs=1e-6)
    assert metrics["kl/full_forward"] != pytest.approx(metrics["kl/full"], rel=1e-2)  # two different directions


def test_optimizers_take_each_models_settings(setup_run):
    cfg, _, (actor, critic, _), *_ = setup_run("actor.lr=3e-4", "critic.lr=2e-3", "actor.weight_decay=0.1",
                                               "critic.weight_decay=0.01")
    actor_opt, critic_opt = rlhf.setup.build_optimizers(cfg, actor, critic)
    assert [(g["lr"], g["weight_decay"]) for g in actor_opt.param_groups] == [(3e-4, 0.1)]
    assert [(g["lr"], g["weight_decay"]) for g in critic_opt.param_groups] == [(2e-3, 0.01)]
    assert actor_opt.param_groups[0]["params"] == list(actor.parameters())
    assert critic_opt.param_groups[0]["params"] == list(critic.parameters())


def test_train_step_samples_each_prompts_group_on_one_process(artifacts, tmp_path, monkeypatch):
    """rollout.n responses per prompt, in a row, with the prompt's group id, and advantages taken per group."""
    cfg = load_config(None, tiny_overrides(artifacts, str(tmp_path), "rollout.n=3", "algorithm.adv_estimator=rloo",
                                           "actor.ppo_micro_batch_size=3", "trainer.logger=none"))
    accelerator = Accelerator(cpu=True)
    run = rlhf.setup.setup(cfg, accelerator)
    seen = {}
    original = ppo.advantages

    def spy(algorithm, batch, reduce_sum):
        seen.update(batch)
        return original(algorithm, batch, reduce_sum)

    monkeypatch.setattr(ppo, "advantages", spy)
    metrics, *_ = train.train_step(cfg, accelerator, run, step=1, timer=Timer())
    assert seen["group_ids"].tolist() == [g for g in range(8) for _ in range(3)]
    prompts = seen["prompt_ids"].reshape(8, 3, -1)
    assert (prompts == prompts[:, :1]).all()  # the three responses of a group answer the same prompt
    assert len({tuple(p[0].tolist()) for p in prompts}) == 8
    assert run.models[1] is None and "critic/vf_loss" not in metrics and "critic/vf_explained_var" not in metrics
    assert 0.0 <= metrics["critic/groups_with_equal_scores"] <= 1.0

