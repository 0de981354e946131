"""bench/gpu_check.py at toy size on the CPU: every part runs and writes what docs/gpu.md says to read, so the
script a GPU machine runs cannot rot; and without a GPU or a package it stops at once, naming what to bring."""

import importlib.util
import json
import os
import subprocess
import sys

from helpers import REPO

SCRIPT = os.path.join(REPO, "bench", "gpu_check.py")
_spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
gpu_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check)


def test_every_part_runs_at_toy_size_on_the_cpu(tmp_path):
    """Every part runs (or says why it cannot: the CUDA tests, the compiled step at toy size), in the order of
    docs/gpu.md, and prints one line with its numbers."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, SCRIPT, "--toy", "--device", "cpu", "--out", str(tmp_path),
                           "--prepared", str(tmp_path / "nothing")], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(os.listdir(tmp_path)) == ["gpu_check.json", "gpu_check.log"]
    with open(tmp_path / "gpu_check.json") as f:
        report = json.load(f)
    parts = report["parts"]
    assert list(parts) == list(gpu_check.PARTS)
    cannot_run = {"cuda_tests", "compiled_decoding"}  # the test extra installs peft: the LoRA recipes run
    assert {name for name, p in parts.items() if p["status"] != "ok"} == cannot_run, parts
    assert all(parts[name]["status"] == "skipped" and parts[name]["note"] for name in cannot_run)
    lines = [line for line in done.stdout.splitlines() if " in " in line and line.split("] ")[-1].split(":")[0] in parts]
    assert [line.split("] ")[1].split(":")[0] for line in lines] == list(gpu_check.PARTS)
    assert all(parts[name].get("summary", parts[name].get("note")) in line for name, line in zip(parts, lines))
    assert report["finished"] and report["prompts"]["rows"] > 1000
    assert set(parts["embedded_default"]["accuracy_by_step"]) == {"0", "2"}
    for name in ("recipes", "settings_80gb", "lora_recipes"):
        for recipe, responses in (("ppo", 4), ("grpo", 20)):
            responses //= 2 if name == "settings_80gb" else 1  # one mini-batch of prompts
            record = parts[name][recipe]
            assert len(record["steps"]) == 2 and record["responses"] == responses
            assert record["mixed_precision"] == "bf16"  # the recipe's own, after the previous part's
            assert all(set(step["phases"]) == {"sampling", "log-probs", "update"} for step in record["steps"])
            assert all(phase["seconds"] > 0 for step in record["steps"] for phase in step["phases"].values())
    assert not parts["settings_80gb"]["ppo"]["gradient_checkpointing"]  # the 80 GB column's setting
    assert parts["recipes"]["ppo"]["gradient_checkpointing"]
    assert all(parts["evaluation"][recipe]["response_tokens"] > 0 for recipe in ("ppo", "grpo"))
    runs = parts["decoding"]["runs"]
    assert {(run["loop"], run["batch"]) for run in runs} == {("static", 1), ("static", 4), ("static", 16), ("reference", 4)}
    assert all(run["ms_per_token"] > 0 and run["prefill_s"] > 0 and run["times_floor"] > 0 for run in runs)
    assert parts["decoding"]["copy_bandwidth_gb_s"] > 0
    for setting in ("checkpointing", "no_checkpointing"):
        sweep = parts["memory_sweep"][setting]
        assert [entry["micro_batch"] for entry in sweep] == [1, 2, 4]
        assert sweep[0]["computed_update_gib"] < sweep[-1]["computed_update_gib"]  # more rows of logits kept
    assert parts["checkpoint"]["gib"] > 0 and parts["checkpoint"]["seconds_to_write"] > 0


def test_parts_past_the_budget_are_skipped_and_said_so(tmp_path):
    done = subprocess.run([sys.executable, SCRIPT, "--toy", "--device", "cpu", "--out", str(tmp_path), "--budget", "0",
                           "--parts", "cuda_tests", "checkpoint"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    with open(tmp_path / "gpu_check.json") as f:
        parts = json.load(f)["parts"]
    assert {name: part["status"] for name, part in parts.items()} == {"checkpoint": "skipped", "cuda_tests": "skipped"}
    assert ("skipped: checkpoint (over the --budget of 0 s), cuda_tests (over the --budget of 0 s)" in done.stdout)


def test_without_a_gpu_it_says_so_and_stops_at_once(tmp_path):
    done = subprocess.run([sys.executable, SCRIPT, "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "no CUDA device" in done.stderr and "--toy --device cpu" in done.stderr
    assert not os.listdir(tmp_path)  # nothing run, nothing written


def test_a_missing_package_is_named_with_how_to_bring_it(monkeypatch):
    class Args:
        toy, device, real, prepared = True, "cpu", False, "/nonexistent"

    monkeypatch.setattr(gpu_check, "NEEDED", (*gpu_check.NEEDED, "no_such_package_here"))
    message = gpu_check.preflight(Args)
    assert "missing package(s): no_such_package_here" in message
    assert "prepare_gpu_check.py --packages no_such_package_here" in message


def test_unprepared_files_are_named(tmp_path):
    class Args:
        toy, device, real, prepared = False, "cpu", False, str(tmp_path)

    assert "run python bench/prepare_gpu_check.py" in gpu_check.preflight(Args)


def test_the_core_imports_neither_datasets_nor_wandb():
    """What a bare CUDA image lacks is imported only where it is used: the trainer, the prompts and the decoder
    load without `datasets` or `wandb`."""
    code = ("import sys, train, rlhf.data, rlhf.decode, rlhf.held_out; "
            "print(sorted(m for m in ('datasets', 'wandb') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert done.stdout.strip() == "[]"


def test_a_set_up_model_let_go_is_freed_without_a_garbage_collection(artifacts, tmp_path):
    """Under mixed precision, accelerate's prepare wraps each model's forward, and unwrapping it leaves a forward
    bound to the model in its own attributes: a cycle that keeps the model (on a GPU, its weights and AdamW
    moments) until a full garbage collection, so the next part of the GPU check would measure on top of it."""
    import gc
    import weakref

    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from helpers import tiny_overrides

    from rlhf.config import load_config
    from rlhf.setup import setup

    cfg = load_config(os.path.join(REPO, "configs", "tiny.yaml"),
                      tiny_overrides(artifacts, str(tmp_path), "trainer.mixed_precision=bf16"))
    AcceleratorState._reset_state(True)
    gc.disable()  # collected only by reference counts from here
    try:
        accelerator = Accelerator(mixed_precision="bf16", cpu=True)
        run = setup(cfg, accelerator)
        actor, critic = (weakref.ref(m) for m in run.models[:2])
        assert "forward" not in vars(actor())  # the class's forward, not one bound to the model
        del run, accelerator
        AcceleratorState._reset_state(True)
        assert actor() is None and critic() is None
    finally:
        gc.enable()
        AcceleratorState._reset_state(True)


def test_prepare_says_at_once_that_the_hub_is_unreachable_and_writes_the_fallbacks(tmp_path, monkeypatch):
    """With the hub's endpoint refusing connections, the preparing script knows it from one connection attempt and
    writes the tokenizer and the model config from its fallbacks without asking the hub (seconds, no retries)."""
    import time

    spec = importlib.util.spec_from_file_location("prepare_gpu_check", os.path.join(REPO, "bench", "prepare_gpu_check.py"))
    prepare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prepare)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens
    start = time.perf_counter()
    reason = prepare.hub_unreachable()
    assert reason and "127.0.0.1:9" in reason
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.syspath_prepend(os.path.join(REPO, "bench"))
    sources = prepare.tokenizer_and_config(str(tmp_path), hub=False)
    assert prepare.gsm8k_test(str(tmp_path), hub=False) == "not written: the hub is unreachable"
    assert time.perf_counter() - start < 60
    assert "lab.real_parts" in sources["tokenizer"] and "no hub" in sources["config"]
    with open(tmp_path / "qwen2.5-0.5b-config.json") as f:
        assert json.load(f)["vocab_size"] == 151_936
    assert prepare.hub_unreachable() == "HF_HUB_OFFLINE is set"
