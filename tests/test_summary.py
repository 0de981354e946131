"""What a run prints: a line per evaluation and, at the end, the summary of its result and of where it is."""

import os

import pytest
from helpers import tiny_overrides

import train
from rlhf.config import load_config
from rlhf.tracking import eval_line, read_metrics, run_summary

pytestmark = pytest.mark.usefixtures("one_thread")


def test_eval_line_shows_the_evaluation_and_the_exact_kl():
    line = eval_line(20, {"val/accuracy": 0.53125, "val/pass@1": 0.5, "kl/full": 0.01234, "actor/pg_loss": 3.0})
    assert line == "step 20: val/accuracy 0.531, val/pass@1 0.500, kl/full 0.0123"


def test_run_summary_puts_the_first_and_last_evaluation_side_by_side():
    rows = [{"step": 0, "val/accuracy": 0.25, "val/greedy_habit_rate": 0.5},
            {"step": 1, "kl/full": 0.03},
            {"step": 2, "val/accuracy": 0.75, "val/greedy_habit_rate": 0.125, "kl/full": 0.05}]
    text = run_summary(rows, 125.0, {"model": "out/model", "evaluate": "python -m rlhf.evaluate ..."})
    lines = text.splitlines()
    assert lines[0] == "done: step 2 in 2 min 05 s"
    assert lines[1].split() == ["step", "0", "step", "2"]
    assert lines[2].split() == ["val/accuracy", "0.250", "0.750"]
    assert lines[3].split() == ["val/greedy_habit_rate", "0.500", "0.125"]
    assert lines[4].split() == ["kl/full", "(last", "step)", "0.0500"]
    assert lines[5:] == ["model:    out/model", "evaluate: python -m rlhf.evaluate ..."]


def test_a_run_prints_each_evaluation_and_its_summary(artifacts, tmp_path, capsys):
    """The real trainer: every evaluation's line, then the summary with the logged numbers, the files that
    exist (metrics, the last checkpoint, the model) and the evaluate command for the model."""
    out = str(tmp_path / "run")
    train.main(load_config(None, tiny_overrides(artifacts, out, "trainer.logger=none", "trainer.test_freq=1")))
    printed = capsys.readouterr()
    text = printed.out + printed.err  # the evaluation lines go through tqdm's write, above the bar
    rows = read_metrics(os.path.join(out, "metrics.jsonl"))
    for row in (r for r in rows if "val/accuracy" in r):
        assert eval_line(row["step"], row) in text
    summary = printed.out[printed.out.index("done: step"):].splitlines()
    assert summary[2].split() == ["val/accuracy", f"{rows[0]['val/accuracy']:.3f}", f"{rows[-1]['val/accuracy']:.3f}"]
    assert summary[3].split()[0] == "val/greedy_strict_accuracy" and summary[4].split()[0] == "val/greedy_flexible_accuracy"
    where = dict(line.split(": ", 1) for line in summary if line.split(":")[0] in
                 ("metrics", "wandb", "checkpoint", "model", "samples", "evaluate"))
    assert where["metrics"].strip() == os.path.join(out, "metrics.jsonl")
    assert where["samples"].strip() == os.path.join(out, "samples.jsonl") and os.path.isfile(where["samples"].strip())
    assert os.path.isdir(where["checkpoint"].split()[0])
    model = where["model"].split()[0]
    assert os.path.isfile(os.path.join(model, "config.json"))
    assert where["evaluate"].strip().startswith(f"python -m rlhf.evaluate --model {model} --baseline ")
    assert where["wandb"].strip().startswith("off")


def test_the_run_warns_of_symptoms_it_sees_once_naming_the_page():
    from rlhf.tracking import Symptoms

    symptoms = Symptoms(equal_steps=3)
    seen = [symptoms.check(step, {"critic/groups_with_equal_scores": equal})
            for step, equal in enumerate([1.0, 1.0, 0.5, 1.0, 1.0, 1.0, 1.0], start=1)]
    assert [len(m) for m in seen] == [0, 0, 0, 0, 0, 1, 0]  # 3 in a row: steps 4-6, once
    assert seen[5][0].startswith("steps 4-6: every group") and "troubleshooting.md#every-group-scores-the-same" in seen[5][0]
    assert symptoms.check(0, {"val/greedy_strict_accuracy": 0.0, "val/greedy_flexible_accuracy": 0.0}) == []
    assert symptoms.check(0, {"val/greedy_strict_accuracy": 0.1, "val/greedy_flexible_accuracy": 0.5}) == []
    (warning,) = symptoms.check(10, {"val/greedy_strict_accuracy": 0.0, "val/greedy_flexible_accuracy": 0.25})
    assert "0.250" in warning and "troubleshooting.md#the-reward-is-0-at-step-0" in warning
    assert symptoms.check(20, {"val/greedy_strict_accuracy": 0.0, "val/greedy_flexible_accuracy": 0.5}) == []
