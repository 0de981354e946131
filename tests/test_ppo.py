"""One PPO step (rlhf/step.py) against the one-file PPO (ppo.py), and the step's decisions by hand.

ppo.py is the algorithm written straight through: whole mini-batches, no micro-batches, no accelerate in the
update, the math inline. Given the trainer's batch, models and settings, its losses and gradients must be the
trainer's, and after a whole update with SGD optimizers in place of AdamW (so that the weights are a direct
function of the gradients, which AdamW's first step is not) so must its weights. The batches take every branch
of the update: three responses end early, with padding after the end (GAE must not bootstrap from it); stale
old log-probs put tokens in every region of the dual-clipped loss, for both signs of the advantage; the old
log-probs come from each source the plan can choose (the forward pass, the sampler, the update's own).
Where ppo.py has no counterpart (the other loss aggregations), the step's losses are held to core_algos' on
the whole mini-batch. Deleting or altering a line of ppo.py or of the step that changes what is learned makes a
test here fail. ppo.py as a program is tested last: its settings and optimizers are configs/tiny.yaml's, its
flags refuse what they do not understand, its own sampling and rollout passes are the trainer's, and its own
loop runs two steps.
"""

import copy
import dataclasses
import os
from types import SimpleNamespace

import pytest
import torch
import transformers
from accelerate import Accelerator
from helpers import REPO, tiny_overrides

import ppo
import rlhf.setup
import train
from rlhf import core_algos, kl, step
from rlhf.config import ActorConfig, load_config
from rlhf.rewards import load_reward, score_batch
from rlhf.rewards.gsm8k import compute_score
from rlhf.rollout import SamplingParams, Sequences, generate, left_pad, repeat_prompts, response_mask_from_ids
from rlhf.samples import sample_rows
from rlhf.tracking import Timer

pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------- the step's decisions by hand

ESTIMATOR_GRAD = {  # d estimator / d logprob, with d = logprob - ref_logprob (docs/kl.md)
    "k1": lambda d: torch.ones_like(d), "k2": lambda d: d, "k3": lambda d: 1 - torch.exp(-d),
    "abs": torch.sign, "k3+": lambda d: d, "low_var_kl+": lambda d: d, "full": None,
}


def actor_loss(cfg: ActorConfig, logprobs, old_logprobs, advantages, mask, entropy, ref_logprobs=None,
               exact_kl=None):
    """step.actor_loss on a micro-batch of these tensors, with the estimator `cfg` names (None without a KL
    loss), as step.plan_step parses it."""
    seq = Sequences.build(torch.zeros(len(mask), 1, dtype=torch.long), torch.ones(len(mask), 1, dtype=torch.long),
                          torch.zeros(mask.shape, dtype=torch.long), mask)
    zeros = torch.zeros(mask.shape)
    micro = step.Batch(seq=seq, group_ids=torch.arange(len(mask)), old_logprobs=old_logprobs, sampler_logprobs=None,
                       ref_logprobs=ref_logprobs, exact_kl=None, exact_forward_kl=None, old_values=zeros,
                       token_rewards=zeros, advantages=advantages, returns=zeros)
    return step.actor_loss(cfg, kl.parse_estimator(cfg.kl_loss_type) if cfg.use_kl_loss else None, micro,
                           step.ActorOutput(logprobs, entropy, exact_kl), core_algos.LossAgg(cfg.loss_agg_mode))


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
    loss, metrics = actor_loss(cfg, logprobs, old, advantages, mask, entropy, ref, full)
    loss.backward()

    pg_logprobs = logprobs.detach().requires_grad_()
    pg_loss, _ = core_algos.policy_loss(pg_logprobs, old, advantages, mask, cfg.clip_ratio, cfg.clip_ratio_c)
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
        actor_loss(cfg, logprobs, old, advantages, mask, torch.zeros(shape), ref)[0].backward()
        grads.append(logprobs.grad.clone())
    d, rho = logprobs.detach() - ref, torch.exp(logprobs.detach() - old)
    value = kl.kl_penalty(logprobs.detach(), ref, estimator)
    weighted = {"k3": rho * value + rho * (1 - torch.exp(-d)), "k1": rho * value + rho, "k3+": rho * d}[estimator]
    torch.testing.assert_close(grads[1] - grads[0],
                               0.7 * (weighted - ESTIMATOR_GRAD[estimator](d)) * mask / mask.sum())


def test_minibatches_cover_the_batch_once_per_epoch_in_an_order_fixed_by_seed_and_step():
    epochs = step.minibatches(8, 4, num_epochs=3, seed=7, step=5)
    assert len(epochs) == 6 and all(len(index) == 4 for index in epochs)
    for e in range(3):
        assert sorted(torch.cat(epochs[2 * e:2 * e + 2]).tolist()) == list(range(8))
    assert [i.tolist() for i in epochs] == [i.tolist() for i in step.minibatches(8, 4, 3, seed=7, step=5)]
    assert [i.tolist() for i in epochs] != [i.tolist() for i in step.minibatches(8, 4, 3, seed=7, step=6)]
    assert epochs[0].tolist() != epochs[2].tolist()  # a fresh permutation per epoch


def test_repeat_prompts_keeps_each_prompts_group_together():
    rows = {"input_ids": [[1], [2, 3]], "ground_truth": ["4", "5"]}
    repeated, group_ids = repeat_prompts(rows, 3)
    assert repeated == {"input_ids": [[1], [1], [1], [2, 3], [2, 3], [2, 3]], "ground_truth": ["4"] * 3 + ["5"] * 3}
    assert group_ids.tolist() == [0, 0, 0, 1, 1, 1]
    assert repeat_prompts(rows, 1)[0] == rows and repeat_prompts(rows, 1)[1].tolist() == [0, 1]


def test_when_to_evaluate_and_checkpoint():
    assert [s for s in range(1, 11) if train.should_evaluate(s, 10, test_freq=4)] == [4, 8, 10]
    assert [s for s in range(1, 11) if train.should_evaluate(s, 10, test_freq=0)] == [10]
    assert [s for s in range(1, 11) if train.should_checkpoint(s, 10, 3, stopping=False, bad_steps=0)] == [3, 6, 9, 10]
    assert [s for s in range(1, 11) if train.should_checkpoint(s, 10, 0, stopping=False, bad_steps=0)] == [10]
    assert train.should_checkpoint(4, 10, 0, stopping=True, bad_steps=0)
    assert not train.should_checkpoint(6, 10, 3, stopping=False, bad_steps=1)  # not during a run of bad steps
    assert train.should_checkpoint(10, 10, 3, stopping=False, bad_steps=1) and train.should_checkpoint(5, 10, 3, True, 2)


def test_old_logprobs_come_from_the_forward_pass_only_where_nothing_else_has_them():
    """step.old_logprobs_from over the configurations that decide it (defaults: the KL panel on, k1 in the
    reward, one epoch of 4 mini-batches), without and with the sampler's log-probs kept, and the plan's."""
    quiet, no_reward = "trainer.log_kl_panel=false", "algorithm.use_kl_in_reward=false"
    on_policy = "actor.ppo_mini_batch_size=64"
    cases = [  # overrides, source without / with the sampler's log-probs, whether the rollout computes the exact KL
        ([], "forward", "forward", True),  # the panel's kl/full needs the actor's logits
        ([quiet], "forward", "sampler", False),  # k1 in the reward: needed before the update
        ([quiet, no_reward], "forward", "sampler", False),  # 4 optimizer steps: the tokens go off-policy
        ([quiet, no_reward, on_policy], "update", "update", False),
        ([quiet, no_reward, on_policy, "actor.use_kl_loss=true", "actor.kl_loss_type=full"], "update", "update", False),
        ([quiet, no_reward, on_policy, "actor.recompute_old_logprobs=always"], "forward", "forward", False),
        ([quiet, no_reward, on_policy, "actor.ppo_epochs=2"], "forward", "sampler", False),
        ([quiet, on_policy], "forward", "sampler", False),
        ([quiet, on_policy, "algorithm.kl_penalty=full"], "forward", "forward", True),  # the reward's exact KL
    ]
    for overrides, without, with_sampler, full in cases:
        cfg = load_config(None, overrides)
        assert (step.old_logprobs_from(cfg), step.old_logprobs_from(cfg, True)) == (without, with_sampler), overrides
        plan = step.plan_step(cfg, "no")  # float32 weights without mixed precision: the sampler's are kept
        assert (plan.old_logprobs_from, plan.computes_exact_kl) == (with_sampler, full), overrides
    default = load_config(None, [])
    assert step.plan_step(default, "no").sampling.keep_logprobs
    assert not step.plan_step(default, "bf16").sampling.keep_logprobs
    bf16_base = ["model.dtype=bfloat16", "model.lora.rank=4", "model.lora.critic=true"]
    assert not step.plan_step(load_config(None, bf16_base), "no").sampling.keep_logprobs
    assert step.plan_step(load_config(None, ["rollout.logprobs_from_sampler=true"]), "bf16").sampling.keep_logprobs
    assert not step.plan_step(load_config(None, ["rollout.logprobs_from_sampler=false"]), "no").sampling.keep_logprobs
    plan = step.plan_step(load_config(None, ["actor.use_kl_loss=true", "actor.kl_loss_type=low_var_kl+"]), "no")
    assert plan.loss_kl is kl.parse_estimator("low_var_kl+") and plan.reward_kl is kl.parse_estimator("k1")
    assert step.plan_step(load_config(None, [no_reward]), "no").reward_kl is None


# ----------------------------------------------------------------------------- the step against ppo.py

CASES = {
    # reward KL (adaptive coefficient: it moves after the update), k3+ in the loss, entropy bonus
    "reward_k1+loss_k3+": ["algorithm.use_kl_in_reward=true", "algorithm.kl_penalty=k1", "actor.use_kl_loss=true",
                           "actor.kl_loss_type=k3+", "actor.entropy_coeff=0.05", "algorithm.kl_ctrl.type=adaptive",
                           "algorithm.kl_ctrl.horizon=40", "algorithm.kl_ctrl.target_kl=0.01"],
    # the exact KL in both places, a tight gradient clip
    "full_both": ["algorithm.use_kl_in_reward=true", "algorithm.kl_penalty=full", "actor.use_kl_loss=true",
                  "actor.kl_loss_type=full", "actor.grad_clip=0.05", "critic.grad_clip=0.05"],
    # k3+ with the off-policy correction (the tokens are off-policy after the first optimizer step)
    "loss_k3+_corrected": ["algorithm.use_kl_in_reward=false", "actor.use_kl_loss=true", "actor.kl_loss_type=k3+",
                           "actor.kl_loss_off_policy_correction=true", "actor.kl_loss_coef=5.0"],
    # k3 in the loss only, no gradient clipping (it would hide the losses' scale), k2 in the reward
    "loss_k3_reward_k2": ["algorithm.use_kl_in_reward=true", "algorithm.kl_penalty=k2", "actor.use_kl_loss=true",
                          "actor.kl_loss_type=k3", "actor.grad_clip=1e6", "critic.grad_clip=1e6"],
    # no KL panel: the old log-probs are the sampler's (plan "sampler"), and they are the ratio's
    "sampler_reward_k3": ["trainer.log_kl_panel=false", "algorithm.use_kl_in_reward=true", "algorithm.kl_penalty=k3",
                          "actor.use_kl_loss=true", "actor.kl_loss_type=k1", "actor.grad_clip=1e6",
                          "critic.grad_clip=1e6"],
}
SOURCES = {"sampler_reward_k3": "sampler"}  # the others: "forward" (the KL panel needs the actor's logits)
COMMON = ["algorithm.gamma=0.9", "algorithm.lam=0.8", "algorithm.kl_ctrl.kl_coef=0.5", "actor.kl_loss_coef=0.5",
          "actor.ppo_epochs=2", "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size=2",
          "rollout.temperature=0.7", "rollout.log_prob_micro_batch_size=3", "trainer.logger=none"]
LR = 0.05
SCORES = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0]  # the tiny model scores 0: by hand, each kind of group when n > 1


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=LR)


def weights(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def gradients(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.fixture
def setup_run(artifacts, tmp_path):
    """A config, an accelerator, the trainer's models, prompt rows, a rollout batch and scores with every kind
    of group (mixed, all 0, all 1) when n > 1. The actor is perturbed so that it differs from the reference
    (else every KL is 0), and the critic's head so that the values are not all 0 (else GAE could not tell
    gamma from lambda, nor value clipping act). Three responses end early (`ended_early`)."""

    def make(*extra, short=True):
        cfg = load_config(None, tiny_overrides(artifacts, str(tmp_path), *COMMON, *extra))
        accelerator = Accelerator(cpu=True)
        tokenizer, train_set, _, actor, critic, ref = rlhf.setup.prepare_data_and_models(cfg, accelerator)
        torch.manual_seed(0)
        with torch.no_grad():
            for p in actor.parameters():
                p.add_(0.05 * torch.randn_like(p))
            if critic is not None:
                critic.score.weight.normal_(std=0.1)
        rows, group_ids = repeat_prompts(train_set[list(range(cfg.data.train_batch_size))], cfg.rollout.n)
        batch = rollout(cfg, accelerator, (actor, critic, ref), tokenizer, rows, group_ids, short=short)
        return cfg, accelerator, (actor, critic, ref), tokenizer, rows, batch, torch.tensor(SCORES * cfg.rollout.n)

    return make


def rollout(cfg, accelerator, models, tokenizer, rows, group_ids, timer=None, short=True) -> step.Batch:
    """The step's sampling and forward passes with the config's plan, as a Batch whose rewards, advantages and
    returns are still 0 (`with_advantages` computes them); `short`: three responses end early (`ended_early`)."""
    plan, timer = step.plan_step(cfg, accelerator.mixed_precision), timer or Timer()
    with pytest.MonkeyPatch.context() as patch:
        if short:
            sampled = step.generate
            patch.setattr(step, "generate", lambda *a, **k: ended_early(sampled(*a, **k), tokenizer))
        prompt_ids, prompt_mask = left_pad(rows["input_ids"], tokenizer.pad_token_id)
        seq = step.generate(models[0], tokenizer, prompt_ids, prompt_mask, plan.sampling)
    passes = step.forward_passes(cfg, plan, accelerator, models, seq, timer)
    zeros = torch.zeros(seq.response_mask.shape)
    return step.Batch(seq=seq, group_ids=group_ids, old_logprobs=passes.old_logprobs, sampler_logprobs=seq.logprobs,
                      ref_logprobs=passes.ref_logprobs, exact_kl=passes.exact_kl,
                      exact_forward_kl=passes.exact_forward_kl, old_values=passes.old_values, token_rewards=zeros,
                      advantages=zeros, returns=zeros)


def with_advantages(cfg, plan, batch: step.Batch, scores, kl_coef) -> step.Batch:
    """`batch` with the token rewards, advantages and returns train_step computes (one process)."""
    a, mask = cfg.algorithm, batch.seq.response_mask
    reward_kl = None if plan.reward_kl is None else plan.reward_kl(batch.old_logprobs, batch.ref_logprobs,
                                                                   batch.exact_kl)
    token_rewards = core_algos.token_rewards(scores, mask, reward_kl, kl_coef)
    advantages, returns = core_algos.ADV_ESTIMATOR_REGISTRY[a.adv_estimator](
        token_rewards, batch.old_values, mask, batch.group_ids, a, lambda x: x)
    return dataclasses.replace(batch, token_rewards=token_rewards, advantages=advantages, returns=returns)


def ended_early(seq: Sequences, tokenizer) -> Sequences:
    """`seq` with responses 1, 4 and 6 ended by an end-of-sequence token at positions 0, 3 and 9, padded after
    it (the tiny model never samples one): the last token of a response is then followed by padding, where GAE
    must not bootstrap and no loss may count. The sampler's log-probs, where kept, are 0 after the end."""
    response_ids = seq.response_ids.clone()
    for row, position in ((1, 0), (4, 3), (6, 9)):
        response_ids[row, position] = tokenizer.eos_token_id
        response_ids[row, position + 1:] = tokenizer.pad_token_id
    mask = response_mask_from_ids(response_ids, tokenizer.eos_token_id)
    logprobs = None if seq.logprobs is None else torch.where(mask.bool(), seq.logprobs, 0.0)
    return Sequences.build(seq.prompt_ids, seq.prompt_mask, response_ids, mask, logprobs)


def stale(batch: step.Batch, scale: float = 1.0) -> torch.Tensor:
    """Old log-probs far from the actor's (seeded noise of std `scale` added): ratios on both sides of
    1 +- clip_ratio and past clip_ratio_c, so that every branch of the clipped loss is taken from the first
    mini-batch on. The same tensor goes to both implementations."""
    noise = torch.randn(batch.old_logprobs.shape, generator=torch.Generator().manual_seed(5))
    return batch.old_logprobs + scale * noise


def assert_every_clip_branch(ratio, advantages, mask, clip_ratio=0.2, clip_ratio_c=3.0):
    """Valid tokens in each region of the dual-clipped loss: A > 0 below, inside and above the clip range,
    A < 0 below it, inside it, between 1 + clip_ratio and clip_ratio_c, and past clip_ratio_c (the dual clip)."""
    valid = mask.bool()
    pos, neg = valid & (advantages > 0), valid & (advantages < 0)
    low, high, capped = ratio < 1 - clip_ratio, ratio > 1 + clip_ratio, ratio > clip_ratio_c
    inside = ~low & ~high
    regions = {"A>0 low": pos & low, "A>0 inside": pos & inside, "A>0 high": pos & high, "A<0 low": neg & low,
               "A<0 inside": neg & inside, "A<0 high": neg & high & ~capped, "A<0 past c": neg & capped}
    assert all(region.any() for region in regions.values()), str({k: int(v.sum()) for k, v in regions.items()})


def one_file(cfg) -> ppo.Args:
    """ppo.py's settings for the trainer's config (ppo.py covers GAE, one response per prompt, the token mean, one
    grad_clip and one weight_decay for both models)."""
    a, ac, t = cfg.algorithm, cfg.actor, cfg.trainer
    assert (a.adv_estimator, cfg.rollout.n, ac.loss_agg_mode) == ("gae", 1, "token-mean")
    assert ac.grad_clip == cfg.critic.grad_clip and ac.weight_decay == cfg.critic.weight_decay
    return ppo.Args(seed=t.seed, total_steps=t.total_steps, batch_size=cfg.data.train_batch_size,
                    max_response_length=cfg.data.max_response_length, actor_lr=ac.lr, critic_lr=cfg.critic.lr,
                    weight_decay=ac.weight_decay, eval_every=t.test_freq, cache_dir=t.cache_dir,
                    temperature=cfg.rollout.temperature, ppo_epochs=ac.ppo_epochs,
                    mini_batch_size=ac.ppo_mini_batch_size, clip_ratio=ac.clip_ratio, clip_ratio_c=ac.clip_ratio_c,
                    cliprange_value=cfg.critic.cliprange_value, grad_clip=ac.grad_clip, gamma=a.gamma, lam=a.lam,
                    reward_kl=a.kl_penalty if a.use_kl_in_reward else None, reward_kl_coef=a.kl_ctrl.kl_coef,
                    loss_kl=ac.kl_loss_type if ac.use_kl_loss else None, loss_kl_coef=ac.kl_loss_coef,
                    off_policy_correction=ac.kl_loss_off_policy_correction, entropy_coeff=ac.entropy_coeff)


def one_file_batch(batch: step.Batch, scores) -> dict:
    """The trainer's rollout batch as ppo.py's (the same tensors, by its names)."""
    seq = batch.seq
    tensors = {"input_ids": seq.input_ids, "attention_mask": seq.attention_mask, "position_ids": seq.position_ids,
               "response_ids": seq.response_ids, "response_mask": seq.response_mask, "scores": scores,
               "old_logprobs": batch.old_logprobs, "ref_logprobs": batch.ref_logprobs, "full_kl": batch.exact_kl,
               "values": batch.old_values}
    if batch.exact_kl is None:  # no exact KL without the panel: NaN, so that an estimator reading it would show
        tensors["full_kl"] = torch.full(seq.response_mask.shape, float("nan"))
    return {name: tensor for name, tensor in tensors.items() if tensor is not None}


def assert_old_logprobs_source(cfg, batch: step.Batch, source: str):
    """The plan takes the old log-probs from `source`, and the rollout batch holds them: the sampler's own
    tensor, or the forward pass's (then the sampler's are kept beside them, to compare)."""
    assert step.plan_step(cfg, "no").old_logprobs_from == source
    if source == "sampler":
        assert batch.old_logprobs is batch.seq.logprobs is batch.sampler_logprobs
    else:
        assert batch.old_logprobs is not None and batch.sampler_logprobs is batch.seq.logprobs


def trainer_update(cfg, accelerator, models, batch, scores, kl_coef, seen=None, at_step=3):
    """The step's advantages and PPO epochs (at step `at_step`) on `batch`, with SGD optimizers, in place on the models;
    `seen` (a dict) gets the gradients each optimizer step starts from and the losses each backward takes.
    Returns (the batch with its advantages (and, where the plan says "update", the update's own old log-probs),
    metrics, skipped updates)."""
    actor, critic, ref = models
    learners = [actor] + ([critic] if critic is not None else [])
    prepared = accelerator.prepare(*learners, *[sgd(model) for model in learners])
    half = len(prepared) // 2
    models = (prepared[0], prepared[1] if half == 2 else None, ref)
    optimizers = (prepared[half], prepared[3] if half == 2 else None)
    plan = step.plan_step(cfg, accelerator.mixed_precision)
    batch = with_advantages(cfg, plan, batch, scores, kl_coef)
    original_steps, original_backward = step.optimizer_steps, accelerator.backward

    def optimizer_steps(accelerator, learners, finite):
        for name, model, *_ in learners:
            seen.setdefault(name, []).append(gradients(model).clone())
        return original_steps(accelerator, learners, finite)

    def backward(loss):
        seen.setdefault("losses", []).append(loss.item())
        return original_backward(loss)

    with pytest.MonkeyPatch.context() as patch:
        if seen is not None:
            patch.setattr(step, "optimizer_steps", optimizer_steps)
            patch.setattr(accelerator, "backward", backward)
        run = SimpleNamespace(models=models, optimizers=optimizers)
        metrics, skipped = step.ppo_update(cfg, plan, accelerator, run, batch, at_step, Timer())
    return batch, metrics, skipped


@pytest.mark.parametrize("case", CASES)
def test_the_one_file_ppo_has_the_trainers_advantages_losses_and_gradients(setup_run, case):
    """One mini-batch of all 8 responses, in the trainer's micro-batches of 2: the advantages and returns, the
    actor's and the critic's loss (the trainer's: its micro-batches' summed) and both models' gradients are
    ppo.py's on the whole mini-batch. Stale old log-probs put tokens in every region of the clipped loss."""
    cfg, accelerator, models, _, _, batch, scores = setup_run(*CASES[case], "actor.ppo_epochs=1",
                                                              "actor.ppo_mini_batch_size=8")
    actor, critic, ref = models
    assert_old_logprobs_source(cfg, batch, SOURCES.get(case, "forward"))
    batch.old_logprobs = stale(batch)
    args, expected = one_file(cfg), one_file_batch(batch, scores)
    expected["advantages"], expected["returns"] = ppo.advantages_and_returns(args, expected)
    start = copy.deepcopy(actor), copy.deepcopy(critic)
    actor_loss, critic_loss = ppo.losses(args, *start, ref, expected)
    (actor_loss + critic_loss).backward()

    seen = {}
    with torch.no_grad():
        logprobs = step.logprobs_and_logits(actor, batch.seq, cfg.rollout.temperature)[0]
    batch, metrics, skipped = trainer_update(cfg, accelerator, models, batch, scores,
                                                cfg.algorithm.kl_ctrl.kl_coef, seen)
    assert skipped == 0 and metrics["actor/pg_clipfrac_lower"] > 0
    assert_every_clip_branch(torch.exp(logprobs - batch.old_logprobs), batch.advantages, batch.seq.response_mask)
    mask = batch.seq.response_mask.bool()
    torch.testing.assert_close(batch.advantages, expected["advantages"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(batch.returns, expected["returns"])
    assert len(seen["losses"]) == 8 and abs(expected["advantages"][mask]).max() > 0.5  # 4 micro-batches x 2 models
    assert sum(seen["losses"][0::2]) == pytest.approx(actor_loss.item(), rel=1e-4, abs=1e-6)
    assert sum(seen["losses"][1::2]) == pytest.approx(critic_loss.item(), rel=1e-4, abs=1e-6)
    for name, model in zip(("actor", "critic"), start):
        ours, theirs = seen[name][0], gradients(model)
        assert theirs.abs().max() > 1e-3
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5 * theirs.abs().max().item())


UPDATE_STEP = 1  # its epochs split the 8 responses into different mini-batches (at step 3 the first two do not)


@pytest.mark.parametrize("case", CASES)
def test_an_update_reaches_the_weights_of_the_one_file_ppo(setup_run, case):
    """Two epochs of two mini-batches each, from stale old log-probs: ppo.update visits the trainer's mini-batches
    (step.minibatches: a fresh order each epoch) in its order, and the two updates reach the same weights."""
    cfg, accelerator, models, _, _, batch, scores = setup_run(*CASES[case])
    actor, critic, ref = models
    ac = cfg.actor
    order = [index.tolist() for index in step.minibatches(len(scores), ac.ppo_mini_batch_size, ac.ppo_epochs,
                                                          cfg.trainer.seed, UPDATE_STEP)]
    per_epoch = len(order) // ac.ppo_epochs
    epochs = {frozenset(map(frozenset, order[e * per_epoch:(e + 1) * per_epoch])) for e in range(ac.ppo_epochs)}
    assert ac.ppo_epochs > 1 and per_epoch > 1 and len(epochs) == ac.ppo_epochs  # no two epochs share mini-batches
    assert_old_logprobs_source(cfg, batch, SOURCES.get(case, "forward"))
    batch.old_logprobs = stale(batch)
    expected_models = copy.deepcopy(actor), copy.deepcopy(critic)
    args, expected = one_file(cfg), one_file_batch(batch, scores)
    expected["advantages"], expected["returns"] = ppo.advantages_and_returns(args, expected)
    expected["row"] = torch.arange(len(scores))  # each mini-batch carries its rows' indices
    visited, losses = [], ppo.losses

    def recording_losses(args, actor, critic, ref, mb):
        visited.append(mb["row"].tolist())
        return losses(args, actor, critic, ref, mb)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ppo, "losses", recording_losses)
        ppo.update(args, *expected_models, ref, [sgd(model) for model in expected_models], expected, UPDATE_STEP)
    assert visited == order

    start = [weights(model) for model in (actor, critic)]
    _, metrics, skipped = trainer_update(cfg, accelerator, models, batch, scores, cfg.algorithm.kl_ctrl.kl_coef,
                                         at_step=UPDATE_STEP)
    assert skipped == 0 and "critic/vf_loss" in metrics
    for model, expected_model, before in zip((actor, critic), expected_models, start):
        moved = (weights(expected_model) - before).abs().max().item()
        assert moved > 1e-4  # ~100x the tolerance, so the comparison means something
        torch.testing.assert_close(weights(model), weights(expected_model), rtol=1e-5, atol=1e-6)


AGGREGATIONS = [("gae", mode) for mode in core_algos.LOSS_AGG_MODES] + [("grpo", "seq-mean-token-sum-norm")]


@pytest.mark.parametrize("estimator, mode", AGGREGATIONS)
def test_micro_batches_add_up_to_their_mini_batch(setup_run, estimator, mode):
    """Every loss aggregation, and grpo's groups: the update in micro-batches of 2 reaches the weights of the
    same update with each mini-batch in one micro-batch (the normalisers are the whole mini-batch's)."""
    n = 2 if estimator == "grpo" else 1
    cfg, accelerator, models, _, _, batch, scores = setup_run(
        f"algorithm.adv_estimator={estimator}", f"rollout.n={n}", f"actor.loss_agg_mode={mode}",
        "actor.use_kl_loss=true", "actor.kl_loss_type=k3", "actor.entropy_coeff=0.05", "actor.grad_clip=1e6",
        "critic.grad_clip=1e6")
    whole = copy.deepcopy(cfg)
    whole.actor.ppo_micro_batch_size = cfg.actor.ppo_mini_batch_size * n
    learning = [m for m in models[:2] if m is not None]
    assert len(learning) == (1 if estimator == "grpo" else 2)
    reached = []
    for c in (cfg, whole):
        learners = [copy.deepcopy(m) for m in models[:2]]
        trainer_update(c, accelerator, (*learners, models[2]), batch, scores, 0.5)
        reached.append([weights(m) for m in learners if m is not None])
    for start, micro, one in zip(learning, *reached):
        moved = (one - weights(start)).abs().max().item()  # the sums over tokens move the weights far: relative to it
        assert moved > 1e-4
        torch.testing.assert_close(micro, one, rtol=1e-5, atol=1e-4 * moved)


@pytest.mark.parametrize("mode", core_algos.LOSS_AGG_MODES)
def test_the_updates_losses_are_the_whole_mini_batchs_in_every_aggregation(setup_run, mode):
    """One mini-batch of all 8 responses in micro-batches of 2, from stale old log-probs: the losses the update
    back-propagates (its micro-batches', summed) are step.actor_loss and core_algos.value_loss on the whole
    mini-batch with the aggregation's own counts (no normalisers passed): the normalisers the step computes
    (tokens, sequences, the padded length) are the mini-batch's. ppo.py has the token mean only."""
    cfg, accelerator, models, _, _, batch, scores = setup_run(
        f"actor.loss_agg_mode={mode}", "actor.use_kl_loss=true", "actor.kl_loss_type=k3", "actor.entropy_coeff=0.05",
        "actor.ppo_epochs=1", "actor.ppo_mini_batch_size=8")
    actor, critic, _ = models
    batch.old_logprobs = stale(batch)
    with torch.no_grad():
        logprobs, logits = step.logprobs_and_logits(actor, batch.seq, cfg.rollout.temperature)
        values = step.response_values(critic, batch.seq)
    seen = {}
    batch, *_ = trainer_update(cfg, accelerator, models, batch, scores, cfg.algorithm.kl_ctrl.kl_coef, seen)
    mask, entropy = batch.seq.response_mask, core_algos.entropy_from_logits(logits, cfg.rollout.temperature)
    expected, _ = actor_loss(cfg.actor, logprobs, batch.old_logprobs, batch.advantages, mask, entropy,
                             batch.ref_logprobs)
    expected_vf, _ = core_algos.value_loss(values, batch.old_values, batch.returns, mask, cfg.critic.cliprange_value,
                                           core_algos.LossAgg(mode))
    assert len(seen["losses"]) == 8  # 4 micro-batches x 2 models
    assert sum(seen["losses"][0::2]) == pytest.approx(expected.item(), rel=1e-4, abs=1e-6)
    assert sum(seen["losses"][1::2]) == pytest.approx(expected_vf.item(), rel=1e-4, abs=1e-6)


ON_POLICY = {  # one epoch of one mini-batch of 8 (grpo: 16) responses in micro-batches of 2, no reward KL, no panel
    "grpo": ["algorithm.adv_estimator=grpo", "rollout.n=2", "actor.use_kl_loss=true", "actor.kl_loss_type=k3",
             "actor.kl_loss_off_policy_correction=true", "actor.kl_loss_coef=5.0"],
    "gae": ["actor.use_kl_loss=true", "actor.kl_loss_type=k3+", "actor.entropy_coeff=0.05"],
}


@pytest.mark.parametrize("case", ON_POLICY)
def test_an_exactly_on_policy_update_needs_no_old_logprob_pass(setup_run, case):
    """Without the old-log-prob pass (the update's own log-probs, detached, are the old ones) the update reaches
    the weights, old log-probs and metrics it reaches with the pass, and (gae) ppo.py's weights."""
    cfg, accelerator, models, tokenizer, rows, sampled, scores = setup_run(
        *ON_POLICY[case], "actor.ppo_epochs=1", "actor.ppo_mini_batch_size=8", "algorithm.use_kl_in_reward=false",
        "trainer.log_kl_panel=false", "rollout.logprobs_from_sampler=false")
    always = copy.deepcopy(cfg)
    always.actor.recompute_old_logprobs = "always"
    assert (step.old_logprobs_from(cfg), step.old_logprobs_from(always)) == ("update", "forward")
    scored = score_batch(load_reward(cfg), tokenizer, sampled.seq, rows)
    scored.scores = scores
    runs = {}
    for name, c in (("skip", cfg), ("pass", always)):
        timer = Timer()
        torch.manual_seed(7)
        batch = rollout(c, accelerator, models, tokenizer, rows, sampled.group_ids, timer)
        # without the pass there are no old log-probs before the update: it takes its own
        passed = "timing_s/old_log_prob" in timer.metrics()
        assert (batch.old_logprobs is not None) == passed == (name == "pass")
        learned = copy.deepcopy(models[0]), copy.deepcopy(models[1])
        used, actor_loss = [], step.actor_loss  # the old log-probs of each micro-batch's loss, in the update's order
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(step, "actor_loss", lambda ac, kl, micro, *rest: (used.append(micro.old_logprobs),
                                                                             actor_loss(ac, kl, micro, *rest))[1])
            batch, metrics, skipped = trainer_update(c, accelerator, (*learned, models[2]), batch, scores, 0.5)
        assert skipped == 0 and torch.cat(used).lt(0).all()  # log-probs, from one source or the other
        plan = step.plan_step(c, accelerator.mixed_precision)
        metrics.update(step.batch_metrics(c, plan, accelerator, batch, scored, tokenizer.eos_token_id))
        runs[name] = batch, torch.cat(used), learned, metrics
    (skip, skip_old, skip_models, skip_metrics), (full, pass_old, pass_models, pass_metrics) = runs["skip"], runs["pass"]
    assert torch.equal(skip.seq.response_ids, full.seq.response_ids)
    torch.testing.assert_close(skip_old, pass_old)  # the update's own, at the rollout's weights
    expected = copy.deepcopy(models[0]), copy.deepcopy(models[1])
    if case == "gae":
        args = one_file(always)
        expected_batch = one_file_batch(full, scores)
        expected_batch["advantages"], expected_batch["returns"] = ppo.advantages_and_returns(args, expected_batch)
        ppo.update(args, *expected, models[2], [sgd(model) for model in expected], expected_batch, step=3)
    for start, model, with_pass, reference in zip(models[:2], skip_models, pass_models, expected):
        if start is not None:
            assert (weights(with_pass) - weights(start)).abs().max() > 1e-4
            torch.testing.assert_close(weights(model), weights(with_pass), rtol=1e-5, atol=1e-6)
            if case == "gae":
                torch.testing.assert_close(weights(model), weights(reference), rtol=1e-5, atol=1e-6)
    assert skip_metrics.keys() == pass_metrics.keys()
    for key, value in pass_metrics.items():
        assert skip_metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    assert skip_metrics["actor/ppo_kl"] == 0 and skip_metrics["actor/importance_ratio/max"] == 1  # exactly


# ----------------------------------------------------------------------------- the rollout and the metrics


def test_the_sampler_logprobs_are_the_old_ones_or_are_compared_with_them(setup_run):
    """rollout.logprobs_from_sampler: with the pass (the KL panel on) both are kept and their mismatch logged, in
    float32 float noise; where only the sampler's are needed (two epochs, no panel) they are the old ones."""
    cfg, accelerator, models, tokenizer, rows, batch, scores = setup_run("rollout.logprobs_from_sampler=true",
                                                                          short=False)
    assert batch.sampler_logprobs is not None and batch.old_logprobs is not None
    torch.testing.assert_close(batch.sampler_logprobs, batch.old_logprobs, rtol=0, atol=1e-4)
    batch.token_rewards = core_algos.token_rewards(scores, batch.seq.response_mask)
    batch.advantages = batch.returns = torch.zeros(batch.seq.response_mask.shape)
    scored = score_batch(load_reward(cfg), tokenizer, batch.seq, rows)
    metrics = step.batch_metrics(cfg, step.plan_step(cfg, "no"), accelerator, batch, scored, tokenizer.eos_token_id)
    assert 0 < metrics["rollout/logprob_abs_diff/max"] < 1e-4 and 0 <= metrics["rollout/logprob_mismatch_kl"] < 1e-9
    timer = Timer()
    torch.manual_seed(3)
    cfg.trainer.log_kl_panel = False
    sampled = rollout(cfg, accelerator, models, tokenizer, rows, batch.group_ids, timer, short=False)
    assert step.plan_step(cfg, "no").old_logprobs_from == "sampler"
    assert sampled.old_logprobs is sampled.sampler_logprobs
    assert "timing_s/old_log_prob" not in timer.metrics() and sampled.exact_kl is None
    metrics = step.batch_metrics(cfg, step.plan_step(cfg, "no"), accelerator, sampled, scored, tokenizer.eos_token_id)
    assert not any(key.startswith("rollout/logprob") for key in metrics)  # nothing to compare them with
    with torch.no_grad():
        recomputed = step.logprobs_and_logits(models[0], sampled.seq, cfg.rollout.temperature)[0]
    mask = sampled.seq.response_mask.bool()
    torch.testing.assert_close(sampled.old_logprobs[mask], recomputed[mask], rtol=0, atol=1e-4)
    # Exactly on policy (one epoch, one mini-batch): the update's own are the old ones, and the update compares
    cfg.actor.ppo_epochs, cfg.actor.ppo_mini_batch_size = 1, cfg.data.train_batch_size
    cfg.algorithm.use_kl_in_reward = False
    on_policy = rollout(cfg, accelerator, models, tokenizer, rows, batch.group_ids, Timer(), short=False)
    assert step.plan_step(cfg, "no").old_logprobs_from == "update" and on_policy.old_logprobs is None
    learned = copy.deepcopy(models[0]), copy.deepcopy(models[1]), models[2]
    _, metrics, _ = trainer_update(cfg, accelerator, learned, on_policy, scores, 0.5)
    assert 0 < metrics["rollout/logprob_abs_diff/max"] < 1e-4 and 0 <= metrics["rollout/logprob_mismatch_kl"] < 1e-9


def test_rollout_forward_passes_are_the_models_at_the_sampling_temperature(setup_run):
    """Old and reference log-probs, the exact KL and the values of the whole batch (here computed in chunks of
    3 of 8), and the default reward's scores of the decoded responses (rewards.score_batch); the tokens are
    those `generate` samples with the configured temperature from the same seed."""
    cfg, accelerator, (actor, critic, ref), tokenizer, rows, first, _ = setup_run("algorithm.use_kl_in_reward=true")
    torch.manual_seed(123)
    batch = rollout(cfg, accelerator, (actor, critic, ref), tokenizer, rows, first.group_ids, short=False)
    torch.manual_seed(123)
    prompt_ids, prompt_mask = left_pad(rows["input_ids"], tokenizer.pad_token_id)
    sampled = generate(actor, tokenizer, prompt_ids, prompt_mask, SamplingParams(16, temperature=0.7))
    assert torch.equal(batch.seq.response_ids, sampled.response_ids)

    with torch.no_grad():
        logprobs, logits = step.logprobs_and_logits(actor, batch.seq, 0.7)
        ref_logprobs, ref_logits = step.logprobs_and_logits(ref, batch.seq, 0.7)
        torch.testing.assert_close(batch.old_logprobs, logprobs)
        torch.testing.assert_close(batch.ref_logprobs, ref_logprobs)
        torch.testing.assert_close(batch.exact_kl, kl.full_kl(logits, ref_logits, 0.7))
        torch.testing.assert_close(batch.old_values, step.response_values(critic, batch.seq))
    assert not torch.allclose(batch.old_logprobs, step.logprobs_and_logits(actor, batch.seq, 1.0)[0])
    texts = tokenizer.batch_decode(batch.seq.response_ids, skip_special_tokens=True)
    scores = score_batch(load_reward(cfg), tokenizer, batch.seq, rows).scores
    assert scores.tolist() == [compute_score(t, g) for t, g in zip(texts, rows["ground_truth"])]


def test_batch_metrics_are_the_batch_numbers(setup_run):
    cfg, accelerator, _, tokenizer, rows, batch, scores = setup_run()
    mask = batch.seq.response_mask
    batch.token_rewards = core_algos.token_rewards(scores, mask, torch.full(mask.shape, 0.1), 1.0)
    batch.returns = batch.old_values + 1
    batch.advantages = torch.where(mask.bool(), torch.arange(mask.numel()).reshape(mask.shape).float(), 99.0)
    scored = score_batch(load_reward(cfg), tokenizer, batch.seq, rows)
    scored.scores = scores
    metrics = step.batch_metrics(cfg, step.plan_step(cfg, "no"), accelerator, batch, scored, tokenizer.eos_token_id)
    lengths = mask.sum(1).float()
    valid = batch.advantages[mask.bool()]
    assert (metrics["critic/advantages/min"], metrics["critic/advantages/max"]) == (valid.min(), valid.max())
    assert metrics["critic/advantages/mean"] == pytest.approx(valid.mean().item())
    assert "critic/groups_with_equal_scores" not in metrics  # one response per prompt: no groups
    assert metrics["critic/score/mean"] == pytest.approx(0.5)
    assert metrics["critic/rewards/mean"] == pytest.approx((scores - 0.1 * lengths).mean().item(), rel=1e-5)
    assert metrics["response_length/mean"] == pytest.approx(lengths.mean().item())
    assert metrics["kl/full"] == pytest.approx(core_algos.masked_mean(batch.exact_kl, mask).item(), rel=1e-5)
    d = batch.old_logprobs - batch.ref_logprobs
    assert metrics["kl/k1"] == pytest.approx(core_algos.masked_mean(d, mask).item(), rel=1e-5)
    assert metrics["kl/full"] > 0


def test_kl_panel_is_the_exact_kl_of_each_real_token_computed_by_hand(setup_run):
    """The panel on a batch with padding on both sides (prompts of different lengths, responses that stopped
    early): kl/full, kl/full_forward and kl/k1 equal the KLs of the two models' next-token distributions at
    the sampling temperature, computed one unpadded sequence at a time in float64 and averaged over the real
    response tokens only."""
    cfg, accelerator, models, tokenizer, rows, batch, scores = setup_run()  # responses 1, 4, 6 end early
    actor, _, ref = models
    mask = batch.seq.response_mask
    assert mask.sum(1)[[1, 4, 6]].tolist() == [1, 4, 10] and (batch.seq.prompt_mask == 0).any()
    batch.token_rewards = core_algos.token_rewards(scores, mask)
    batch.advantages = batch.returns = torch.zeros(mask.shape)
    scored = score_batch(load_reward(cfg), tokenizer, batch.seq, rows)
    metrics = step.batch_metrics(cfg, step.plan_step(cfg, "no"), accelerator, batch, scored, tokenizer.eos_token_id)

    reverse, forward, k1 = [], [], []
    temperature = cfg.rollout.temperature
    for i in range(len(mask)):
        prompt = batch.seq.prompt_ids[i][batch.seq.prompt_mask[i].bool()]
        response = batch.seq.response_ids[i][: int(mask[i].sum())]
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


# ----------------------------------------------------------------------------- whole steps


def spied_step(cfg, monkeypatch):
    """One train_step on a fresh run: (the step's result, its rollout batch, its scores, the KL controller's
    value before the step, the run)."""
    accelerator = Accelerator(cpu=True)
    run = rlhf.setup.setup(cfg, accelerator)
    seen, original_update, original_score = {}, step.ppo_update, step.rewards.score_batch

    def update(cfg, plan, accelerator, run, batch, *args):
        seen["batch"] = batch
        return original_update(cfg, plan, accelerator, run, batch, *args)

    monkeypatch.setattr(step, "ppo_update", update)
    monkeypatch.setattr(step.rewards, "score_batch", lambda *a, **k: seen.setdefault("scored", original_score(*a, **k)))
    coef = run.kl_ctrl.value
    result = step.train_step(cfg, step.plan_step(cfg, "no"), accelerator, run, 1, Timer())
    return result, seen["batch"], seen["scored"], coef, run


def test_train_step_samples_each_prompts_group_on_one_process(artifacts, tmp_path, monkeypatch):
    """rollout.n responses per prompt, in a row, with the prompt's group id, and advantages taken per group; the
    logged samples pair each response with its own prompt (the repeated rows, not the batch's prompts)."""
    cfg = load_config(None, tiny_overrides(artifacts, str(tmp_path), "rollout.n=3", "algorithm.adv_estimator=rloo",
                                           "actor.ppo_micro_batch_size=3", "trainer.logger=none"))
    result, batch, scored, _, run = spied_step(cfg, monkeypatch)
    assert batch.group_ids.tolist() == [g for g in range(8) for _ in range(3)]
    prompts = batch.seq.prompt_ids.reshape(8, 3, -1)
    assert (prompts == prompts[:, :1]).all()  # the three responses of a group answer the same prompt
    assert len({tuple(p[0].tolist()) for p in prompts}) == 8
    advantages = batch.advantages[:, 0].reshape(8, 3)  # rloo: each score against its group's other two
    group_scores = scored.scores.reshape(8, 3)
    torch.testing.assert_close(advantages, 1.5 * (group_scores - group_scores.mean(1, keepdim=True)))
    assert run.models[1] is None and "critic/vf_loss" not in result.metrics
    assert "critic/vf_explained_var" not in result.metrics
    assert 0.0 <= result.metrics["critic/groups_with_equal_scores"] <= 1.0
    texts = [run.tokenizer.decode(ids[mask.bool()]) for ids, mask in zip(batch.seq.prompt_ids, batch.seq.prompt_mask)]
    samples = sample_rows(run.tokenizer, result.seq, result.scored, run.tokenizer.eos_token_id, 6)
    assert [sample["prompt"] for sample in samples] == texts[:6]
    assert [s["prompt"] for s in samples[:3]] == [samples[0]["prompt"]] * 3 != [s["prompt"] for s in samples[3:]]


def test_the_adaptive_coefficient_follows_the_steps_reward_kl(artifacts, tmp_path, monkeypatch):
    """actor/reward_kl_penalty is the sequence mean of the reward's KL (k1) of the step's own batch, and the
    adaptive controller moves once per step by it (Ziegler et al.: n_steps = the responses of the step)."""
    cfg = load_config(None, tiny_overrides(artifacts, str(tmp_path), "algorithm.kl_ctrl.type=adaptive",
                                           "algorithm.kl_ctrl.kl_coef=0.5", "algorithm.kl_ctrl.horizon=40",
                                           "algorithm.kl_ctrl.target_kl=0.01", "actor.lr=0.05", "trainer.logger=none"))
    result, batch, _, coef, run = spied_step(cfg, monkeypatch)
    result2 = step.train_step(cfg, step.plan_step(cfg, "no"), Accelerator(cpu=True), run, 2, Timer())
    assert coef == 0.5 and result.metrics["actor/reward_kl_penalty_coeff"] == 0.5
    assert result2.metrics["actor/reward_kl_penalty_coeff"] != 0.5
    mask = batch.seq.response_mask
    reward_kl = batch.old_logprobs - batch.ref_logprobs
    current = sum(reward_kl[i, mask[i].bool()].mean().item() for i in range(len(mask))) / len(mask)
    assert result.metrics["actor/reward_kl_penalty"] == pytest.approx(current, rel=1e-5, abs=1e-9)
    error = min(max(current / 0.01 - 1, -0.2), 0.2)
    assert result2.metrics["actor/reward_kl_penalty_coeff"] == pytest.approx(0.5 * (1 + error * 8 / 40), rel=1e-6)


# ----------------------------------------------------------------------------- ppo.py as a program


def test_the_one_files_settings_and_optimizers_are_configs_tiny():
    """ppo.Args' defaults are configs/tiny.yaml's settings, field by field, and its AdamW optimizers have the
    settings (lr, betas, eps, weight decay, ...) rlhf.setup.build_optimizers gives the trainer for that config."""
    cfg = load_config(os.path.join(REPO, "configs", "tiny.yaml"), [])
    assert one_file(cfg) == ppo.Args()
    schedules = (cfg.algorithm.kl_ctrl.type, cfg.actor.lr_scheduler_type, cfg.critic.lr_scheduler_type)
    assert schedules == ("fixed", "constant", "constant")  # what ppo.py has
    models = [torch.nn.Linear(2, 2) for _ in range(4)]
    theirs, ours = rlhf.setup.build_optimizers(cfg, *models[:2]), ppo.optimizers(ppo.Args(), *models[2:])
    implementation = ("params", "fused", "foreach", "capturable", "differentiable")
    for trainer_opt, one_file_opt in zip(theirs, ours, strict=True):
        assert type(trainer_opt) is type(one_file_opt) is torch.optim.AdamW
        settings = [{k: v for k, v in group.items() if k not in implementation} for group in
                    (*trainer_opt.param_groups, *one_file_opt.param_groups)]
        assert len(settings) == 2 and settings[0] == settings[1]
    assert [opt.param_groups[0]["weight_decay"] for opt in ours] == [0.0, 0.0]


def test_the_one_files_flags_refuse_values_they_do_not_understand(capsys):
    args = ppo.parse_args(["--off-policy-correction", "true", "--loss-kl", "k3+", "--reward-kl", "none",
                           "--total-steps", "3"])
    assert (args.off_policy_correction, args.loss_kl, args.reward_kl, args.total_steps) == (True, "k3+", None, 3)
    assert ppo.parse_args(["--off-policy-correction", "false"]).off_policy_correction is False
    for flag, value, message in [("--off-policy-correction", "True", "expected true or false"),
                                 ("--off-policy-correction", "1", "expected true or false"),
                                 ("--loss-kl", "k9", "unknown KL estimator 'k9'"),
                                 ("--reward-kl", "None", "unknown KL estimator 'None'"),
                                 ("--total-steps", "2.5", "invalid int value")]:
        with pytest.raises(SystemExit):
            ppo.parse_args([flag, value])
        error = capsys.readouterr().err
        assert flag in error and message in error, error


def test_the_one_file_trains_and_evaluates(artifacts, capsys):
    """ppo.py's own loop for two steps at test size: its sampling, scoring, rollout passes, advantages, update
    and greedy evaluation. At step 1 the actor is the reference (KL exactly 0); the update moves it (KL > 0 at
    step 2, weights changed): by the entropy bonus, as the test model scores 0 (all advantages 0 at step 1)."""
    args = ppo.Args(total_steps=2, batch_size=8, max_response_length=16, mini_batch_size=4, actor_lr=1e-3,
                    entropy_coeff=0.05, eval_every=2)
    actor = ppo.main(args, built=artifacts)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["step 0", "step 1", "step 2", "step 2", "done"]
    assert all("held-out accuracy" in lines[i] for i in (0, 3)) and lines[4].startswith("done: 2 steps")
    assert lines[1].endswith("KL(pi || ref) per token 0.0000 (its k1 estimate 0.0000)")
    assert float(lines[2].split("per token ")[1].split(" ")[0]) > 0
    start = transformers.AutoModelForCausalLM.from_pretrained(artifacts.model_dir, dtype=torch.float32)
    assert (weights(actor) - weights(start)).abs().max() > 1e-4


def test_the_one_files_masks_and_positions_are_the_trainers(artifacts):
    """ppo.sequences on responses that end at different places (an end-of-sequence token early in two rows, none
    in the third), left-padded prompts of different lengths: its response mask (the end token included, nothing
    after it), attention mask and positions are the trainer's (rlhf.rollout.Sequences.build) on the same tokens."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(artifacts.model_dir, padding_side="left")
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    responses = torch.tensor([[5, eos, pad, pad], [eos, pad, pad, pad], [5, 6, 7, 8]])

    sampling = []

    class FixedResponses(torch.nn.Module):  # the decoder's tokens fixed, to place the end where the test wants
        device = torch.device("cpu")

        def generate(self, input_ids, attention_mask, **kwargs):
            sampling.append({key: kwargs.get(key) for key in ("do_sample", "temperature", "top_k", "top_p")})
            return torch.cat([input_ids, responses[:len(input_ids)]], dim=1)

    ppo.sequences(FixedResponses(), tokenizer, ["a"], max_new_tokens=4, temperature=0.7)
    batch = ppo.sequences(FixedResponses(), tokenizer, ["a b c d e", "f", "g h"], max_new_tokens=4)
    assert sampling == [dict(do_sample=True, temperature=0.7, top_k=0, top_p=1.0),  # samples of pi itself
                        dict(do_sample=False, temperature=None, top_k=None, top_p=None)]  # greedy
    prompts = tokenizer(["a b c d e", "f", "g h"], padding=True, add_special_tokens=False, return_tensors="pt")
    assert (prompts["attention_mask"] == 0).any()  # the prompts are padded
    expected = Sequences.build(prompts["input_ids"], prompts["attention_mask"], responses,
                               response_mask_from_ids(responses, eos))
    assert batch["response_mask"].tolist() == [[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]]
    for name in ("input_ids", "attention_mask", "position_ids", "response_mask"):
        assert torch.equal(batch[name], getattr(expected, name)), name


def test_the_one_files_rollout_passes_are_the_trainers(setup_run, monkeypatch):
    """ppo.rollout on the trainer's sequences (three responses ending early): its old and reference log-probs,
    exact KL (pi || ref) and values are the trainer's rollout's, and its scores are the reward's."""
    cfg, _, (actor, critic, ref), tokenizer, rows, batch, _ = setup_run()
    trainers = one_file_batch(batch, torch.zeros(len(batch.group_ids)))
    monkeypatch.setattr(ppo, "sequences", lambda *args, **kwargs: {
        name: trainers[name] for name in ("input_ids", "attention_mask", "position_ids", "response_ids", "response_mask")})
    texts = tokenizer.batch_decode(batch.seq.response_ids, skip_special_tokens=True)
    answers = [texts[0].split()[-1] if texts[0].split() else "1"] + ["7"] * (len(texts) - 1)
    ours = ppo.rollout(one_file(cfg), actor, critic, ref, tokenizer, {"prompt": [], "answer": answers})
    for name in ("old_logprobs", "ref_logprobs", "full_kl", "values"):
        torch.testing.assert_close(ours[name], trainers[name], msg=name)
    assert ours["full_kl"][batch.seq.response_mask.bool()].min() > 0
    assert ours["scores"].tolist() == [compute_score(text, answer) for text, answer in zip(texts, answers)]
