"""bench/recipe_memory.py, docs/gpu.md's memory tables: its parameter counts are the models', its KV-cache
formula is the cache's size, the GRPO recipe counts no critic, and docs/gpu.md shows what it prints for
each recipe."""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from helpers import REPO
from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM, Qwen2ForTokenClassification

from rlhf.config import load_config
from rlhf.decode import kv_cache_name

# bench/ holds scripts, not a package: the module is loaded from its file.
_spec = importlib.util.spec_from_file_location("recipe_memory", os.path.join(REPO, "bench", "recipe_memory.py"))
recipe_memory = importlib.util.module_from_spec(_spec)
sys.modules["recipe_memory"] = recipe_memory  # its dataclass looks its module up there
_spec.loader.exec_module(recipe_memory)
# the longest GSM8K prompts the tables are computed for: training and evaluation
GSM8K_LENGTHS = dict(prompt_tokens=recipe_memory.GSM8K_PROMPT_TOKENS,
                     val_prompt_tokens=recipe_memory.GSM8K_TEST_PROMPT_TOKENS)


def test_parameter_counts_are_the_models():
    config = Qwen2Config(**recipe_memory.QWEN2_5_0_5B, num_labels=1)
    with torch.device("meta"):
        actor, critic = Qwen2ForCausalLM(config), Qwen2ForTokenClassification(config)
    assert recipe_memory.num_parameters() == sum(p.numel() for p in actor.parameters()) == 494_032_768
    expected_critic = sum(p.numel() for p in critic.parameters())
    assert recipe_memory.memory(load_config(recipe_memory.RECIPE, []))["critic weights"] * 2**30 == expected_critic * 4
    assert expected_critic == recipe_memory.num_parameters() + config.hidden_size + 1


def test_kv_cache_formula_is_the_cache_size():
    """A small model of the same proportions, prompts + responses of the config's lengths, as the recipe runs it:
    float32 weights under bf16 autocast, where the keys leave the rotary embedding in float32 and the values are
    bf16 (float32 too on a transformers whose cache gives them the keys' dtype, 5.17)."""
    shape = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=96, vocab_size=128, tie_word_embeddings=True)
    cfg = load_config(recipe_memory.RECIPE, ["data.max_prompt_length=6", "data.max_response_length=4",
                                            "data.train_batch_size=5", "actor.ppo_mini_batch_size=5",
                                            "actor.ppo_micro_batch_size=5"])
    model = Qwen2ForCausalLM(Qwen2Config(**shape)).eval()
    cache = DynamicCache()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.ones(5, 10, dtype=torch.long), **{kv_cache_name(model): cache}, use_cache=True)
    assert cache.layers[0].keys.dtype == torch.float32
    assert (cache.layers[0].values.dtype == torch.bfloat16) == recipe_memory.cache_keeps_value_dtype()
    cache_bytes = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert recipe_memory.memory(cfg, shape=shape)["KV cache (sampling)"] * 2**30 == cache_bytes


def test_each_transformers_version_s_kv_cache():
    """Under bf16 autocast over float32 weights: float32 keys, and bf16 values on 5.2x, float32 ones on 5.17
    (18,432 and 24,576 bytes a token for Qwen2.5-0.5B); an unknown version is refused, naming the known ones."""
    cfg = load_config(recipe_memory.RECIPE, [])
    tokens = cfg.data.train_batch_size * (cfg.data.max_prompt_length + cfg.data.max_response_length)
    per_token = {version: recipe_memory.memory(cfg, transformers=version)["KV cache (sampling)"] * 2**30 / tokens
                 for version in recipe_memory.TRANSFORMERS}
    assert per_token == {"5.17": 24 * 128 * (4 + 4), "5.2x": 24 * 128 * (4 + 2)}  # layers x KV width x bytes
    with pytest.raises(ValueError, match="choose from 5.17, 5.2x"):
        recipe_memory.memory(cfg, transformers="4.56")


def test_the_grpo_recipe_counts_no_critic():
    """Without a critic the static memory is the PPO recipe's less the critic's weights and AdamW moments, and
    the gradients are the actor's alone (the two recipes share the model, dtypes and lengths); the KV cache
    holds rollout.n responses per prompt."""
    ppo = recipe_memory.memory(load_config(recipe_memory.RECIPE, []))
    grpo_cfg = load_config(recipe_memory.GRPO_RECIPE, [])
    grpo = recipe_memory.memory(grpo_cfg)
    critic_rows = ("critic weights", "critic AdamW moments")
    assert all(grpo[key] == 0 for key in critic_rows) and all(ppo[key] > 0 for key in critic_rows)
    assert grpo["static"] == pytest.approx(ppo["static"] - sum(ppo[key] for key in critic_rows))
    assert grpo["gradients (update)"] == pytest.approx(ppo["actor weights"])
    per_response = ppo["KV cache (sampling)"] / 256  # the PPO recipe: 256 prompts x 1 response
    assert grpo["KV cache (sampling)"] == pytest.approx(per_response * grpo_cfg.data.train_batch_size * grpo_cfg.rollout.n)
    printed = subprocess.run([sys.executable, os.path.join(REPO, "bench", "recipe_memory.py"), "--recipe", "grpo"],
                             capture_output=True, text=True, check=True).stdout
    assert "| actor weights |" in printed and "critic" not in printed


def test_sharding_divides_the_trained_models_and_ddp_adds_its_buckets():
    """FSDP2 over 2 processes halves the actor's and critic's weights, moments and gradients (the reference stays
    whole) and adds one gathered layer; DDP keeps everything and adds a gradient-sized bucket copy; both halve the
    sampling batch."""
    cfg = load_config(recipe_memory.RECIPE, [])
    one = recipe_memory.memory(cfg)
    fsdp = recipe_memory.memory(cfg, num_processes=2, sharding="fsdp")
    ddp = recipe_memory.memory(cfg, num_processes=2, sharding="ddp")
    for key in ("actor weights", "actor AdamW moments", "critic weights", "gradients (update)"):
        assert fsdp[key] == pytest.approx(one[key] / 2) and ddp[key] == one[key]
    assert fsdp["reference"] == one["reference"] and 0 < fsdp["FSDP2 gathered layer"] < one["actor weights"] / 10
    assert ddp["DDP gradient buckets (update)"] == one["gradients (update)"]
    assert fsdp["KV cache (sampling)"] == ddp["KV cache (sampling)"] == pytest.approx(one["KV cache (sampling)"] / 2)
    with pytest.raises(ValueError, match="choose from none, ddp, fsdp"):
        recipe_memory.memory(cfg, sharding="zero3")


def test_the_update_grows_with_the_micro_batch_and_checkpointing_keeps_less():
    """What autograd keeps is proportional to the micro-batch: the logits (in the compute dtype: no float32 copy
    is kept) and the activations; without checkpointing every layer's activations stay."""
    def update(*overrides):
        return recipe_memory.memory(load_config(recipe_memory.RECIPE, list(overrides)))

    small, large = update("actor.ppo_micro_batch_size=2"), update("actor.ppo_micro_batch_size=8")
    assert large["logits, update"] == pytest.approx(4 * small["logits, update"])
    assert "float32 logits kept for the backward" not in large
    assert large["update"] > small["update"]
    off = update("actor.ppo_micro_batch_size=2", "model.gradient_checkpointing=false")
    assert off["layer activations kept, update"] > 5 * small["layer activations kept, update"]


@pytest.mark.parametrize("recipe", sorted(recipe_memory.RECIPES))
def test_each_card_s_sizes_fit_it_and_the_next_larger_micro_batch_does_not(recipe):
    """fitting_overrides: the chosen sizes' computed peak fits the card (its GB less the allowance, with the
    margin to spare) on transformers 5.17 and 5.2x alike; the next larger micro-batch that divides the mini-batch
    share does not fit the update, unless the chosen one is the whole share."""
    path = recipe_memory.RECIPES[recipe]
    for _, card_gb, sharding, processes in recipe_memory.CARDS:
        overrides = recipe_memory.fitting_overrides(recipe, card_gb, sharding, processes)
        if overrides is None:
            assert (recipe, card_gb, sharding) == ("ppo", 24, "ddp")  # docs/gpu.md: PPO under DDP does not fit 24 GB
            continue
        usable = recipe_memory.usable_gib(card_gb)
        cfg, lora = recipe_memory.load_recipe(path, overrides)
        for version in recipe_memory.TRANSFORMERS:
            computed = recipe_memory.memory(cfg, num_processes=processes, sharding=sharding, lora=lora,
                                            **GSM8K_LENGTHS, transformers=version)
            assert computed["peak"] <= usable - recipe_memory.MARGIN_GIB
        share = cfg.actor.ppo_mini_batch_size * cfg.rollout.n // processes
        larger = [m for m in range(cfg.actor.ppo_micro_batch_size + 1, share + 1) if share % m == 0]
        if larger:
            bigger, _ = recipe_memory.load_recipe(path, [*overrides, f"actor.ppo_micro_batch_size={larger[0]}"])
            assert recipe_memory.memory(bigger, num_processes=processes, sharding=sharding, lora=lora,
                                        **GSM8K_LENGTHS)["update"] > usable - recipe_memory.MARGIN_GIB


def test_the_recipes_ship_the_24_gb_one_gpu_sizes():
    """The configs' micro-batches, evaluation batch and checkpointing are the model's 24 GB, one-GPU column; the
    LoRA recipes' sizes fit a 24 GB card under DDP too (2 processes), with the margin, on both transformers."""
    for recipe, path in recipe_memory.RECIPES.items():
        overrides = recipe_memory.fitting_overrides(recipe, 24, "none", 1)
        (shipped, lora), (fitted, _) = recipe_memory.load_recipe(path), recipe_memory.load_recipe(path, overrides)
        assert shipped.actor.ppo_micro_batch_size == fitted.actor.ppo_micro_batch_size
        assert shipped.rollout.log_prob_micro_batch_size == fitted.rollout.log_prob_micro_batch_size
        assert shipped.data.val_batch_size == fitted.data.val_batch_size
        assert shipped.data.val_prefill_batch_size == fitted.data.val_prefill_batch_size
        assert shipped.model.gradient_checkpointing == fitted.model.gradient_checkpointing
        if recipe in recipe_memory.LORA_RECIPES:
            for version in recipe_memory.TRANSFORMERS:
                ddp = recipe_memory.memory(shipped, num_processes=2, sharding="ddp", lora=lora, transformers=version,
                                           **GSM8K_LENGTHS)
                assert ddp["peak"] <= recipe_memory.usable_gib(24) - recipe_memory.MARGIN_GIB


def test_lora_keeps_a_frozen_base_float32_adapters_and_no_reference():
    """With adapters (rank 32, every linear, the critic's backbone too): the bases in model.dtype, adapters,
    gradients and AdamW moments in float32 over the adapters (and the critic's value head) only, no reference;
    the adapters' count is PEFT's."""
    from peft import LoraConfig, get_peft_model

    shape = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=128, tie_word_embeddings=True)
    lora = recipe_memory.LoRA(8, critic=True)
    peft_model = get_peft_model(Qwen2ForCausalLM(Qwen2Config(**shape)), LoraConfig(r=8, target_modules=list(lora.target_modules)))
    assert recipe_memory.lora_parameters(lora, shape) == sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    cfg, file_lora = recipe_memory.load_recipe(recipe_memory.LORA_RECIPES["ppo-lora"])
    assert file_lora == recipe_memory.LoRA(32, critic=True) and cfg.model.dtype == "bfloat16"
    out = recipe_memory.memory(cfg, lora=file_lora)
    adapters, h = recipe_memory.lora_parameters(file_lora), recipe_memory.QWEN2_5_0_5B["hidden_size"]
    assert out["actor weights"] * 2**30 == recipe_memory.num_parameters() * 2
    assert out["actor adapters (float32)"] * 2**30 == adapters * 4 == out["critic adapters (float32)"] * 2**30
    assert out["actor AdamW moments"] * 2**30 == 2 * adapters * 4
    assert out["gradients (update)"] * 2**30 == (2 * adapters + h + 1) * 4
    assert out["reference"] == 0
    with pytest.raises(ValueError, match="a Qwen2 layer has q_proj"):
        recipe_memory.lora_parameters(recipe_memory.LoRA(8, ("qkv",)))


def test_the_lora_recipes_are_their_recipes_with_adapters():
    """Each LoRA recipe is its recipe with the model's dtype (bf16: the frozen base), the LoRA section, the learning
    rates, the micro-batch and evaluation sizes that fit 24 GB, and its own output names; nothing else."""
    import yaml

    def flat(path):
        with open(path) as f:
            tree = yaml.safe_load(f)

        def walk(node, prefix=""):
            for key, value in node.items():
                yield from walk(value, f"{prefix}{key}.") if isinstance(value, dict) else [(prefix + key, value)]
        return dict(walk(tree))

    allowed = {"model.dtype", "model.lora.rank", "model.lora.alpha", "model.lora.critic", "actor.lr", "critic.lr",
               "actor.ppo_micro_batch_size", "rollout.log_prob_micro_batch_size", "data.val_batch_size",
               "data.val_prefill_batch_size",
               "trainer.output_dir", "trainer.experiment_name"}
    for lora_name, base_name in (("ppo-lora", "ppo"), ("grpo-lora", "grpo")):
        lora, base = flat(recipe_memory.RECIPES[lora_name]), flat(recipe_memory.RECIPES[base_name])
        differ = {key for key in lora.keys() | base.keys() if lora.get(key) != base.get(key)}
        assert differ <= allowed, differ - allowed
        assert lora["model.dtype"] == "bfloat16" and lora["model.lora.rank"] == 32 and lora["actor.lr"] == 3e-5


@pytest.mark.slow
def test_validation_against_measured_peaks():
    """bench/recipe_memory.py --validate: every phase's computed peak within 15% of the one measured on this CPU
    (about 8 minutes on the project's 2-core machine)."""
    done = subprocess.run([sys.executable, os.path.join(REPO, "bench", "recipe_memory.py"), "--validate"],
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "within 15%" in done.stdout


@pytest.mark.parametrize("recipe", sorted(recipe_memory.RECIPES))
def test_gpu_page_shows_the_table(recipe):
    printed = subprocess.run([sys.executable, os.path.join(REPO, "bench", "recipe_memory.py"), "--recipe", recipe],
                             capture_output=True, text=True, check=True).stdout
    table = printed[printed.index("| GiB per GPU"):].strip()
    with open(os.path.join(REPO, "docs", "gpu.md")) as f:
        assert table in f.read()


@pytest.mark.parametrize("setting", ["float32", "bf16 autocast", "bf16 weights", "bf16 weights, LoRA"])
@pytest.mark.parametrize("heads", [4, 8])
def test_layer_activations_are_what_autograd_saves(setting, heads):
    """The per-token bytes a decoder layer keeps for its backward, against saved-tensor hooks on the CPU: float32,
    under bf16 autocast over float32 weights (its cast copies of each linear's input, the repeated keys and
    values), bf16 weights, and bf16 weights with PEFT's adapters of rank 16 on every linear: within 5% at a small
    width (the constant mask and cos/sin cost some bytes a token there); at Qwen2.5-0.5B's width `python
    bench/recipe_memory.py --validate` prints them within 0.2%."""
    shape = dict(hidden_size=128, intermediate_size=352, num_attention_heads=heads, num_key_value_heads=2,
                 tie_word_embeddings=True)
    weight = "float32" if setting in ("float32", "bf16 autocast") else "bfloat16"
    lora = recipe_memory.LoRA(16) if "LoRA" in setting else None
    measured = recipe_memory.measured_layer_activations(shape, setting != "float32", weight=weight, lora=lora)
    computed = recipe_memory.layer_activations(shape, 4 if weight == "float32" else 2, 4 if setting == "float32" else 2,
                                               lora)
    assert computed == pytest.approx(measured, rel=0.05)


def test_the_evaluation_counts_one_prefill_sub_batch_beside_the_cache_of_every_answer():
    """The evaluation's rows: the static KV cache of every row it decodes (data.val_batch_size problems, times
    trainer.val_samples when it samples answers), and the prompt pass of one sub-batch of
    data.val_prefill_batch_size (its activations and its prompts' cache), which a sub-batch of the whole batch
    leaves as the whole batch's. The PPO LoRA recipe's 1,319 prompts in one pass would not fit 24 GB."""
    def evaluation(*overrides):
        cfg, lora = recipe_memory.load_recipe(recipe_memory.LORA_RECIPES["ppo-lora"], list(overrides))
        return recipe_memory.memory(cfg, lora=lora, transformers="5.2x", **GSM8K_LENGTHS)

    whole, sub = evaluation("data.val_prefill_batch_size=null"), evaluation("data.val_prefill_batch_size=128")
    prefill_rows = ("prefill activations, a sub-batch (evaluation)", "prompts' KV cache, a prefill sub-batch (evaluation)")
    for row in prefill_rows:
        assert sub[row] == pytest.approx(whole[row] * 128 / 1319)
    assert sub["KV cache (evaluation)"] == whole["KV cache (evaluation)"]
    assert sub["evaluation"] < whole["evaluation"]
    assert evaluation("data.val_prefill_batch_size=1319") == whole
    assert whole["evaluation"] > recipe_memory.usable_gib(24) - recipe_memory.MARGIN_GIB
    one = evaluation("data.val_batch_size=330", "data.val_prefill_batch_size=null")
    four = evaluation("data.val_batch_size=330", "data.val_prefill_batch_size=null", "trainer.val_samples=4")
    for row in ("KV cache (evaluation)", "decoding step (evaluation)", *prefill_rows):
        assert four[row] == pytest.approx(4 * one[row])


@pytest.mark.parametrize("setting", ["float32", "bf16 weights, LoRA rank 32"])
def test_the_prompt_pass_per_token_is_what_the_cpu_holds(setting):
    """prefill_activations against the resident peak of a 2-layer model's prompt pass at Qwen2.5-0.5B's width
    (bench/recipe_memory.py --measure-prefill, a fresh process each, freed memory returned to the system): within
    15%, --validate's bound, without adapters and with PEFT's float32 adapters on bf16 weights under autocast."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, os.path.join(REPO, "bench", "recipe_memory.py"), "--measure-prefill", setting],
                          env=env, capture_output=True, text=True, check=True)
    measured = float(done.stdout.strip().splitlines()[-1])
    weight, autocast, lora = recipe_memory.PREFILL_SETTINGS[setting]
    computed = recipe_memory.prefill_activations(recipe_memory.QWEN2_5_0_5B, 128, 2 if autocast else 4, lora)
    assert computed == pytest.approx(measured, rel=0.15)
