"""The trained model is the user's: `<output_dir>/model/` (and `<checkpoint>/model/`) loads with transformers alone
and is the trained model; `python -m rlhf.export` makes the same from a checkpoint and refuses what is not one.

One 2-step run of the tiny embedded model (an entropy bonus and a k3+ KL loss move the actor, a KL penalty in
the reward the critic) with a checkpoint and a model every step and the critic exported is the reference; the
trained models are caught in memory (`train.setup`) to compare with what was written. Logits are compared in
float32 at 1e-6 (the same weights through the same code: measured 0 here), never as text.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import (AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer, GenerationConfig)

from helpers import REPO, assert_same_rows, tiny_overrides

import train
from rlhf import export, rollout
from rlhf.config import load_config, to_dict
from rlhf.processes import launch_warnings
from rlhf.tracking import read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")
NUM_STEPS = 2


def overrides(artifacts, output_dir, *extra) -> list[str]:
    return tiny_overrides(artifacts, output_dir, "actor.entropy_coeff=0.01", "actor.use_kl_loss=true",
                          "actor.kl_loss_type=k3+", f"trainer.total_steps={NUM_STEPS}", "trainer.save_freq=1",
                          "trainer.logger=none", *extra)


def train_and_catch(output_dir, args) -> tuple:
    """train.main in this process; returns (accelerator, run, cfg) of the run, its models as trained."""
    caught = {}
    real_setup = train.setup

    def spy(cfg, accelerator):
        caught["run"] = real_setup(cfg, accelerator)
        caught["accelerator"], caught["cfg"] = accelerator, cfg
        return caught["run"]

    train.setup = spy
    try:
        train.main(load_config(None, args))
    finally:
        train.setup = real_setup
    return caught["accelerator"], caught["run"], caught["cfg"]


@pytest.fixture(scope="module")
def trained(artifacts, tmp_path_factory):
    """The reference run: (output_dir, accelerator, run, cfg)."""
    out = tmp_path_factory.mktemp("trained")
    accelerator, run, cfg = train_and_catch(out, overrides(artifacts, out, "trainer.save_model_with_checkpoints=true",
                                                           "trainer.export_critic=true"))
    return out, accelerator, run, cfg


def batch_of_prompts(run, num: int = 8):
    """(ids, mask) of the first `num` held-out prompts, left-padded as the trainer pads them."""
    return rollout.left_pad(run.val_set["input_ids"][:num], run.tokenizer.pad_token_id)


def weights(path: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(path, "model.safetensors"))


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def test_the_model_loads_with_transformers_and_has_the_trained_logits(trained, artifacts):
    out, _, run, _ = trained
    actor = run.models[0]
    model = AutoModelForCausalLM.from_pretrained(export.model_dir(out))
    tokenizer = AutoTokenizer.from_pretrained(export.model_dir(out))
    ids, mask = batch_of_prompts(run)
    with torch.no_grad():
        want = actor(input_ids=ids, attention_mask=mask).logits
        got = model(input_ids=ids, attention_mask=mask).logits
    assert got.dtype == want.dtype == torch.float32
    assert (got - want).abs().max().item() <= 1e-6
    # The run trained: the base model's logits are far from these, so the comparison could not pass with them.
    base = AutoModelForCausalLM.from_pretrained(artifacts.model_dir)
    with torch.no_grad():
        assert (base(input_ids=ids, attention_mask=mask).logits - want).abs().max().item() > 1e-3
    # The tokenizer and its chat template are the run's: the same prompt ids.
    chat = [{"role": "user", "content": "Tom has 3 apples. How many apples does Tom have now?"}]
    assert tokenizer.apply_chat_template(chat, add_generation_prompt=True) == \
        run.tokenizer.apply_chat_template(chat, add_generation_prompt=True)
    assert tokenizer.chat_template == run.tokenizer.chat_template


def random_prompts(vocab_size: int, num: int = 8, length: int = 12):
    """(ids, mask) of `num` prompts of random ordinary tokens (seeded). The tiny test model, after its 5-step warm
    start, answers a held-out prompt with newlines and mostly repeats a prompt's last token: prompts ending in
    different tokens give different responses."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab_size, (num, length), generator=generator)
    return ids, torch.ones_like(ids)


def assert_same_greedy(model, run, ids, mask, max_new: int = 24) -> torch.Tensor:
    """transformers' greedy `generate` of `model`, with its generation config alone (EOS ids, pad), against the
    trainer's decoding loop (rlhf.rollout.generate) on the trained actor: the same tokens, the same stops.
    Returns (B,) bool: which responses ended at a stop token."""
    ours = rollout.generate(run.models[0], run.tokenizer, ids, mask,
                            rollout.SamplingParams(max_new_tokens=max_new, greedy=True))
    theirs = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new)
    theirs = theirs[:, ids.shape[1]:]
    width = max(theirs.shape[1], ours.response_ids.shape[1])
    pad = run.tokenizer.pad_token_id

    def padded(x):
        return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=pad)

    assert torch.equal(padded(theirs), padded(ours.response_ids))
    stop_ids = rollout.stop_token_ids(run.models[0], run.tokenizer)
    return rollout.is_stop_token(ours.response_ids, stop_ids).any(dim=1)


def test_greedy_generation_of_the_reloaded_model_matches_the_trainers_sampler(trained):
    out, _, run, _ = trained
    model = AutoModelForCausalLM.from_pretrained(export.model_dir(out))
    assert_same_greedy(model, run, *batch_of_prompts(run))
    assert_same_greedy(model, run, *random_prompts(len(run.tokenizer)))
    # (the stop at an EOS is compared in test_two_eos_ids_...: this model never emits its EOS)


def test_tied_embeddings_are_stored_once_and_one_tensor_after_reload(trained):
    out, *_ = trained
    with safe_open(os.path.join(export.model_dir(out), "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names  # stored once
    model = AutoModelForCausalLM.from_pretrained(export.model_dir(out))
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_the_critic_is_exported_with_its_trained_value_head(trained):
    out, _, run, _ = trained
    critic = run.models[1]
    value_model = AutoModelForTokenClassification.from_pretrained(os.path.join(export.model_dir(out), "critic"))
    ids, mask = batch_of_prompts(run)
    with torch.no_grad():
        want = critic(input_ids=ids, attention_mask=mask).logits
        got = value_model(input_ids=ids, attention_mask=mask).logits
    assert got.shape == want.shape and got.shape[-1] == 1
    assert (got - want).abs().max().item() <= 1e-6
    assert want.abs().max().item() > 1e-4  # trained: a zeroed head (a fresh critic) gives values of exactly 0


def test_every_checkpoint_holds_the_model_of_its_step(trained):
    """save_model_with_checkpoints=true: step_k/model is the model after step k; the last one is the run's."""
    out, *_ = trained
    step_1, step_2 = (os.path.join(out, "checkpoints", f"step_{k}", "model") for k in (1, 2))
    assert_same_weights(weights(step_2), weights(export.model_dir(out)))
    assert_same_weights(weights(os.path.join(step_2, "critic")), weights(os.path.join(export.model_dir(out), "critic")))
    moved = weights(step_1)["model.embed_tokens.weight"] - weights(step_2)["model.embed_tokens.weight"]
    assert moved.abs().max().item() > 0  # step 2 trained: the two are not the same model
    assert not [n for n in os.listdir(out) if n.endswith(".tmp")]


def test_export_dtype_writes_that_dtype(trained, tmp_path):
    """trainer.export_dtype=bfloat16: the weights and config.json's dtype are bfloat16, each the trained
    float32 weight rounded; by default they are the trained dtype, float32."""
    out, accelerator, run, cfg = trained
    assert weights(export.model_dir(out))["model.embed_tokens.weight"].dtype == torch.float32
    cfg.trainer.export_dtype = "bfloat16"
    try:
        path = export.save_model(accelerator, run, cfg, str(tmp_path / "bf16"))
    finally:
        cfg.trainer.export_dtype = None
    model = AutoModelForCausalLM.from_pretrained(path, dtype="auto")
    assert model.dtype == torch.bfloat16 and model.config.dtype == torch.bfloat16
    trained_state = run.models[0].state_dict()
    for name, value in model.state_dict().items():
        assert value.dtype == torch.bfloat16 and torch.equal(value, trained_state[name].to(torch.bfloat16)), name
    assert (weights(os.path.join(path, "critic"))["score.weight"].dtype == torch.bfloat16)


def test_two_eos_ids_are_both_in_the_generation_config(artifacts, tmp_path):
    """A base model whose generation config lists two EOS ids, as Qwen2.5-Instruct's does (`<|im_end|>`, its
    tokenizer's EOS, and `<|endoftext|>`): the run stops at both, the exported generation config lists both, and
    transformers' generate stops where the trainer's sampler stopped. The second id here is one the tiny model
    emits (the last token of the first random prompt, which it repeats): the test model never emits
    `<|endoftext|>`, and a stop that never happens would compare nothing."""
    base = tmp_path / "base"
    shutil.copytree(artifacts.model_dir, base)
    tokenizer = AutoTokenizer.from_pretrained(base)
    ids, mask = random_prompts(len(tokenizer))
    second = int(ids[0, -1])
    assert second != tokenizer.eos_token_id
    config = GenerationConfig.from_pretrained(base)
    config.eos_token_id = [tokenizer.eos_token_id, second]
    config.save_pretrained(base)
    out = tmp_path / "run"
    _, run, _ = train_and_catch(out, overrides(artifacts, out, f"model.path={base}", "trainer.total_steps=1"))
    run_stop_ids = rollout.stop_token_ids(run.models[0], run.tokenizer)
    assert run_stop_ids == (tokenizer.eos_token_id, second)
    assert GenerationConfig.from_pretrained(export.model_dir(out)).eos_token_id == list(run_stop_ids)
    model = AutoModelForCausalLM.from_pretrained(export.model_dir(out))
    assert rollout.stop_token_ids(model, AutoTokenizer.from_pretrained(export.model_dir(out))) == run_stop_ids
    ended = assert_same_greedy(model, run, ids, mask)
    assert ended.any() and not ended.all(), ended  # some responses stop at the second EOS, others run on


def test_exporting_with_checkpoints_leaves_the_run_and_its_resume_unchanged(trained, artifacts, tmp_path):
    """The same run without any model in its checkpoints logs the same numbers (the export draws no random
    number and changes no state), and resuming from a checkpoint with a model/ inside repeats it."""
    out, *_ = trained
    plain = tmp_path / "plain"
    train.main(load_config(None, overrides(artifacts, plain)))
    expected = read_metrics(plain / "metrics.jsonl")
    assert not os.path.exists(plain / "checkpoints" / "step_1" / "model")
    assert_same_rows(read_metrics(out / "metrics.jsonl"), expected)

    resumed = tmp_path / "resumed"
    shutil.copytree(out, resumed)
    assert os.path.isdir(resumed / "checkpoints" / "step_1" / "model")
    train.main(load_config(None, overrides(artifacts, resumed, "trainer.save_model_with_checkpoints=true",
                                           "trainer.export_critic=true",
                                           f"trainer.resume_from={resumed}/checkpoints/step_1")))
    assert_same_rows(read_metrics(resumed / "metrics.jsonl"), expected)


def test_python_m_rlhf_export_of_a_checkpoint_is_the_end_of_run_model(trained, tmp_path):
    """The command on the last checkpoint of a 1-process run writes the model the run wrote at its end: the same
    tensors, config, generation config and tokenizer files (the critic too: the run's trainer.export_critic)."""
    out, *_ = trained
    target = tmp_path / "from_checkpoint"
    result = subprocess.run([sys.executable, "-m", "rlhf.export", str(out / "checkpoints" / f"step_{NUM_STEPS}"),
                             str(target)], cwd=REPO, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    end = export.model_dir(out)
    assert_same_weights(weights(target), weights(end))
    assert_same_weights(weights(target / "critic"), weights(os.path.join(end, "critic")))
    assert sorted(os.listdir(target)) == sorted(os.listdir(end))
    for name in ("config.json", "generation_config.json", "tokenizer.json", "chat_template.jinja",
                 os.path.join("critic", "config.json")):
        with open(target / name) as a, open(os.path.join(end, name)) as b:
            assert a.read() == b.read(), name
    # transformers records how the tokenizer was loaded (local_files_only: HF_HUB_OFFLINE here); the rest is equal
    load_time = ("local_files_only", "is_local")
    with open(target / "tokenizer_config.json") as a, open(os.path.join(end, "tokenizer_config.json")) as b:
        mine, theirs = json.load(a), json.load(b)
    assert {k: v for k, v in mine.items() if k not in load_time} == {k: v for k, v in theirs.items() if k not in load_time}


def test_the_export_command_refuses_what_is_not_a_checkpoint(trained, tmp_path, capsys):
    out, *_ = trained
    target = tmp_path / "never_written"
    cases = {str(tmp_path / "missing"): "is not a directory",
             str(out): "It is a run's output directory: its checkpoints are step_1, step_2 under checkpoints/",
             str(out / "checkpoints" / "step_1" / "model"): "It is a model directory already",
             str(out / "checkpoints"): "is not a checkpoint: a checkpoint holds random_states_0.pkl and "
                                       "model.safetensors (a 1-process or DDP run) or pytorch_model_fsdp_0/ (FSDP2)"}
    for path, message in cases.items():
        assert export.cli([path, str(target)]) == 2
        assert message in capsys.readouterr().err
    assert not target.exists()


def test_the_export_command_refuses_a_checkpoint_of_another_config(trained, tmp_path, capsys):
    """The run's config.yaml names another model (twice as wide): refused before any weight is read, naming the
    weight whose shape differs and the config; nothing is written."""
    out, _, run, cfg = trained
    wider = tmp_path / "wider"
    config = AutoModelForCausalLM.from_pretrained(cfg.model.path).config
    config.hidden_size, config.intermediate_size = 2 * config.hidden_size, 2 * config.intermediate_size
    AutoModelForCausalLM.from_config(config).save_pretrained(wider)
    run.tokenizer.save_pretrained(wider)
    other = to_dict(cfg)
    other["model"]["path"] = str(wider)
    other_config = tmp_path / "config.yaml"
    other_config.write_text(yaml.safe_dump(other))
    target = tmp_path / "never_written"
    assert export.cli([str(out / "checkpoints" / "step_1"), str(target), "--config", str(other_config)]) == 2
    err = capsys.readouterr().err
    vocab, width = config.vocab_size, config.hidden_size
    assert (f"model.embed_tokens.weight is ({vocab}, {width // 2}) in the weights of the policy in "
            f"{out / 'checkpoints' / 'step_1'} and ({vocab}, {width}) in the model") in err, err
    assert f"written by a run of another config than {other_config}" in err
    assert not target.exists()


def test_the_embedded_default_s_base_model_is_found_in_its_cache(artifacts, tmp_path):
    """model.path=embedded (configs/tiny.yaml): the architecture and tokenizer come from the cache entry of the
    run's embedded config; a cache that is not there is named (a relative trainer.cache_dir is relative to where
    train.py ran), not rebuilt for minutes somewhere else."""
    from helpers import embedded_overrides

    cache_dir = os.path.dirname(os.path.dirname(artifacts.model_dir))
    cfg = load_config(None, ["model.path=embedded", f"trainer.cache_dir={cache_dir}", *embedded_overrides()])
    path, tokenizer = export.base_model(cfg, str(tmp_path))
    assert path == artifacts.model_dir and tokenizer.chat_template
    cfg.trainer.cache_dir = str(tmp_path / "elsewhere")
    with pytest.raises(export.ExportError, match="run this command from the directory train.py ran in"):
        export.base_model(cfg, str(tmp_path))


def test_launch_warning_when_accelerate_starts_one_of_several_processes(tmp_path):
    """`accelerate launch --cpu --num_processes 2` runs the script once (accelerate's simple launcher): the
    warning names the cause. Checked in the environment accelerate really gives the script."""
    probe = tmp_path / "probe.py"
    probe.write_text(f"import os, sys, json\nsys.path.insert(0, {REPO!r})\n"
                     "from rlhf.processes import launch_warnings\n"
                     "print(json.dumps(launch_warnings(os.environ, int(os.environ.get('WORLD_SIZE', 1)))))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "MASTER_", "WORLD_SIZE"))}
    command = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", str(probe)]
    result = subprocess.run(command, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    printed = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("[")]
    assert len(printed) == 1, result.stdout  # one process started
    assert "--cpu sends every launch to it" in printed[0][0] and "--multi_gpu --num_processes N" in printed[0][0]
    # No warning for what accelerate really starts as several processes (torchrun sets WORLD_SIZE), for a plain
    # `python train.py`, or for a launch that asked for one process (no MASTER_ADDR).
    launched = {"ACCELERATE_USE_CPU": "False", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    assert launch_warnings({**launched, "WORLD_SIZE": "2"}, 2) == []
    assert launch_warnings({}, 1) == []
    assert launch_warnings({"ACCELERATE_USE_CPU": "True"}, 1) == []
    assert "fewer than 2 GPUs" in launch_warnings(launched, 1)[0]


@pytest.mark.slow  # ~40 s: a 2-process FSDP2 launch and a 1-process run; python -m pytest -q -m slow
def test_a_two_process_fsdp2_export_equals_the_one_process_one(artifacts, tmp_path):
    """configs/accelerate/fsdp.yaml on 2 CPU processes: the model is gathered (accelerator.get_state_dict) and
    written by rank 0 alone; `python -m rlhf.export` merges the sharded checkpoint into the same tensors,
    exactly; and the 1-process run of the same greedy batch (rollout.top_k=1, one mini-batch: as in
    tests/test_multiprocess.py) exports the same model to float noise, far below what training moved."""
    from test_multiprocess import launch, rank_writes

    def args(out):
        return overrides(artifacts, out, "rollout.top_k=1", "actor.ppo_mini_batch_size=8",
                         "trainer.save_model_with_checkpoints=true", "trainer.export_critic=true")

    two = tmp_path / "fsdp"
    result = launch(tmp_path, args(two), ("--config_file", os.path.join(REPO, "configs", "accelerate", "fsdp.yaml")))
    assert "processes: 2 (FSDP)" in result.stdout
    saved = two / "checkpoints" / f"step_{NUM_STEPS}"
    assert sorted(f for f in os.listdir(saved / "pytorch_model_fsdp_0") if f.endswith(".distcp")) == [
        "__0_0.distcp", "__1_0.distcp"]  # sharded: one file per process
    models = [str(two / "model"), *(str(c / "model") for c in (two / "checkpoints").iterdir())]
    assert not [p for p in rank_writes(tmp_path, two)[1] if p.startswith(tuple(models))]  # rank 0 writes them
    with safe_open(two / "model" / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys()
    assert_same_weights(weights(saved / "model"), weights(two / "model"))

    merged = tmp_path / "merged"
    assert export.cli([str(saved), str(merged)]) == 0
    for sub in ("", "critic"):
        assert_same_weights(weights(merged / sub), weights(two / "model" / sub))

    one = tmp_path / "one"
    train.main(load_config(None, args(one)))
    base = load_file(os.path.join(artifacts.model_dir, "model.safetensors"))
    gathered, alone = weights(two / "model"), weights(one / "model")
    assert gathered.keys() == alone.keys()
    noise = max((gathered[k] - alone[k]).abs().max().item() for k in gathered)
    moved = max((gathered[k] - base[k]).abs().max().item() for k in base)
    print(f"2 processes against 1: largest difference {noise:.1e}; training moved the weights by up to {moved:.1e}")
    assert noise <= 1e-5 and moved > 1e-3


def test_tied_weights_that_hold_different_values_are_refused(artifacts):
    """A state whose embedding and lm_head differ cannot be exported as the tied model its config names: the
    export refuses it instead of keeping one of the two silently (and it takes the state where they agree)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(artifacts.model_dir)
    assert config.tie_word_embeddings  # the embedded default's model ties them
    model = AutoModelForCausalLM.from_pretrained(artifacts.model_dir)
    state = {name: value.clone() for name, value in model.state_dict().items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    rebuilt = export.rebuild(AutoModelForCausalLM, config, state, torch.float32)
    assert rebuilt.get_output_embeddings().weight is rebuilt.get_input_embeddings().weight
    state["lm_head.weight"][0, 0] += 1.0
    with pytest.raises(export.ExportError, match="tied in the model's config but hold different values"):
        export.rebuild(AutoModelForCausalLM, config, state, torch.float32)
