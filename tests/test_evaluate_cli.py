"""python -m rlhf.evaluate: the trainer's own evaluation of any model, the paired difference to a baseline, the
JSON report, and bad input refused before any model loads."""

import datetime
import json
import math
import os
import statistics
import subprocess
import sys

import pytest
import torch
from accelerate import Accelerator
from helpers import REPO, TINY_EMBEDDED, embedded_overrides, tiny_qwen2

from rlhf import evaluate as cli
from rlhf import held_out
from rlhf.stats import t95
from rlhf.config import ConfigError, load_config
from rlhf.models import load_causal_lm, load_tokenizer
from rlhf.processes import eval_batches
from rlhf.rewards import load_reward, score_batch
from rlhf.rollout import SamplingParams, generate, left_pad
from rlhf.setup import setup

pytestmark = pytest.mark.usefixtures("one_thread")

# The parity of a response's token ids plus its reference answer: right for about half the problems whatever the
# model, so accuracies and their per-problem differences are not all 0 (GSM8K's rule scores the tiny model 0).
PARITY_REWARD = """
def parity(completion_ids, ground_truth, **fields):
    return [float((sum(ids) + int(truth)) % 2 == 0) for ids, truth in zip(completion_ids, ground_truth)]
"""


@pytest.fixture(scope="module")
def models(artifacts, tmp_path_factory):
    """A tiny random Qwen2 saved with the embedded tokenizer as a plain save_pretrained directory (what a training
    run exports as <output_dir>/model), a copy with perturbed weights, and the parity reward importable. (The
    tiny warm start answers every problem with the same newlines: no per-problem differences to see.)"""
    root = tmp_path_factory.mktemp("evaluate-cli")
    (root / "evaluate_cli_reward.py").write_text(PARITY_REWARD)
    sys.path.insert(0, str(root))
    tokenizer, model = load_tokenizer(artifacts.model_dir), tiny_qwen2(vocab_size=512, eos_token_id=2, pad_token_id=0)
    dirs = {"model": str(root / "model"), "perturbed": str(root / "perturbed"), "reward_dir": str(root)}
    model.save_pretrained(dirs["model"])
    tokenizer.save_pretrained(dirs["model"])
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * p.std() * torch.randn(p.shape, generator=generator))
    model.save_pretrained(dirs["perturbed"])
    tokenizer.save_pretrained(dirs["perturbed"])
    yield dirs
    sys.path.remove(str(root))


def overrides(artifacts, tmp_path, *extra):
    """The tiny files' 16 held-out problems in 2 batches, 16-token responses, the parity reward."""
    return [f"data.val_files={artifacts.val_file}", "data.max_prompt_length=96", "data.max_response_length=16",
            "data.val_batch_size=8", "reward.function=evaluate_cli_reward:parity", "trainer.logger=none",
            f"trainer.output_dir={tmp_path / 'out'}", *extra]


# GSM8K-schema tasks' metrics beside val/accuracy, whatever the reward (here the parity reward): greedy, then sampled.
ANSWER_FORMAT = ("val/greedy_clip_ratio", "val/greedy_strict_accuracy", "val/greedy_flexible_accuracy",
                 "val/greedy_no_answer_rate", "val/strict_accuracy", "val/flexible_accuracy", "val/no_answer_rate")


def embedded_held_out(artifacts):
    """data.val_files=embedded, resolved from the tiny embedded cache (which also gives the habit metric)."""
    return ["data.val_files=embedded", *embedded_overrides(TINY_EMBEDDED),
            f"trainer.cache_dir={os.path.dirname(os.path.dirname(artifacts.model_dir))}"]


def test_the_commands_metrics_are_the_trainers_evaluation_of_the_same_model(artifacts, models, tmp_path):
    """On the embedded held-out split with 4 samples: every number (greedy accuracy, pass@k, maj@4, the habit
    rates) equals what the trainer's evaluate logs at step 0 for a run whose model.path is the same directory."""
    argv = overrides(artifacts, tmp_path, *embedded_held_out(artifacts))
    report = cli.main(["--model", models["model"], "--samples", "4", *argv])

    cfg = load_config(None, [*argv, f"model.path={models['model']}", "trainer.val_samples=4"])
    expected = held_out.evaluate(cfg, Accelerator(), setup(cfg, Accelerator()), step=0)
    assert set(expected) == {"val/accuracy", "val/greedy_habit_rate", "val/pass@1", "val/pass@2", "val/pass@4",
                             "val/maj@4", "val/habit_rate", *ANSWER_FORMAT}
    assert report["metrics"]["model"] == expected  # exactly: the same code
    assert 0 < expected["val/accuracy"] < 1 and report["num_problems"] == TINY_EMBEDDED.num_val
    assert "differences" not in report  # no baseline


def test_a_model_against_itself_differs_by_zero_with_the_interval_zero(artifacts, models, tmp_path):
    """Paired by problem, a model and itself differ by exactly 0 on every problem, so the interval is [0, 0]; an
    unpaired interval would not be, since the per-problem values vary."""
    report = cli.main(["--model", models["model"], "--baseline", models["model"], "--samples", "2",
                       *overrides(artifacts, tmp_path)])
    assert set(report["differences"]) == {"val/accuracy", "val/pass@1", "val/pass@2", "val/maj@2", *ANSWER_FORMAT}
    for name, d in report["differences"].items():
        assert d["mean"] == 0.0 and d["low"] == 0.0 and d["high"] == 0.0, name
    assert statistics.stdev(report["per_problem"]["model"]["val/accuracy"]) > 0
    assert report["metrics"]["model"] == report["metrics"]["baseline"]


def greedy_correct(model_dir, cfg):
    """Each held-out problem's greedy correctness, computed here without evaluate: the same batches (8 rows),
    the trainer's decoding and the config's reward."""
    from rlhf.data import load_held_out

    tokenizer, model = load_tokenizer(model_dir), load_causal_lm(model_dir).eval()
    val_set, _ = load_held_out(cfg, tokenizer, cfg.data.val_files)
    reward = load_reward(cfg)
    correct = []
    for rows_index in eval_batches(len(val_set), cfg.data.val_batch_size, 0, 1):
        rows = val_set[rows_index]
        with torch.no_grad():
            batch = generate(model, tokenizer, *left_pad(rows["input_ids"], tokenizer.pad_token_id),
                             SamplingParams(cfg.data.max_response_length, greedy=True))
        correct += [float(c) for c in reward.is_correct(score_batch(reward, tokenizer, batch, rows).scores.tolist())]
    return correct


def test_the_difference_to_a_perturbed_copy_is_the_mean_of_per_problem_differences(artifacts, models, tmp_path,
                                                                                     capsys):
    """The perturbed copy against the model: each problem's correctness is the one computed here independently,
    and the printed and written difference is the mean over problems of their differences, its interval
    t95(n - 1) sd / sqrt(n) around it."""
    argv = overrides(artifacts, tmp_path)
    output = tmp_path / "report.json"
    cli.main(["--model", models["perturbed"], "--baseline", models["model"], "--output", str(output), *argv])
    printed = capsys.readouterr().out
    report = json.loads(output.read_text())

    cfg = load_config(None, argv)
    perturbed, original = greedy_correct(models["perturbed"], cfg), greedy_correct(models["model"], cfg)
    differences = [a - b for a, b in zip(perturbed, original)]
    n, mean = len(differences), statistics.fmean(differences)
    half_width = t95(n - 1) * statistics.stdev(differences) / math.sqrt(n)
    assert n == 16 and mean != 0  # the copy answers differently
    assert report["per_problem"]["model"]["val/accuracy"] == perturbed  # each problem's own, in the split's order
    assert report["per_problem"]["baseline"]["val/accuracy"] == original
    d = report["differences"]["val/accuracy"]
    assert d["mean"] == pytest.approx(mean, abs=1e-12)
    assert d["half_width"] == pytest.approx(half_width, abs=1e-12)
    assert (d["low"], d["high"]) == pytest.approx((mean - half_width, mean + half_width), abs=1e-12)
    row = next(line for line in printed.splitlines() if line.startswith("| val/accuracy |"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    shown_mean, interval = cells[3].split(" ", 1)
    low, high = (float(x) for x in interval.strip("[]").split(","))
    assert float(shown_mean) == pytest.approx(mean, abs=5e-4)
    assert (low, high) == pytest.approx((mean - half_width, mean + half_width), abs=5e-4)


def test_the_json_report(artifacts, models, tmp_path):
    """What --output writes: the date, the config and overrides, the held-out data, both models, their metrics
    (the mean of their per-problem values), the differences with intervals, the number of problems."""
    output = tmp_path / "sub" / "report.json"
    argv = overrides(artifacts, tmp_path, "data.max_val_samples=12")
    returned = cli.main(["--model", models["perturbed"], "--baseline", models["model"], "--samples", "2",
                         "--config", os.path.join(REPO, "configs", "tiny.yaml"), "--output", str(output), *argv])
    report = json.loads(output.read_text())
    assert report == json.loads(json.dumps(returned))
    assert report["date"] == datetime.date.today().isoformat()
    assert report["config"].endswith("configs/tiny.yaml")
    assert report["overrides"] == [*argv, "trainer.val_samples=2"]
    assert report["held_out"]["source"] == artifacts.val_file and report["num_problems"] == 12
    assert report["samples"] == 2
    assert report["models"] == {"model": models["perturbed"], "baseline": models["model"]}
    names = ["val/accuracy", *ANSWER_FORMAT[:4], "val/pass@1", "val/pass@2", "val/maj@2", *ANSWER_FORMAT[4:]]
    for role in ("model", "baseline"):
        assert list(report["metrics"][role]) == names
        for name in names:
            values = report["per_problem"][role][name]
            assert len(values) == 12 and report["metrics"][role][name] == pytest.approx(statistics.fmean(values))
    for name in names:
        d = report["differences"][name]
        assert d["low"] <= d["mean"] <= d["high"]
        assert d["mean"] == pytest.approx(report["metrics"]["model"][name] - report["metrics"]["baseline"][name])


# ----------------------------------------------------------------------------- refused before any model loads


@pytest.fixture
def no_model_loads(monkeypatch):
    """Any model load fails the test: a refusal must come first."""
    from transformers import AutoModelForCausalLM

    def fail(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was refused")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", fail)


def save(directory, model=None, tokenizer_from=None):
    """A save_pretrained directory of `model` with the tokenizer of `tokenizer_from`."""
    if model is not None:
        model.save_pretrained(directory)
    if tokenizer_from is not None:
        load_tokenizer(tokenizer_from).save_pretrained(directory)
    return str(directory)


def refusal(artifacts, tmp_path, argv):
    with pytest.raises(ConfigError) as error:
        cli.main([*argv, *overrides(artifacts, tmp_path)])
    return str(error.value)


@pytest.mark.usefixtures("no_model_loads")
def test_no_model_at_the_path_is_refused(artifacts, models, tmp_path):
    message = refusal(artifacts, tmp_path, ["--model", str(tmp_path / "missing")])
    assert "does not exist" in message and "save_pretrained" in message and "hub name" in message
    (tmp_path / "empty").mkdir()
    message = refusal(artifacts, tmp_path, ["--model", str(tmp_path / "empty")])
    assert "holds no model (no config.json; found: nothing)" in message
    run_dir = tmp_path / "run"  # a training run's output directory, its model in model/
    save(run_dir / "model", tiny_qwen2(), artifacts.model_dir)
    message = refusal(artifacts, tmp_path, ["--model", str(run_dir)])
    assert f"whose model is {str(run_dir / 'model')!r}" in message
    config_only = tmp_path / "config-only"
    tiny_qwen2().config.save_pretrained(config_only)
    assert "no weights (one of model.safetensors" in refusal(artifacts, tmp_path, ["--model", str(config_only)])
    # the baseline is checked too, before the model loads
    message = refusal(artifacts, tmp_path, ["--model", models["model"], "--baseline", str(tmp_path / "missing")])
    assert message.startswith("--baseline") and "does not exist" in message


@pytest.mark.usefixtures("no_model_loads")
def test_a_tokenizer_that_is_not_the_models_is_refused(artifacts, tmp_path):
    """The embedded tokenizer (EOS <|im_end|> = 2) with a model of 256 embedding rows, and with a model
    whose config ends sequences with id 7; with a model of 512 rows and EOS 2 it is accepted (padded rows)."""
    num_ids = len(load_tokenizer(artifacts.model_dir))  # 494 at the tests' size
    small = save(tmp_path / "small", tiny_qwen2(vocab_size=256, eos_token_id=2), artifacts.model_dir)
    message = refusal(artifacts, tmp_path, ["--model", small])
    assert f"the tokenizer has {num_ids} token ids but the model's embedding has 256 rows" in message
    other_eos = save(tmp_path / "eos", tiny_qwen2(vocab_size=512, eos_token_id=7), artifacts.model_dir)
    message = refusal(artifacts, tmp_path, ["--model", other_eos])
    assert "EOS token is '<|im_end|>' (id 2), but the model's config names id(s) 7" in message

    matching = save(tmp_path / "matching", tiny_qwen2(vocab_size=512, eos_token_id=2), artifacts.model_dir)
    assert cli.load_checked_tokenizer(matching).eos_token_id == 2


@pytest.mark.usefixtures("no_model_loads")
@pytest.mark.parametrize("config", ["bandit.yaml", "tree.yaml"])
def test_a_config_without_held_out_problems_is_refused(models, config, capsys):
    argv = ["--model", models["model"], "--config", os.path.join(REPO, "configs", config)]
    with pytest.raises(ConfigError, match="has no held-out problems to evaluate on .*data.val_files is 'embedded'"):
        cli.main(argv)
    assert cli.cli(argv) == 2 and "error: config" in capsys.readouterr().err


def test_the_command_line_on_a_hub_name(artifacts, models, tmp_path):
    """`python -m rlhf.evaluate` in a subprocess, the model given by a hub name that the hub's cache holds
    (offline): the same numbers as the model's directory, the table printed and the JSON written."""
    snapshot = tmp_path / "hub" / "models--test-org--tiny-gsm8k" / "snapshots" / ("0" * 40)
    snapshot.parent.mkdir(parents=True)
    save(snapshot, load_causal_lm(models["model"]), models["model"])
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0" * 40)
    argv = overrides(artifacts, tmp_path)
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([REPO, models["reward_dir"]])}
    output = tmp_path / "hub.json"
    done = subprocess.run([sys.executable, "-m", "rlhf.evaluate", "--model", "test-org/tiny-gsm8k", "--output",
                           str(output), *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(output.read_text())
    assert report["models"] == {"model": "test-org/tiny-gsm8k"}
    assert report["metrics"]["model"] == cli.main(["--model", models["model"], *argv])["metrics"]["model"]
    assert f"| val/accuracy | {report['metrics']['model']['val/accuracy']:.3f} |" in done.stdout
