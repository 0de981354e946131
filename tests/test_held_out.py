"""Sampled evaluation: the unbiased pass@k against enumeration, maj@n's vote, and the trainer's evaluate,
whose sampling must not disturb training."""

import itertools
import os
import random
from types import SimpleNamespace

import pytest
from helpers import tiny_overrides

import train
from rlhf import held_out
from rlhf.config import load_config
from rlhf.held_out import majority_vote, pass_at_k, pass_at_k_sizes, sampled_scores
from rlhf.rewards import RewardFn, load_reward
from rlhf.rewards.gsm8k import final_answer
from rlhf.tracking import read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("n", range(1, 8))
def test_pass_at_k_is_the_chance_that_k_of_the_n_responses_hold_a_right_one(n):
    """Chen et al.'s estimator equals the average, over every k-subset of the n responses, of whether the
    subset holds a right one."""
    for c, k in itertools.product(range(n + 1), range(1, n + 1)):
        right = [i < c for i in range(n)]
        subsets = list(itertools.combinations(range(n), k))
        exact = sum(any(right[i] for i in s) for s in subsets) / len(subsets)
        assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12), (n, c, k)


def test_pass_at_k_refuses_impossible_counts():
    for args in ((4, 1, 0), (4, 1, 5), (4, 5, 1), (4, -1, 1)):
        with pytest.raises(ValueError):
            pass_at_k(*args)
    assert pass_at_k_sizes(8) == [1, 2, 4, 8] and pass_at_k_sizes(6) == [1, 2, 4, 6] and pass_at_k_sizes(1) == [1]


def test_majority_vote_groups_equal_values_skips_non_answers_and_breaks_ties_by_first_seen():
    answers = [final_answer(t) for t in ["#### 5", "#### 5.00", "#### 7", "no answer", "none", "still none"]]
    assert majority_vote(answers) == 0  # 5 and 5.00 are one answer
    assert majority_vote(["7", "5", "5", "7"]) == 0 and majority_vote(["x", "y", "y"]) == 1
    assert majority_vote([None, None]) is None


def test_sampled_scores_of_gsm8k_responses_are_todays_rule():
    """pass@k counts the responses GSM8K's rule scores 1, maj@n scores the majority answer: 12 is right in 2 of
    6, the majority (3) is wrong; with 3 as the reference the majority is right."""
    texts = ["so #### 12", "#### 12.0", "#### 3", "no answer", "#### 3", "#### 3"]
    reward = load_reward(load_config())

    def scores(ground_truth):
        values = reward([""] * 6, texts, [[]] * 6, {"ground_truth": [ground_truth] * 6})
        return sampled_scores(reward.is_correct(values), reward.answers(texts), [1, 2, 6])

    assert scores("#### 12") == pytest.approx([2 / 6, pass_at_k(6, 2, 2), 1.0, 0.0])
    assert scores("3")[-1] == 1.0 and scores("3")[0] == pytest.approx(3 / 6)
    assert sampled_scores([False, True, True], ["a", None, "b"], [1])[-1] == 0.0  # "a" came first


def test_sampled_evaluation_is_logged_and_leaves_training_unchanged(artifacts, tmp_path, monkeypatch):
    """val/pass@k and val/maj@n are the means over problems of each problem's sampled scores, and drawing
    those samples (their own noise stream) changes nothing in training: every other logged number is equal."""
    recorded, rng = [], random.Random(0)

    def recording(correct, answers, sizes):
        """Stands in for the scorer (the tiny model never answers right): known values to average."""
        assert len(correct) == 4 and len(set(answers)) > 1 and sizes == [1, 2, 4]  # 4 samples, not 4 greedy copies
        recorded.append([rng.random() for _ in range(len(sizes) + 1)])
        return recorded[-1]

    monkeypatch.setattr(held_out, "sampled_scores", recording)
    # The completions themselves as the answers (GSM8K's final answers of the tiny model are mostly None).
    monkeypatch.setattr(RewardFn, "answers", lambda self, completions: list(completions))
    runs = {}
    for n in (0, 4):
        out = str(tmp_path / f"n{n}")
        train.main(load_config(None, tiny_overrides(artifacts, out, f"trainer.val_samples={n}", "trainer.logger=none",
                                                    "rollout.temperature=1.5")))
        runs[n] = read_metrics(os.path.join(out, "metrics.jsonl"))
    assert len(recorded) == 2 * 8  # step 0 and the end, 8 held-out problems each
    last = runs[4][-1]
    for j, key in enumerate(["val/pass@1", "val/pass@2", "val/pass@4", "val/maj@4"]):
        assert last[key] == pytest.approx(sum(r[j] for r in recorded[8:]) / 8)
    # exact: training runs the same code on the same shapes in one process either way
    for plain, sampled in zip(runs[0], runs[4]):
        same = {k: v for k, v in plain.items() if not k.startswith("timing_s/") and k != "perf/throughput"}
        assert same == {k: sampled[k] for k in same}


def test_gsm8k_tasks_log_both_rules_and_the_missing_answers_whatever_the_reward():
    """GSM8K-schema tasks (rlhf.tasks) give evaluation GSM8K's strict and flexible rules and the share without
    an answer line; a task without a ground truth (the lab's bandit) does not get them."""
    from rlhf.rewards.gsm8k import answer_metrics
    from rlhf.tasks import get_task

    metrics = answer_metrics(["5", "12", "7"])
    texts, rows = ["so #### 5", "it is 12", "#### 8 or 7", ""], [0, 1, 2, 0]
    assert metrics["strict_accuracy"](texts, rows) == [1.0, 0.0, 0.0, 0.0]
    assert metrics["flexible_accuracy"](texts, rows) == [1.0, 1.0, 1.0, 0.0]
    assert metrics["no_answer_rate"](texts, rows) == [0.0, 1.0, 0.0, 1.0]
    cfg, val_set = load_config(), {"ground_truth": ["5"]}
    for name in ("gsm8k", "embedded"):
        own_files = SimpleNamespace(data=SimpleNamespace(val_files="x.jsonl"))  # the embedded default's habit needs its own
        assert set(get_task(name).val_metrics(own_files, val_set)) == {
            "strict_accuracy", "flexible_accuracy", "no_answer_rate"}
    assert get_task("lab.tasks:bandit").val_metrics(cfg, val_set) == {}
