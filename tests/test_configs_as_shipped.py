"""Every file in configs/ run as it is shipped, only smaller: its dtypes and mixed precision, LoRA and critic
settings, an evaluation at its batch relation, the end-of-run export, `python -m rlhf.evaluate` on that export,
the CLI export of the last checkpoint (the same weights, bit for bit) and a resume that repeats the last step.

What shrinks (SHRUNK, and nothing else): the model (a toy of the config's family: a tied Qwen2 for Qwen, a Llama
for SmolLM2, saved in bfloat16 as the hub's are; the embedded default and the lab's tasks at test size), the data
(GSM8K-schema rows made here), the batch (2 prompts per mini-batch, as many mini-batches per step as the config
has), the evaluation (2 problems a batch, as many batches as the config's evaluation of its whole held-out set
takes, its prompt pass 1 prompt at a time where the config sub-batches it), the response length, and the step count (2, a checkpoint after each). A new file in configs/ joins the
test by itself; one whose model is of a family the test cannot make fails, naming it.

The configs meant for several GPUs (the GSM8K recipes) also run under 2 processes (DDP on the CPU), and their
2-process checkpoint is exported by the CLI and resumed by 2 processes and by 1 (tests marked slow, which
.ci/run runs: python -m pytest -q -m slow tests/test_configs_as_shipped.py).
"""

import glob
import math
import os
import shutil

import pytest
import torch
import yaml
from accelerate.state import AcceleratorState
from helpers import REPO, TINY_EMBEDDED, assert_same_rows, embedded_overrides

import train
from rlhf import evaluate, export
from rlhf.config import load_config
from rlhf.tracking import read_metrics

CONFIGS = sorted(glob.glob(os.path.join(REPO, "configs", "*.yaml")))
SHRUNK = ("model.path", "data.train_files", "data.val_files", "data.train_batch_size", "data.val_batch_size",
          "data.val_prefill_batch_size", "data.max_val_samples", "data.max_response_length", "actor.ppo_mini_batch_size", "task.options",
          "trainer.total_steps", "trainer.save_freq", "trainer.test_freq", "trainer.output_dir", "trainer.cache_dir",
          "trainer.logger")
GSM8K_TEST = 1319  # problems in openai/gsm8k's test split, which a recipe evaluates whole
FAMILIES = {"qwen": "qwen2", "smollm": "llama"}  # a word of model.path -> the toy model's architecture

pytestmark = pytest.mark.usefixtures("one_thread")


def family(model_path: str) -> str:
    for word, arch in FAMILIES.items():
        if word in model_path.lower():
            return arch
    raise AssertionError(f"model.path={model_path!r}: this test makes toy models of the families {FAMILIES}; add "
                         "the new config's family to FAMILIES")


@pytest.fixture(scope="module")
def toy_parts(tmp_path_factory):
    """{arch: model directory} (toy models saved in bfloat16, with the embedded default's tokenizer and its ChatML
    template) and GSM8K-schema train/val files, made once."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from rlhf.data import write_jsonl
    from rlhf.embedded import generate_problems, train_tokenizer

    root = tmp_path_factory.mktemp("toy-parts")
    problems = generate_problems(64, seed=0)
    tokenizer = train_tokenizer([p["question"] + " " + p["answer"] for p in problems], vocab_size=500)
    shape = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    dirs = {}
    for arch, (config_class, model_class, tied) in {"qwen2": (Qwen2Config, Qwen2ForCausalLM, True),
                                                     "llama": (LlamaConfig, LlamaForCausalLM, True)}.items():
        torch.manual_seed(0)
        model = model_class(config_class(**shape, tie_word_embeddings=tied)).to(torch.bfloat16)
        dirs[arch] = str(root / arch)
        model.save_pretrained(dirs[arch])
        tokenizer.save_pretrained(dirs[arch])
    write_jsonl(problems[:40], str(root / "train.jsonl"))
    write_jsonl(problems[40:], str(root / "val.jsonl"))
    return dirs, str(root)


def shrunk(config_path: str, toy_parts, out_dir, processes: int = 1) -> list[str]:
    """The overrides of SHRUNK for the config at `config_path`."""
    with open(config_path) as f:
        shipped = yaml.safe_load(f)
    task = shipped.get("task", {}).get("name")
    args = []
    if task == "gsm8k":
        dirs, data = toy_parts
        args += [f"model.path={dirs[family(shipped['model']['path'])]}", f"data.train_files={data}/train.jsonl",
                 f"data.val_files={data}/val.jsonl"]
    elif task == "embedded":
        args += embedded_overrides(TINY_EMBEDDED)
    cfg, d = load_config(config_path, args), shipped.get("data", {})
    if d.get("val_files") == "openai/gsm8k":
        held_out = GSM8K_TEST
    elif task == "embedded":
        held_out = cfg.task.options.get("num_val", 256)
    else:
        held_out = cfg.data.max_val_samples or cfg.data.val_batch_size
    minibatches = cfg.data.train_batch_size // cfg.actor.ppo_mini_batch_size
    val_batches = math.ceil(held_out / cfg.data.val_batch_size)
    if cfg.data.val_prefill_batch_size:  # the evaluation's prompt pass in sub-batches, as the recipe's
        args.append("data.val_prefill_batch_size=1")
    return [*args, f"data.train_batch_size={2 * processes * minibatches}",
            f"actor.ppo_mini_batch_size={2 * processes}", "data.val_batch_size=2",
            f"data.max_val_samples={max(2, 2 * val_batches - 1)}",
            f"data.max_response_length={min(cfg.data.max_response_length, 12)}", "trainer.total_steps=2",
            "trainer.save_freq=1", "trainer.test_freq=0", f"trainer.output_dir={out_dir}",
            f"trainer.cache_dir={out_dir}/../cache", "trainer.logger=none"]


def run(cfg) -> None:
    """train.main(cfg), then accelerate's process-wide state reset: the next run sets its own mixed precision."""
    try:
        train.main(cfg)
    finally:
        AcceleratorState._reset_state(True)


def checkpoint_tensors(checkpoint) -> dict[str, torch.dtype]:
    from safetensors import safe_open

    dtypes = {}
    for path in sorted(glob.glob(os.path.join(checkpoint, "model*.safetensors"))):
        with safe_open(path, "pt") as f:
            dtypes.update({f"{os.path.basename(path)}:{name}": f.get_slice(name).get_dtype() for name in f.keys()})
    return dtypes


@pytest.mark.parametrize("config_path", CONFIGS, ids=lambda p: os.path.basename(p))
def test_the_config_runs_as_shipped(config_path, toy_parts, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # the configs' relative paths are relative to the repository
    out = tmp_path / "run"
    args = shrunk(config_path, toy_parts, out)
    assert {arg.split("=")[0].removeprefix("task.options.") for arg in args} - set(SHRUNK) <= set(
        vars(TINY_EMBEDDED))  # nothing but SHRUNK changes (task.options: the embedded default's test size)
    cfg = load_config(config_path, args)
    run(cfg)
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2] and all(r["actor/skipped_updates"] == 0 for r in rows[1:])

    # What trains is float32, whatever model.dtype: in the checkpoint (a LoRA run's holds what it trains only).
    last = out / "checkpoints" / "step_2"
    dtypes = checkpoint_tensors(last)
    floats = {name: dtype for name, dtype in dtypes.items() if dtype in ("F64", "F32", "F16", "BF16")}
    assert floats and all(dtype == "F32" for dtype in floats.values()), floats

    # The end-of-run export equals the CLI's export of the last checkpoint, bit for bit, and loads as float32.
    from safetensors.torch import load_file

    assert export.cli([str(last), str(tmp_path / "cli_model")]) == 0
    end_of_run = load_file(str(out / "model" / "model.safetensors"))
    from_cli = load_file(str(tmp_path / "cli_model" / "model.safetensors"))
    assert end_of_run.keys() == from_cli.keys()
    for name, value in end_of_run.items():
        assert value.dtype == torch.float32 and torch.equal(value, from_cli[name]), name

    # python -m rlhf.evaluate on the export, where the task has held-out problems.
    if cfg.task.name in ("gsm8k", "embedded"):
        try:
            report = evaluate.main(["--model", str(out / "model"), "--config", str(out / "config.yaml")])
        finally:
            AcceleratorState._reset_state(True)
        assert report["num_problems"] == cfg.data.max_val_samples

    # Resume: the last checkpoint gone, as if killed during the last step; the resumed run repeats it.
    shutil.rmtree(last)
    run(load_config(config_path, [*args, "trainer.resume_from=auto"]))
    assert_same_rows(read_metrics(out / "metrics.jsonl"), rows)


SEVERAL_GPUS = [p for p in CONFIGS if "openai/gsm8k" in open(p).read()]  # the GPU recipes: one GPU or several


def launch(args: list[str], tmp_path) -> None:
    """train.py under `accelerate launch --multi_gpu --num_processes 2` (DDP; on the CPU, over gloo)."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {key: value for key, value in os.environ.items() if key != "ACCELERATE_USE_CPU"}
    env.update({"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": REPO})
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--dynamo_backend", "no", "--main_process_port", str(port),
               os.path.join(REPO, "train.py"), *args]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("config_path", SEVERAL_GPUS, ids=lambda p: os.path.basename(p))
def test_the_recipe_runs_on_two_processes_and_its_checkpoint_exports_and_resumes(config_path, toy_parts, tmp_path,
                                                                                   monkeypatch):
    """2 DDP processes: the run, the CLI export of its checkpoint (the run's own export, bit for bit), a 2-process
    resume repeating the last step, and 1 process continuing from the 2-process checkpoint."""
    from safetensors.torch import load_file

    monkeypatch.chdir(REPO)
    out = tmp_path / "run"
    args = ["--config", config_path, *shrunk(config_path, toy_parts, out, processes=2)]
    launch(args, tmp_path)
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    last = out / "checkpoints" / "step_2"
    assert export.cli([str(last), str(tmp_path / "cli_model")]) == 0
    mine, runs = (load_file(str(d / "model.safetensors")) for d in (tmp_path / "cli_model", out / "model"))
    assert mine.keys() == runs.keys() and all(torch.equal(mine[k], runs[k]) for k in mine)
    shutil.rmtree(last)
    launch([*args, "trainer.resume_from=auto"], tmp_path)
    assert_same_rows(read_metrics(out / "metrics.jsonl"), rows)
    run(load_config(config_path, [*args[2:], "trainer.resume_from=auto", "trainer.total_steps=3"]))
    continued = read_metrics(out / "metrics.jsonl")
    assert continued[-1]["step"] == 3 and continued[-1]["actor/skipped_updates"] == 0
