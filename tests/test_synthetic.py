"""The synthetic tasks (lab/synthetic.py): what they build, and that the policy the theory reads is the one the
trainer samples from."""

import pytest
import torch

from lab import synthetic
from rlhf.config import ConfigError, load_config
from lab.synthetic import SyntheticConfig
from rlhf.models import load_causal_lm
from rlhf.rollout import SamplingParams, generate
from lab.theory import examples

SMALL = SyntheticConfig(fit_steps=150)

@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """{task: (model_dir, tokenizer, model)} for both tasks, built once."""
    cache = tmp_path_factory.mktemp("synthetic")
    out = {}
    for task in synthetic.TASKS:
        model_dir = synthetic.prepare_synthetic(str(cache), task, SMALL, log=lambda *_: None)
        out[task] = model_dir, synthetic.load_tokenizer(model_dir), load_causal_lm(model_dir).eval()
    return out

def test_vocabulary_and_rows(built):
    model_dir, tokenizer, model = built["bandit"]
    assert len(tokenizer) == model.config.vocab_size == SMALL.num_arms + 1
    assert built["tree"][2].config.vocab_size == 4
    assert tokenizer.convert_tokens_to_ids(synthetic.arm_tokens(SMALL.num_arms)) == list(range(SMALL.num_arms + 1))
    assert tokenizer.eos_token_id == tokenizer.pad_token_id == 0
    assert tokenizer.decode([1, 2], skip_special_tokens=True) == "a0 a1"
    train, val = synthetic.build_datasets("bandit", SMALL, tokenizer)
    assert len(train) == SMALL.num_prompts and len(val) == 1 and train["input_ids"][0] == [0]
    assert train["rewards"][0] == synthetic.reward_table("bandit", SMALL).tolist()

def test_reward_tables_are_seeded():
    bandit, tree = synthetic.reward_table("bandit", SMALL), synthetic.reward_table("tree", SMALL)
    assert bandit.shape == (7,) and tree.shape == (4, 4)  # the tree: docs/kl.md's example and the prompt token
    assert tree[1:, 1:].tolist() == [list(row) for row in examples.TREE_EXAMPLE["rewards"]] and tree[0].abs().sum() == 0
    assert torch.equal(bandit, synthetic.reward_table("bandit", SMALL))  # the same seed, the same table
    assert not torch.equal(bandit, synthetic.reward_table("bandit", SyntheticConfig(seed=1)))
    ref = synthetic.target_reference("bandit", SMALL)[0]
    assert torch.equal(torch.argsort(ref), torch.argsort(bandit, descending=True))  # the best arms are the rarest
    binary = synthetic.reward_table("bandit", SyntheticConfig(binary=True))
    assert set(binary.tolist()) == {0.0, 1.0} and binary.sum() == 2  # the best quarter of 7 entries, rounded up
    assert synthetic.table_reward([""] * 2, ["a0", "a1"], [[1], [2]], rewards=[bandit.tolist()] * 2) == \
        [bandit[1].item(), bandit[2].item()]
    assert synthetic.table_reward([""], [""], [[2, 3]], rewards=[tree.tolist()]) == [tree[2, 3].item()]

def test_reference_is_fitted_and_non_uniform(built):
    for task in synthetic.TASKS:
        ref = synthetic.policy(built[task][2], task)
        target = synthetic.target_reference(task, SMALL)
        if task == "bandit":
            fitted = ref
        else:  # the joint's first-token marginal and conditionals, against the target's rows
            first = ref.sum(-1)
            fitted = torch.cat([first[None], ref / first[:, None]])
        assert (fitted - target).abs().max() < 0.02, task  # 150 Adam steps fit it to ~1e-3
        assert ref.sum().item() == pytest.approx(1.0, abs=1e-12)
        assert ref.max() > 3 * ref.min(), task  # clearly non-uniform

def test_the_cache_is_reused_and_deterministic(tmp_path, built):
    again = synthetic.prepare_synthetic(str(tmp_path), "bandit", SMALL, log=lambda *_: None)
    # built on one thread from the same seed: the same weights in another cache directory
    assert torch.equal(synthetic.policy(load_causal_lm(again), "bandit"), synthetic.policy(built["bandit"][2], "bandit"))
    assert synthetic.prepare_synthetic(str(tmp_path), "bandit", SMALL, log=lambda *_: None) == again

@pytest.mark.parametrize("task", synthetic.TASKS)
def test_sampled_responses_follow_the_policy_read_off_the_logits(built, task):
    """The trainer's sampler draws responses with the frequencies Landing computes from the logits."""
    _, tokenizer, model = built[task]
    num = 8000
    prompts = torch.zeros(num, 1, dtype=torch.long)
    params = SamplingParams(synthetic.response_length(task), 1.0, 0, 1.0, ignore_eos=True)
    out = generate(model, tokenizer, prompts, torch.ones_like(prompts), params,
                   generator=torch.Generator().manual_seed(0))
    ids = out.response_ids
    assert ids.shape == (num, synthetic.response_length(task)) and out.response_mask.all()
    vocab = model.config.vocab_size
    flat = ids[:, 0] if task == "bandit" else ids[:, 0] * vocab + ids[:, 1]
    counts = torch.bincount(flat, minlength=vocab ** synthetic.response_length(task)).double() / num
    pi = synthetic.policy(model, task).flatten()
    # each frequency within 5 binomial standard errors (fixed seed; 5 sigma over <= 49 cells never trips by chance)
    assert ((counts - pi).abs() <= 5 * (pi * (1 - pi) / num).sqrt() + 1e-12).all()

def test_config_checks_name_the_fix():
    base = ["task.name=lab.tasks:bandit", "rollout.ignore_eos=true",
            "data.max_response_length=1", "algorithm.use_kl_in_reward=false"]
    load_config(None, base)
    for change, message in (("data.max_response_length=2", "data.max_response_length=1"),
                            ("rollout.ignore_eos=false", "rollout.ignore_eos=true"),
                            ("rollout.top_k=3", "rollout.top_k=0"),
                            ("algorithm.use_kl_in_reward=true actor.use_kl_loss=true", "not both"),
                            ("algorithm.use_kl_in_reward=true algorithm.kl_ctrl.type=adaptive", "kl_ctrl.type=fixed"),
                            ("actor.use_kl_loss=true actor.kl_loss_off_policy_correction=true actor.kl_loss_type=k3+",
                             "for k1 and k3")):
        with pytest.raises(ConfigError, match=message.replace("+", r"\+")):
            load_config(None, base + change.split())
