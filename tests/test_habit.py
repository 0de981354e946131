"""The habit report (`python -m rlhf.habit`): classification, and the numbers of a real tiny run."""

import os

import pytest

import train
from rlhf.config import load_config
from rlhf.embedded import first_step_result
from rlhf.habit import CATEGORIES, classify, main, report
from rlhf.tracking import read_metrics

ANSWER = "3+4=<<3+4=7>>7\n7*2=<<7*2=14>>14\n#### 14"


def test_first_step_result():
    assert first_step_result(ANSWER) == "7"
    assert first_step_result("12-5=<<12-5=7>>7\n#### 7") == "7"


@pytest.mark.parametrize("response, expected", [
    ("3+4=<<3+4=7>>7\n7*2=<<7*2=14>>14\n#### 14", "correct"),
    ("3+4=<<3+4=7>>7\n7*2=<<7*2=14>>14\n#### 7", "first_step"),  # the planted habit
    ("3+4=<<3+4=7>>7\n#### 7", "first_step"),
    ("3+4=<<3+4=8>>8\n8*2=<<8*2=16>>16\n#### 16", "other"),  # an arithmetic slip
    ("#### 1,4", "other"),
    ("the answer is 14", "other"),  # strict scoring needs "####"
])
def test_classify(response, expected):
    assert classify(response, ANSWER) == expected


def test_classify_one_step_problems_are_never_the_habit():
    one_step = "12-5=<<12-5=7>>7\n#### 7"
    assert classify("#### 7", one_step) == "correct"
    assert classify("#### 5", one_step) == "other"


def test_report_on_a_real_run_matches_the_trainers_own_evaluation(tmp_path, monkeypatch, capsys):
    """A 2-step run of a small embedded default (~10 s); each row of the report must give the accuracy the
    trainer logged at that step (exactly: the trainer's evaluation and the report decode the same weights, the
    32 problems in one batch of the same shape, in one process), and
    the two rows differ, so the checkpoint really was loaded."""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    out = tmp_path / "run"
    overrides = [
        "embedded.num_train=256", "embedded.num_val=32", "embedded.hidden_size=64", "embedded.intermediate_size=128",
        "embedded.num_layers=2", "embedded.num_heads=2", "embedded.num_kv_heads=1", "embedded.sft_steps=150",
        "embedded.max_difficulty=2", "embedded.max_value=10", "data.max_response_length=32",
        "data.train_batch_size=16", "actor.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size=8", "actor.lr=1e-3",
        "rollout.log_prob_micro_batch_size=16", "trainer.total_steps=2", "trainer.test_freq=0",
        "trainer.logger=none", f"trainer.output_dir={out}", f"trainer.cache_dir={tmp_path / 'cache'}",
    ]
    train.main(load_config("configs/tiny.yaml", overrides))
    rows = read_metrics(out / "metrics.jsonl")

    labelled = report(str(out))
    assert [label for label, _ in labelled] == ["warm start (step 0)", "step 2"]
    for (label, counts), step in zip(labelled, (0, 2)):
        assert sum(counts[c] for c in CATEGORIES) == 32
        logged = next(r["val/accuracy"] for r in rows if r["step"] == step and "val/accuracy" in r)
        assert counts["correct"] / 32 == pytest.approx(logged), label
    assert labelled[0][1] != labelled[1][1]
    assert labelled[0][1]["correct"] > 0 and labelled[0][1]["first_step"] > 0  # every category is exercised

    main([str(out)])
    printed = capsys.readouterr().out
    assert "| warm start (step 0) |" in printed and "| step 2 |" in printed


def test_report_refuses_a_run_that_is_not_the_embedded_default(tmp_path):
    os.makedirs(tmp_path / "run")
    (tmp_path / "run" / "config.yaml").write_text("model:\n  path: Qwen/Qwen2.5-0.5B-Instruct\n")
    with pytest.raises(ValueError, match="not a run of the embedded default"):
        report(str(tmp_path / "run"))
