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


def test_every_part_runs_at_toy_size_on_the_cpu(tmp_path, monkeypatch):
    """Every part runs (or says why it cannot: the CUDA tests, the compiled step at toy size), in the order of
    docs/gpu.md, and prints one line with its estimate as it starts and one with its numbers as it ends; the
    first line comes before anything else."""
    monkeypatch.syspath_prepend(os.path.dirname(SCRIPT))  # gpu_check.memory_model() imports recipe_memory from there
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, SCRIPT, "--toy", "--device", "cpu", "--out", str(tmp_path),
                           "--prepared", str(tmp_path / "nothing"), "--budget", "3000"], env=env, capture_output=True,
                          text=True, timeout=600)
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
    assert done.stdout.splitlines()[0].endswith(f"writing {tmp_path / 'gpu_check.json'}")
    starts = [line for line in done.stdout.splitlines() if ": start, estimated " in line]
    assert [line.split("] ")[1].split(":")[0] for line in starts] == list(gpu_check.PARTS)
    assert all(parts[name]["estimated_s"] == gpu_check.TOY_ESTIMATED_S[name] for name in parts)
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
    for recipe in ("ppo", "grpo"):  # the recipe's batch (toy: 4), a prefill sub-batch of 3, the longest test prompt
        record = parts["lora_evaluation"][recipe]
        assert (record["batch"], record["prefill_batch"]) == (4, 3) and record["seconds"] > 0
        assert record["prompt_width"] == gpu_check.memory_model().GSM8K_TEST_PROMPT_TOKENS
    runs = parts["decoding"]["runs"]
    assert {(run["loop"], run["batch"]) for run in runs} == {("static", 1), ("static", 4), ("static", 16), ("reference", 4)}
    assert all(run["ms_per_token"] > 0 and run["prefill_s"] > 0 and run["times_floor"] > 0 for run in runs)
    assert parts["decoding"]["copy_bandwidth_gb_s"] > 0
    for setting in ("checkpointing", "no_checkpointing"):
        sweep = parts["memory_sweep"][setting]
        assert [entry["micro_batch"] for entry in sweep] == [1, 2, 4]
        assert sweep[0]["computed_update_gib"] < sweep[-1]["computed_update_gib"]  # more rows of logits kept
    assert parts["checkpoint"]["gib"] > 0 and parts["checkpoint"]["seconds_to_write"] > 0


def test_a_part_whose_estimate_does_not_fit_the_budget_left_is_skipped_and_said_so(tmp_path, monkeypatch, capsys):
    """A part starts where its estimate fits what is left of --budget, and is skipped, with its estimate and what
    was left, where it does not; the default budget leaves 60 s or more under a 600 s call."""
    assert 0 < gpu_check.DEFAULT_BUDGET_S <= 600 - 60
    monkeypatch.setattr(gpu_check, "TOY_ESTIMATED_S", {**gpu_check.TOY_ESTIMATED_S, "embedded_default": 10**6})
    code = gpu_check.main(["--toy", "--device", "cpu", "--out", str(tmp_path), "--budget", "600", "--parts",
                           "cuda_tests", "embedded_default", "--prepared", str(tmp_path / "nothing")])
    with open(tmp_path / "gpu_check.json") as f:
        parts = json.load(f)["parts"]
    assert code == 0 and parts["cuda_tests"]["status"] == "skipped"  # started: it needs a CUDA device
    assert parts["embedded_default"]["status"] == "skipped"
    note = parts["embedded_default"]["note"]
    assert note.startswith("estimated 1000000 s, ") and note.endswith(" s of the --budget of 600 s left")
    printed = capsys.readouterr().out
    assert "cuda_tests: start, estimated 1 s" in printed and f"embedded_default: skipped | {note}" in printed


def test_without_a_gpu_it_says_so_and_stops_at_once(tmp_path):
    done = subprocess.run([sys.executable, SCRIPT, "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "no CUDA device" in done.stderr and "--toy --device cpu" in done.stderr
    with open(tmp_path / "gpu_check.json") as f:  # the JSON says it too, and that nothing ran
        report = json.load(f)
    assert "no CUDA device" in report["error"] and report["parts"] == {}
    assert "gpu_check: budget " in done.stdout.splitlines()[0]


def test_without_pip_the_install_fails_with_pip_s_message_and_the_check_goes_on(tmp_path, monkeypatch):
    """A Python without pip (its message, as `python -m pip` prints it): the first line and the JSON come first,
    the install is recorded as failed with pip's message, and the parts run."""
    fake = tmp_path / "python-without-pip"
    fake.write_text(f"#!/bin/sh\n[ \"$1\" = -m ] && [ \"$2\" = pip ] && {{ echo '{sys.executable}: No module named "
                    f"pip' >&2; exit 1; }}\nexec {sys.executable} \"$@\"\n")
    fake.chmod(0o755)
    (tmp_path / "prepared" / "wheels").mkdir(parents=True)
    (tmp_path / "prepared" / "wheels" / "no_such_package_here-1.0-py3-none-any.whl").write_bytes(b"")
    monkeypatch.setattr(sys, "executable", str(fake))
    code = gpu_check.main(["--toy", "--device", "cpu", "--out", str(tmp_path / "out"), "--parts", "cuda_tests",
                           "--prepared", str(tmp_path / "prepared")])
    with open(tmp_path / "out" / "gpu_check.json") as f:
        report = json.load(f)
    assert code == 0 and report["install"]["status"] == "failed"
    assert report["install"]["error"].endswith("No module named pip")
    assert report["parts"]["cuda_tests"]["status"] == "skipped"  # ran: it needs a CUDA device


def test_a_part_short_of_its_package_fails_with_how_to_bring_it_and_the_next_runs(tmp_path, monkeypatch):
    """pytest for the CUDA tests, datasets for the embedded default, peft for the LoRA parts: here a package that
    does not exist stands for one the image lacks."""
    monkeypatch.setitem(gpu_check.PART_NEEDS, "cuda_tests", ("no_such_package_here",))
    monkeypatch.setitem(gpu_check.PART_NEEDS, "embedded_default", ())
    code = gpu_check.main(["--toy", "--device", "cpu", "--out", str(tmp_path), "--parts", "cuda_tests",
                           "embedded_default", "--prepared", str(tmp_path / "nothing")])
    with open(tmp_path / "gpu_check.json") as f:
        parts = json.load(f)["parts"]
    assert code == 1 and parts["cuda_tests"]["status"] == "failed"
    assert parts["cuda_tests"]["error"] == ("missing package(s) no_such_package_here: python bench/prepare_gpu_check.py "
                                            "--packages no_such_package_here carries their wheels")
    assert parts["embedded_default"]["status"] == "ok"  # the next part ran


def test_the_compiled_step_without_a_c_compiler_fails_saying_so(monkeypatch):
    import shutil

    import pytest

    class Args:
        toy, device = False, "cpu"

    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match=r"no C compiler \(cc, gcc or clang\) on PATH"):
        gpu_check.compiled_decoding({}, Args, "unused", None, None, None)


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
