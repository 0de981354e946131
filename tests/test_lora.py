"""LoRA (model.lora, rlhf/lora.py): the reference is the base model with the adapters off, exactly; every KL
estimator gets what a separately loaded reference gives; the static-cache decoder, the PPO and GRPO steps, resume,
two processes, export and evaluation work with adapters; bad settings are refused early."""

import json
import os

import pytest
import torch
from accelerate import Accelerator
from helpers import assert_same_rows, sample, tiny_overrides

import train
from rlhf import kl, lora
from rlhf.config import ConfigError, load_config
from rlhf.core_algos import LossAgg
from rlhf.models import load_causal_lm
from rlhf.rollout import SamplingParams, generate, left_pad, paired_noise_generator
from rlhf.setup import load_models, setup
from rlhf.step import Batch, actor_forward, actor_loss, forward_passes, plan_step, response_logits
from rlhf.tracking import Timer, read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")

PARITY_REWARD = """
def reward(completion_ids, ground_truth, **fields):
    return [float((sum(ids) + int(truth)) % 2 == 0) for ids, truth in zip(completion_ids, ground_truth)]
"""


@pytest.fixture(autouse=True)
def parity_reward(tmp_path, monkeypatch):
    """A reward right for about half the responses whatever the model (GSM8K's rule scores the tiny model 0), so
    advantages, gradients and the adapters move."""
    (tmp_path / "lora_parity_reward.py").write_text(PARITY_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))


def lora_overrides(artifacts, out, *extra):
    return tiny_overrides(artifacts, out, "model.lora.rank=4", "model.lora.alpha=8",
                          "reward.function=lora_parity_reward:reward", "trainer.logger=none", *extra)


def train_adapters(model, seq, steps: int = 3):
    """A few AdamW steps of the adapters (lr 0.05) on the mean log-prob of `seq`'s tokens: they move away from
    PEFT's start (B = 0, where the adapted model is the base)."""
    from rlhf.step import logprobs_and_logits

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    for _ in range(steps):
        logprobs, _ = logprobs_and_logits(model, seq, 1.0)
        (-logprobs.mean()).backward()
        opt.step()
        opt.zero_grad()


@pytest.fixture
def lora_run(artifacts, tmp_path):
    """(cfg, accelerator, run, a rollout batch's Sequences) of a LoRA run on the tiny model, set up in-process."""
    cfg = load_config(None, lora_overrides(artifacts, tmp_path / "out"))
    accelerator = Accelerator(cpu=True)
    run = setup(cfg, accelerator)
    rows = run.train_set[:4]
    prompt_ids, prompt_mask = left_pad(rows["input_ids"], run.tokenizer.pad_token_id)

    seq = generate(run.models[0], run.tokenizer, prompt_ids, prompt_mask, SamplingParams(12),
                   generator=torch.Generator().manual_seed(0))
    return cfg, accelerator, run, seq


# ----------------------------------------------------------------------------- the reference is the base, exactly


def test_no_second_model_and_only_adapters_train(lora_run, artifacts):
    cfg, _, run, _ = lora_run
    actor, critic, ref = run.models
    assert isinstance(ref, lora.Reference) and ref.policy is actor  # no reference weights of its own
    trainable = {name for name, p in actor.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert {p for group in run.optimizers[0].param_groups for p in group["params"]} == {
        p for p in actor.parameters() if p.requires_grad}
    assert all(p.requires_grad for p in critic.parameters())  # model.lora.critic=false: the critic trains fully


def test_reference_logits_equal_the_base_models_bit_for_bit_before_and_after_updates(lora_run, artifacts):
    _, _, run, seq = lora_run
    actor, _, ref = run.models
    base = load_causal_lm(artifacts.model_dir, "float32").eval()
    with torch.no_grad():
        assert torch.equal(response_logits(ref, seq), response_logits(base, seq))
    train_adapters(actor, seq)
    with torch.no_grad():
        policy_before = response_logits(actor, seq)
        ref_logits, base_logits = response_logits(ref, seq), response_logits(base, seq)
        policy_after = response_logits(actor, seq)
    assert not torch.allclose(policy_before, base_logits, atol=1e-3)  # the adapters moved the policy
    assert torch.equal(ref_logits, base_logits)  # the reference did not move: adapters off is the base, bit for bit
    assert torch.equal(policy_before, policy_after)  # and the adapters are back on after a reference forward
    assert ref_logits.dtype == torch.float32


def test_every_kl_estimator_in_reward_and_loss_equals_a_separate_reference(lora_run, artifacts):
    """The rollout's reference log-probs and exact KLs, then every estimator in the reward and in the loss
    (corrected or not, and its gradient), with the LoRA reference and with the base model loaded separately."""
    cfg, accelerator, run, _ = lora_run
    actor, critic, ref = run.models
    rows = run.train_set[:4]
    from rlhf.rollout import repeat_prompts

    rows, group_ids = repeat_prompts(rows, 1)
    # Move the adapters first (one PPO step), so that policy and reference differ and every KL is non-zero.
    plan = plan_step(cfg, "no")
    prompts = left_pad(rows["input_ids"], run.tokenizer.pad_token_id)
    seq = generate(actor, run.tokenizer, *prompts, plan.sampling, generator=torch.Generator().manual_seed(1))
    train_adapters(actor, seq)
    base = load_causal_lm(artifacts.model_dir, "float32").eval().requires_grad_(False)
    seq = generate(actor, run.tokenizer, *prompts, plan.sampling, generator=torch.Generator().manual_seed(2))
    passes = {side: forward_passes(cfg, plan, accelerator, (actor, critic, reference), seq, Timer())
              for side, reference in (("lora", ref), ("separate", base))}
    a, b = passes["lora"], passes["separate"]
    for field in ("old_logprobs", "ref_logprobs", "exact_kl", "exact_forward_kl"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    mask = seq.response_mask.bool()
    assert (a.exact_kl[mask] > 0).all()
    num_tokens = seq.response_mask.sum()
    ones = torch.ones(mask.shape)
    micro = Batch(seq=seq, group_ids=group_ids, old_logprobs=a.old_logprobs, sampler_logprobs=None,
                  ref_logprobs=a.ref_logprobs, exact_kl=a.exact_kl, exact_forward_kl=None, old_values=None,
                  token_rewards=ones, advantages=ones, returns=ones)
    for name in (*kl.ESTIMATOR_NAMES, "full"):  # "full+" is refused: full is exact already
        estimator = kl.parse_estimator(name)
        reward = {s: estimator(x.old_logprobs, x.ref_logprobs, x.exact_kl) for s, x in passes.items()}
        assert torch.equal(reward["lora"], reward["separate"]), name
        for corrected in (False, True):
            cfg.actor.kl_loss_off_policy_correction = corrected
            cfg.actor.kl_loss_type, cfg.actor.use_kl_loss = name, True
            loss_plan = plan_step(cfg, "no")
            results = {}
            for side, reference in (("lora", ref), ("separate", base)):
                out = actor_forward(cfg, loss_plan, (actor, critic, reference), seq)
                agg = LossAgg(cfg.actor.loss_agg_mode, num_tokens, num_seqs=4, norm_len=mask.shape[1])
                loss, metrics = actor_loss(cfg.actor, loss_plan.loss_kl, micro, out, agg)
                loss.backward()
                grads = [p.grad.clone() for p in actor.parameters() if p.requires_grad]
                actor.zero_grad()
                results[side] = metrics["actor/kl_loss"], grads
            assert results["lora"][0] == results["separate"][0] and results["lora"][0] != 0, (name, corrected)
            assert all(torch.equal(x, y) for x, y in zip(results["lora"][1], results["separate"][1])), (name, corrected)


def test_static_cache_decoder_under_adapters_equals_the_reference_loop(lora_run):
    _, _, run, seq = lora_run
    actor = run.models[0]
    train_adapters(actor, seq)
    model = lora.plain_model(actor)
    from rlhf import decode

    assert decode.supports(model)  # the static-cache loop runs the adapted model
    rows = run.train_set[:6]
    prompt_ids, prompt_mask = left_pad(rows["input_ids"], run.tokenizer.pad_token_id)
    params = SamplingParams(max_new_tokens=14, temperature=0.9)
    out = {}
    for side in ("reference", "static"):
        generator = paired_noise_generator(7, 3, 0, "cpu")
        with torch.no_grad():
            out[side] = sample(model, prompt_ids, prompt_mask, params, None, run.tokenizer.pad_token_id, generator,
                               keep_logprobs=True, reference=side == "reference")
    assert torch.equal(out["reference"][0], out["static"][0])
    assert torch.allclose(out["reference"][1], out["static"][1], rtol=0, atol=1e-6)
    # The log-probs are the adapted policy's, not the base's: the trainer's forward pass of the PEFT model agrees.
    with torch.no_grad():
        base_logits = lora.Reference(actor)(input_ids=prompt_ids, attention_mask=prompt_mask).logits[:, -1]
        policy_logits = actor(input_ids=prompt_ids, attention_mask=prompt_mask).logits[:, -1]
    assert not torch.allclose(base_logits, policy_logits, atol=1e-3)


# ----------------------------------------------------------------------------- runs


@pytest.mark.parametrize("case", [
    ("algorithm.adv_estimator=gae", "model.lora.critic=true"),
    ("algorithm.adv_estimator=grpo", "rollout.n=2", "actor.use_kl_loss=true", "actor.kl_loss_type=full"),
    ("model.dtype=bfloat16", "model.lora.critic=true", "trainer.mixed_precision=bf16",
     "model.gradient_checkpointing=true"),
    ("model.dtype=bfloat16", "model.lora.critic=true"),  # no autocast: the float32 value head takes bf16 states
])
def test_ppo_and_grpo_steps_train_the_adapters_only(artifacts, tmp_path, monkeypatch, case):
    """Micro-batches (2 per mini-batch), the KL panel, a KL in the reward or the loss: the adapters (and a LoRA
    critic's adapters and value head) change, the frozen base does not, and the panel's KL grows from 0."""
    models = {}
    real_setup = train.setup

    def keep(cfg, accelerator):
        models["run"] = real_setup(cfg, accelerator)
        models["start"] = {n: p.detach().clone() for m in models["run"].models[:2] if m is not None
                           for n, p in m.named_parameters()}
        return models["run"]

    monkeypatch.setattr(train, "setup", keep)
    out = tmp_path / "out"
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)  # mixed precision is fixed once per process; other tests run without
    try:
        train.main(load_config(None, lora_overrides(artifacts, out, "trainer.total_steps=3", *case)))
    finally:
        AcceleratorState._reset_state(True)
    rows = read_metrics(out / "metrics.jsonl")
    assert rows[-1]["kl/full"] > 0 and rows[1]["actor/grad_norm"] > 0
    for model in (m for m in models["run"].models[:2] if m is not None):
        for name, p in model.named_parameters():
            moved = not torch.equal(p, models["start"][name])
            if ".lora_B." in name or name.endswith(("score.weight",)):
                assert moved, name
            elif not p.requires_grad:
                assert not moved, name
    assert "actor/kl_loss" in rows[-1] or "actor/reward_kl_penalty" in rows[-1]


def test_resume_matches_the_uninterrupted_run_and_checkpoints_hold_the_adapters(artifacts, tmp_path):
    extra = ("actor.ppo_epochs=2", "actor.use_kl_loss=true", "actor.kl_loss_type=k3+", "model.lora.critic=true",
             "algorithm.kl_ctrl.type=adaptive", "trainer.total_steps=4", "trainer.save_freq=1",
             "trainer.max_ckpt_to_keep=4")
    out = tmp_path / "ref"
    train.main(load_config(None, lora_overrides(artifacts, out, *extra)))
    reference = read_metrics(out / "metrics.jsonl")
    from safetensors import safe_open

    step_2 = out / "checkpoints" / "step_2"
    for name, trained in (("model.safetensors", "lora_"), ("model_1.safetensors", ("lora_", "score."))):
        with safe_open(str(step_2 / name), "pt") as f:
            keys = list(f.keys())
        assert keys and all(any(t in k for t in ((trained,) if isinstance(trained, str) else trained)) for k in keys)
    resumed = tmp_path / "resumed"
    import shutil

    shutil.copytree(out, resumed)
    train.main(load_config(None, lora_overrides(artifacts, resumed, *extra,
                                                f"trainer.resume_from={resumed}/checkpoints/step_2")))
    assert_same_rows(read_metrics(resumed / "metrics.jsonl"), reference)
    with pytest.raises(ConfigError, match="model.lora.rank=4"):  # a LoRA checkpoint into a full run
        train.main(load_config(None, tiny_overrides(artifacts, tmp_path / "full", "trainer.logger=none",
                                                    f"trainer.resume_from={step_2}")))


def test_export_is_a_plain_merged_model_with_the_adapters_beside_it(artifacts, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    models = {}
    real_setup = train.setup

    def keep(cfg, accelerator):
        models["run"] = real_setup(cfg, accelerator)
        return models["run"]

    train.setup = keep
    try:
        train.main(load_config(None, lora_overrides(artifacts, out, "trainer.total_steps=3")))
    finally:
        train.setup = real_setup
    actor = models["run"].models[0]
    model_dir = out / "model"
    assert not (model_dir / "adapter_config.json").exists()  # transformers would load it as an adapter
    merged = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert not lora.is_peft(merged) and not any("lora" in n for n, _ in merged.named_parameters())
    ids = torch.tensor([models["run"].train_set[0]["input_ids"]])
    with torch.no_grad():
        want = actor(input_ids=ids).logits
        base = lora.Reference(actor)(input_ids=ids).logits
        got = merged(input_ids=ids).logits
    assert (want - base).abs().max() > 1e-3  # the adapters trained
    assert torch.allclose(got, want, rtol=0, atol=1e-5)  # merged: the same function, to float rounding
    adapter = json.loads((model_dir / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 4 and adapter["lora_alpha"] == 8 and adapter["base_model_name_or_path"] == artifacts.model_dir

    from rlhf import evaluate

    report = evaluate.evaluate_models(
        load_config(None, [f"data.val_files={artifacts.val_file}", "data.max_prompt_length=96",
                           "data.max_response_length=8", "data.max_val_samples=4", "trainer.logger=none",
                           f"trainer.output_dir={tmp_path / 'eval'}"]),
        {"model": str(model_dir), "baseline": str(model_dir / "adapter")})
    assert report["metrics"]["model"] == report["metrics"]["baseline"]  # either form, the same model


# ----------------------------------------------------------------------------- bad settings


@pytest.mark.parametrize("override, words", [
    ("model.lora.rank=-1", "'model.lora.rank' must be >= 0"),
    ("model.lora.dropout=0.05", "model.lora.dropout=0.05: LoRA dropout must be 0"),
    ("model.lora.target_modules=[]", "model.lora.target_modules is empty"),
    ("model.ref_dtype=bfloat16", "model.ref_dtype=bfloat16 with LoRA"),
])
def test_bad_settings_are_refused_at_config_check(override, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(".", r"\.")):
        load_config(None, ["model.lora.rank=4", override])
    if override != "model.lora.rank=-1":
        load_config(None, ["model.lora.rank=0", override])  # LoRA off: no LoRA check applies


def test_lora_without_peft_names_the_install(monkeypatch):
    monkeypatch.setattr(lora, "peft_missing", lambda: True)
    with pytest.raises(ConfigError, match=r'pip install -e "\.\[lora\]"'):
        load_config(None, ["model.lora.rank=4"])
    load_config(None, ["model.lora.rank=0"])


def test_a_target_module_the_model_lacks_is_refused_before_weights_load(artifacts, monkeypatch):
    cfg = load_config(None, ["model.lora.rank=4", "model.lora.target_modules=[q_proj, c_attn]"])
    monkeypatch.setattr("rlhf.setup.load_causal_lm", lambda *a: pytest.fail("weights loaded before the check"))
    with pytest.raises(ConfigError, match=r"model\.lora\.target_modules: c_attn is not a module .* q_proj"):
        load_models(cfg, artifacts.model_dir)


# ----------------------------------------------------------------------------- several processes


def test_two_processes_under_ddp_agree_with_one(artifacts, tmp_path, monkeypatch):
    """tests/test_multiprocess.py's comparison (the same global batch, greedy-like sampling, two PPO epochs, a k3+
    KL loss) with LoRA adapters on the actor and the critic: 2 DDP processes against 1."""
    import test_multiprocess
    from test_multiprocess import PARITY_REWARD as MULTIPROCESS_REWARD
    from test_multiprocess import assert_agree, launch, one_process_run, overrides

    # The adapters start at B = 0 and move little in 3 steps: the ratio stays ~1 and the whitened advantages
    # average 0, so pg_loss is a cancellation of order-1 terms down to ~4e-5, where float32 summing in another
    # order (~1e-7 absolute) is a relative 3e-3. It is compared absolutely below; the rest as in the full run.
    monkeypatch.setattr(test_multiprocess, "CLOSE", [k for k in test_multiprocess.CLOSE if k != "actor/pg_loss"])

    (tmp_path / "parity_reward.py").write_text(MULTIPROCESS_REWARD)
    extra = ("model.lora.rank=4", "model.lora.alpha=8", "model.lora.critic=true")
    out2, out1 = tmp_path / "two", tmp_path / "one"
    result = launch(tmp_path, overrides(artifacts, out2, "token-mean", *extra))
    assert "processes: 2 (MULTI_CPU)" in result.stdout and "LoRA rank 4" in result.stdout
    one = one_process_run(monkeypatch, out1, overrides(artifacts, out1, "token-mean", *extra))
    two = read_metrics(out2 / "metrics.jsonl")
    assert_agree(one, two, artifacts)
    for a, b in zip(one[1:], two[1:]):
        assert b["actor/pg_loss"] == pytest.approx(a["actor/pg_loss"], rel=0, abs=1e-6) and a["actor/pg_loss"] != 0

    # The 2-process checkpoint: the CLI exports the run's own model from it, and 1 process resumes from it.
    from safetensors.torch import load_file

    from rlhf import export

    last = out2 / "checkpoints" / f"step_{test_multiprocess.NUM_STEPS}"
    assert export.cli([str(last), str(tmp_path / "exported")]) == 0
    mine, runs = (load_file(str(d / "model.safetensors")) for d in (tmp_path / "exported", out2 / "model"))
    assert mine.keys() == runs.keys() and all(torch.equal(mine[k], runs[k]) for k in mine)
    train.main(load_config(None, overrides(artifacts, out2, "token-mean", *extra, "trainer.resume_from=auto",
                                           f"trainer.total_steps={test_multiprocess.NUM_STEPS + 1}")))
    resumed = read_metrics(out2 / "metrics.jsonl")
    assert resumed[:-1] == two and resumed[-1]["step"] == test_multiprocess.NUM_STEPS + 1
    assert resumed[-1]["actor/skipped_updates"] == 0


def test_fsdp_is_refused_with_lora_before_models_load(monkeypatch):
    from accelerate.utils import DistributedType

    class Sharded(Accelerator):
        @property
        def distributed_type(self):
            return DistributedType.FSDP

    monkeypatch.setattr(train, "Accelerator", Sharded)
    with pytest.raises(ConfigError, match="under FSDP2 is not supported.*configs/accelerate/ddp.yaml"):
        train.start_accelerator(load_config(None, ["model.lora.rank=4", "trainer.logger=none"]))
    train.start_accelerator(load_config(None, ["trainer.logger=none"]))  # full fine-tuning: FSDP2 as before


def test_a_lora_checkpoint_exports_as_the_run_does(artifacts, tmp_path):
    """python -m rlhf.export on a LoRA checkpoint (adapters only, a LoRA critic's too): the base from the run's
    model path, the adapters merged; the same weights as the run's own export at that step."""
    from safetensors.torch import load_file

    from rlhf import export

    out = tmp_path / "out"
    train.main(load_config(None, lora_overrides(artifacts, out, "trainer.total_steps=2", "model.lora.critic=true",
                                                "trainer.export_critic=true")))
    written = export.export_checkpoint(str(out / "checkpoints" / "step_2"), str(tmp_path / "exported"))
    for sub in ("", "critic"):
        mine = load_file(os.path.join(written, sub, "model.safetensors"))
        runs = load_file(os.path.join(out, "model", sub, "model.safetensors"))
        assert mine.keys() == runs.keys() and all(torch.equal(mine[k], runs[k]) for k in mine), sub


# ----------------------------------------------------------------------------- what trains is float32


@pytest.mark.parametrize("overrides, refused", [
    (["model.dtype=bfloat16"], "the actor"),
    (["model.dtype=float16"], "the actor"),
    (["model.dtype=bfloat16", "model.lora.rank=4"], "the critic"),  # gae: a critic, trained whole
    (["model.dtype=bfloat16", "model.lora.rank=4", "model.lora.critic=true"], None),
    (["model.dtype=bfloat16", "model.lora.rank=4", "algorithm.adv_estimator=grpo", "rollout.n=2"], None),
    (["model.dtype=float32"], None),
])
def test_a_model_trained_whole_in_bf16_is_refused(overrides, refused):
    if refused:
        with pytest.raises(ConfigError, match=f"would train every weight of {refused}.*trainer.mixed_precision=bf16"):
            load_config(None, overrides)
    else:
        load_config(None, overrides)


def test_over_a_bf16_base_everything_that_trains_is_float32_and_a_small_step_moves_the_head(artifacts):
    """A LoRA actor and critic over a bfloat16 base: the adapters and the value head are float32 (an AdamW step of
    lr 3e-4 on a weight of 0.2 moves it; in bfloat16, whose ulp at 0.2 is 2^-10, it would be lost), the start line
    says so, and the head takes the backbone's bfloat16 states without autocast."""
    cfg = load_config(None, ["model.dtype=bfloat16", "model.lora.rank=4", "model.lora.critic=true"])
    actor, critic, _ = load_models(cfg, artifacts.model_dir)
    for model in (actor, critic):
        trainable = {n: p.dtype for n, p in model.named_parameters() if p.requires_grad}
        assert trainable and set(trainable.values()) == {torch.float32}, trainable
        assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.bfloat16}
        assert lora.parameter_line(model).endswith("M float32")
    head = critic.get_base_model().score
    assert any(n.endswith("score.weight") for n, p in critic.named_parameters() if p.requires_grad)
    values = critic(input_ids=torch.tensor([[5, 6, 7]])).logits
    assert values.shape == (1, 3, 1)
    with torch.no_grad():
        head.weight.fill_(0.2)
    opt = torch.optim.AdamW([head.weight], lr=3e-4, weight_decay=0.0)
    head.weight.grad = torch.ones_like(head.weight)
    opt.step()
    assert torch.allclose(head.weight, torch.full_like(head.weight, 0.2 - 3e-4), rtol=1e-4)


def test_a_tied_embedding_as_a_target_is_refused_before_weights_load(artifacts, tmp_path, monkeypatch):
    from helpers import tiny_qwen2

    monkeypatch.setattr("rlhf.setup.load_causal_lm", lambda *a: pytest.fail("weights loaded before the check"))
    for target in ("lm_head", "embed_tokens"):
        cfg = load_config(None, ["model.lora.rank=4", f"model.lora.target_modules=[q_proj, {target}]"])
        with pytest.raises(ConfigError, match=f"{target} is a tied embedding"):
            load_models(cfg, artifacts.model_dir)  # the embedded model ties its embeddings
    untied = tmp_path / "untied"
    tiny_qwen2(tie_word_embeddings=False).save_pretrained(untied)
    lora.check_target_modules(load_config(None, ["model.lora.rank=4", "model.lora.target_modules=[lm_head]"]).model.lora,
                              str(untied))


@pytest.mark.parametrize("changed, key", [
    ("model.lora.alpha=16", "model.lora.alpha=8.0 there, model.lora.alpha=16.0 here"),
    ("model.lora.target_modules=[q_proj, v_proj]", "model.lora.target_modules=['q_proj', 'v_proj'] here"),
    ("model.lora.critic=true", "model.lora.critic=False there, model.lora.critic=True here"),
    ("model.lora.rank=8", "model.lora.rank=4 there, model.lora.rank=8 here"),
    ("algorithm.adv_estimator=grpo", "algorithm.adv_estimator=gae there, algorithm.adv_estimator=grpo here"),
])
def test_resume_refuses_other_lora_settings_naming_them(tmp_path, changed, key):
    from rlhf.checkpoint import RUN_INFO, check_resumable, run_info

    written = load_config(None, ["model.lora.rank=4", "model.lora.alpha=8"])
    (tmp_path / RUN_INFO).write_text(json.dumps(run_info(written)))
    with pytest.raises(ConfigError, match=key.replace("[", r"\[")):
        check_resumable(str(tmp_path), load_config(None, ["model.lora.rank=4", "model.lora.alpha=8", changed,
                                                          *(["rollout.n=2"] if "grpo" in changed else [])]))
    same = ["model.lora.rank=4", "model.lora.alpha=8",  # the same modules in another order: the same adapters
            f"model.lora.target_modules=[{', '.join(reversed(written.model.lora.target_modules))}]"]
    check_resumable(str(tmp_path), load_config(None, same))


def test_a_checkpoint_missing_a_trained_weight_is_refused(artifacts, tmp_path):
    from safetensors.torch import load_file, save_file

    out = tmp_path / "out"
    train.main(load_config(None, lora_overrides(artifacts, out, "trainer.total_steps=1")))
    path = out / "checkpoints" / "step_1" / "model.safetensors"
    weights = load_file(str(path))
    dropped = sorted(weights)[0]
    save_file({name: value for name, value in weights.items() if name != dropped}, str(path))
    with pytest.raises(ConfigError, match="does not hold this LoRA run's trainable weights"):
        train.main(load_config(None, lora_overrides(artifacts, out, "trainer.total_steps=2", "trainer.resume_from=auto")))
