"""The two GPU recipes (configs/gsm8k_qwen2.5_0.5b.yaml, PPO; configs/gsm8k_qwen2.5_0.5b_grpo.yaml, GRPO):
the GRPO one is GRPO as docs/gpu.md describes it, differs from the PPO one only where GRPO differs, and the
rehearsal (bench/rehearse_gpu_recipe.py) changes only what its docstring says it changes."""

import argparse
import importlib.util
import json
import os
import sys

import pytest
from helpers import REPO

from rlhf.config import load_config, to_dict, warnings_for

PPO = os.path.join(REPO, "configs", "gsm8k_qwen2.5_0.5b.yaml")
GRPO = os.path.join(REPO, "configs", "gsm8k_qwen2.5_0.5b_grpo.yaml")


def flat(cfg) -> dict:
    out = {}

    def walk(node, prefix):
        for key, value in node.items():
            if isinstance(value, dict) and key != "options":
                walk(value, f"{prefix}{key}.")
            else:
                out[prefix + key] = value

    walk(to_dict(cfg), "")
    return out


def test_the_grpo_recipe_is_grpo():
    cfg = load_config(GRPO)
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.rollout.n > 1
    assert cfg.actor.use_kl_loss and cfg.actor.kl_loss_coef > 0 and not cfg.algorithm.use_kl_in_reward
    assert warnings_for(cfg) == []


def test_the_recipes_differ_only_where_grpo_does():
    """Same model, dtypes, data, lengths, lr, clipping, KL estimator and coefficient, precision, evaluation
    and checkpoint cadence; the rest is the list below, each item said in docs/gpu.md's GRPO section."""
    ppo, grpo = flat(load_config(PPO)), flat(load_config(GRPO))
    differing = {key for key in ppo if ppo[key] != grpo[key]}
    assert differing == {
        "algorithm.adv_estimator", "rollout.n", "data.train_batch_size", "actor.ppo_mini_batch_size",
        "actor.ppo_micro_batch_size", "rollout.log_prob_micro_batch_size", "data.val_batch_size",
        "data.val_prefill_batch_size", "trainer.total_steps", "trainer.output_dir", "trainer.experiment_name"}


def test_the_grpo_recipe_samples_as_many_responses_as_the_ppo_recipe():
    """The config's comment: 348 steps x 64 prompts x 5 = 435 steps x 256 prompts x 1 = 111,360 responses;
    and as many optimizer steps per step (4)."""
    ppo, grpo = load_config(PPO), load_config(GRPO)

    def responses(cfg):
        return cfg.trainer.total_steps * cfg.data.train_batch_size * cfg.rollout.n

    assert responses(grpo) == responses(ppo) == 111_360
    assert (grpo.data.train_batch_size // grpo.actor.ppo_mini_batch_size
            == ppo.data.train_batch_size // ppo.actor.ppo_mini_batch_size == 4)


def load_rehearsal():
    sys.path.insert(0, os.path.join(REPO, "bench"))  # the script imports recipe_memory from beside it
    try:
        spec = importlib.util.spec_from_file_location("rehearse_gpu_recipe",
                                                      os.path.join(REPO, "bench", "rehearse_gpu_recipe.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(os.path.join(REPO, "bench"))


@pytest.mark.parametrize("recipe,prompts", [("ppo", 4), ("grpo", 1)])
def test_the_rehearsal_changes_only_the_batch_the_steps_and_the_kl_placement(tmp_path, recipe, prompts):
    rehearsal = load_rehearsal()
    path = rehearsal.recipe_path(recipe)
    assert path == {"ppo": PPO, "grpo": GRPO}[recipe]
    os.makedirs(tmp_path / "model")  # the model directory need only exist for the config's checks
    for name in ("train", "val"):
        with open(tmp_path / f"{name}.jsonl", "w") as f:
            f.write(json.dumps({"question": "1 + 1?", "answer": "1 + 1 = 2 #### 2"}) + "\n")
    args = argparse.Namespace(gpu=False, prompts=prompts, val_samples=4, steps=2)
    run_args = rehearsal.overrides(str(tmp_path / "model"), str(tmp_path), str(tmp_path / "run"), args)
    recipe_cfg, rehearsed = flat(load_config(path)), flat(load_config(path, run_args))
    differing = {key for key in recipe_cfg if recipe_cfg[key] != rehearsed[key]}
    assert differing <= {
        "model.path", "data.train_files", "data.val_files", "data.train_batch_size", "data.val_batch_size",
        "actor.ppo_mini_batch_size", "data.max_val_samples", "trainer.total_steps", "trainer.save_freq",
        "trainer.output_dir", "trainer.logger", "algorithm.use_kl_in_reward", "actor.kl_loss_type"}
    assert rehearsed["data.train_batch_size"] == prompts
    # the recipe's own micro-batches, group size, lengths and precision stay
    for key in ("actor.ppo_micro_batch_size", "rollout.log_prob_micro_batch_size", "rollout.n",
                "data.max_response_length", "model.dtype", "trainer.mixed_precision"):
        assert rehearsed[key] == recipe_cfg[key], key
