"""The habit report (`python -m lab.habit`): classification, and the numbers of a real tiny run."""

import os

import pytest
import torch
from helpers import tiny_overrides

import rlhf.setup
import rlhf.tasks
import train
from rlhf.config import load_config
from rlhf.embedded import first_step_result, habit_metric
from lab.habit import (CATEGORIES, DECISION_REWARDS, classify, decision_probabilities, habit_limits,
                        main, report)
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
        "task.options.num_train=256", "task.options.num_val=32", "task.options.hidden_size=64", "task.options.intermediate_size=128",
        "task.options.num_layers=2", "task.options.num_heads=2", "task.options.num_kv_heads=1", "task.options.sft_steps=150",
        "task.options.max_difficulty=2", "task.options.max_value=10", "data.max_response_length=32",
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
        habit = next(r["val/greedy_habit_rate"] for r in rows if r["step"] == step and "val/accuracy" in r)
        assert counts["first_step"] / 32 == pytest.approx(habit), label  # the trainer's own habit metric
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


# ----------------------------------------------------------------------------- the habit as a trainer metric


def test_habit_metric_scores_crafted_responses():
    """1 for the habit only: the right answer, another wrong number and a response without an answer are 0."""
    one_step = "12-5=<<12-5=7>>7\n#### 7"  # no habit possible: its first result is its answer
    rate = habit_metric([ANSWER, one_step])
    responses = ["3+4=<<3+4=7>>7\n7*2=<<7*2=14>>14\n#### 14", "3+4=<<3+4=7>>7\n7*2=<<7*2=14>>14\n#### 7",
                 "#### 7", "#### 15", "no answer", "#### 7"]
    assert rate(responses, [0, 0, 0, 0, 0, 1]) == [0.0, 1.0, 1.0, 0.0, 0.0, 0.0]


def test_task_metrics_are_averaged_per_problem_greedy_and_sampled(artifacts, tmp_path, monkeypatch, one_thread):
    """A task metric reaches evaluate with each held-out row's index (once greedy, val_samples times sampled)
    and is logged as the mean over problems of each problem's mean: val/greedy_<name> and val/<name>."""
    seen = []

    def probe(completions, indices):  # 1 on even rows: the expected mean is the share of even rows
        seen.append(list(indices))
        assert len(completions) == len(indices)
        return [float(i % 2 == 0) for i in indices]

    monkeypatch.setattr(rlhf.tasks.EmbeddedTask, "val_metrics", lambda *args: {"probe": probe})
    out = str(tmp_path / "run")
    cfg = load_config(None, tiny_overrides(artifacts, out, "trainer.val_samples=3", "trainer.logger=none",
                                           "data.max_val_samples=7"))
    train.main(cfg)
    rows = [r for r in read_metrics(os.path.join(out, "metrics.jsonl")) if "val/accuracy" in r]
    num_val = 7
    evens = 4 / 7  # rows 0, 2, 4, 6
    assert [(r["val/greedy_probe"], r["val/probe"]) for r in rows] == [(pytest.approx(evens),) * 2] * len(rows)
    greedy, sampled = seen[0], seen[1]  # step 0: the greedy pass, then the sampled one, of one batch
    assert sorted(greedy) == list(range(num_val)) and sorted(sampled) == sorted(greedy * 3)


def test_gsm8k_files_have_no_habit_metric(artifacts, tmp_path):
    """The habit exists only in the embedded default's problems (the real run above logs it): GSM8K files,
    e.g. the hub's, get GSM8K's answer metrics but no habit metric."""
    files = load_config(None, tiny_overrides(artifacts, str(tmp_path / "run")))
    metrics = rlhf.tasks.get_task(files.task.name).val_metrics(files, {"ground_truth": ["7", "12"]})
    assert "habit_rate" not in metrics and "strict_accuracy" in metrics


# ----------------------------------------------------------------------------- where a KL keeps the habit


def decisions(*rows):
    return torch.tensor(rows, dtype=torch.float64)


def test_habit_limits_are_the_solvers_fixed_points():
    """habit_limits' closed forms (forward- and reverse-KL optima) equal where the exact solver takes k3 and k3+
    in the loss under RLOO's advantages, for coefficients where k3's path stays inside verl's clamp; and the
    one-decision formula pi (beta + 1 - pi) = beta q when the right answer takes all the rest."""
    from lab.theory.fixed_points import bandit_fixed_point

    ref = decisions([0.82, 0.10, 0.08], [0.5, 0.4, 0.1], [0.9, 0.001, 0.099])
    rewards = torch.tensor(DECISION_REWARDS, dtype=torch.float64)
    for beta in (0.15, 0.2, 0.3):
        limits = habit_limits(ref, beta)
        for row, forward, reverse in zip(ref, limits["forward"], limits["reverse"]):
            k3 = bandit_fixed_point(row, rewards, beta, "k3", "loss", advantage="rloo", n=4)[0]
            k3_plus = bandit_fixed_point(row, rewards, beta, "k3+", "loss", advantage="rloo", n=4)[0]
            assert abs(k3 - forward) < 1e-9 and abs(k3_plus - reverse) < 1e-9, (beta, row)
    q, beta = 0.82, 0.1
    pi = habit_limits(decisions([q, 1 - q, 0.0]), beta)["forward"].item()
    assert abs(pi * (beta + 1 - pi) - beta * q) < 1e-12 and beta * q / (1 + beta) < pi < beta * q


def test_the_reverse_kl_keeps_more_habit_where_the_reference_barely_knows_the_answer():
    """The forward-KL optimum keeps at most beta q of the habit whatever the right answer's reference
    probability p; the reverse one keeps q / (q + p e^(1/beta) + rest), most of it when p is tiny."""
    ref = decisions([0.82, 0.17, 0.01], [0.82, 0.001, 0.179])
    limits = habit_limits(ref, 0.2)
    assert (limits["forward"] < 0.2 * 0.82).all()
    assert limits["reverse"][0] < limits["forward"][0] < limits["forward"][1] < limits["reverse"][1]
    assert limits["reverse"][1] > 0.5


def test_k3s_clamp_removes_the_floor_only_where_the_optimum_lies_past_its_edge():
    """verl's clamp stops k3's pull once d < -2.61. At the forward optimum every token scored 0 has
    d = log(beta / lam): -2.31 at beta = 0.1 on this decision, inside the edge, and the solver stops there (not
    on the argmax corner); at beta = 0.06 (d = -2.82) the optimum lies past the edge and the habit dies."""
    from lab.theory.fixed_points import bandit_fixed_point

    row, rewards = decisions([0.82, 0.10, 0.08])[0], torch.tensor(DECISION_REWARDS, dtype=torch.float64)
    inside = habit_limits(row[None], 0.1)["forward"].item()
    assert -2.4 < torch.log(torch.tensor(inside / 0.82)).item() < -2.2
    assert abs(bandit_fixed_point(row, rewards, 0.1, "k3", "loss", advantage="rloo", n=4)[0] - inside) < 1e-9
    past = habit_limits(row[None], 0.06)["forward"].item()
    assert torch.log(torch.tensor(past / 0.82)).item() < -2.62
    assert bandit_fixed_point(row, rewards, 0.06, "k3", "loss", advantage="rloo", n=4)[0] < 1e-9


def test_the_crossing_coefficient_puts_the_optimum_on_k3s_edge():
    """crossing_betas is where edge_margins is 0: the forward optimum's d = log(beta / lam) equals the edge, as
    the closed form lam = ((1 + beta) + sqrt((1 + beta)^2 - 4 beta (1 - p))) / 2 (rewards 0, 1, 0) gives; above
    it the optimum lies inside the edge (margin > 0), below it past (margin < 0)."""
    import math

    from lab.habit import crossing_betas, edge_margins
    from rlhf.kl import K3_CLAMP_EDGES

    ref = decisions([0.82, 0.10, 0.08], [0.849, 0.035, 0.116], [0.5, 0.3, 0.2])
    crossing = crossing_betas(ref)
    for row, beta in zip(ref.tolist(), crossing.tolist()):
        p = row[1]
        lam = ((1 + beta) + math.sqrt((1 + beta) ** 2 - 4 * beta * (1 - p))) / 2
        assert math.log(beta / lam) == pytest.approx(K3_CLAMP_EDGES[0], abs=1e-9)
        one = torch.tensor([row], dtype=torch.float64)
        assert edge_margins(one, beta * 1.01).item() > 0 > edge_margins(one, beta * 0.99).item()
    assert 0.07 < crossing.min().item() < crossing.max().item() < 0.08


def test_decision_probabilities_find_the_decision_token():
    """At the first token where the habit's and the right response part (after the common "#### 1" when the
    numbers share a digit; then the right one ends), the model's probabilities of the two tokens."""
    from transformers import PreTrainedTokenizerFast

    from rlhf.embedded import train_tokenizer

    problems = {"question": ["Tom has 3. He gets 4 more, then doubles it. How many?",
                             "Ann has 9. She gets 3, then loses 11. How many?", "One step: 12-5?"],
                "answer": [ANSWER, "9+3=<<9+3=12>>12\n12-11=<<12-11=1>>1\n#### 1", "12-5=<<12-5=7>>7\n#### 7"]}
    tokenizer = train_tokenizer(problems["question"] + problems["answer"] * 20, 128)
    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    contexts = []

    class Recorder(torch.nn.Module):  # logits favour token id 5; records each context it is given
        def forward(self, input_ids):
            contexts.append(tokenizer.decode(input_ids[0]))
            logits = torch.zeros(1, input_ids.shape[1], len(tokenizer))
            logits[..., 5] = 2.0
            return type("Out", (), {"logits": logits})

    probs = decision_probabilities(Recorder(), tokenizer, problems)
    assert probs.shape == (2, 3)  # the one-step problem has no habit to drop
    assert contexts[0].endswith("#### ") and contexts[1].endswith("#### 1")
    assert torch.allclose(probs.sum(-1), torch.ones(2, dtype=torch.float64))


def test_decision_probabilities_read_the_habit_and_the_right_token_in_that_order():
    """On a model whose probabilities at every position are set (the habit's token 0.6, the right one 0.1, the
    rest spread evenly), the rows read [habit, right, rest] = [0.6, 0.1, 0.3]: swapping the two columns, or
    reading the tokens of another position, fails."""
    from rlhf.embedded import answer_with_first_result, train_tokenizer

    problems = {"question": ["Tom has 3. He gets 4 more, then doubles it. How many?"], "answer": [ANSWER]}
    tokenizer = train_tokenizer(problems["question"] + problems["answer"] * 20 + ["#### 7"] * 20, 128)
    right_ids = tokenizer(ANSWER, add_special_tokens=False)["input_ids"]
    habit_ids = tokenizer(answer_with_first_result(ANSWER), add_special_tokens=False)["input_ids"]
    at = next(i for i, (a, b) in enumerate(zip(right_ids, habit_ids)) if a != b)
    habit, right = habit_ids[at], right_ids[at]
    assert habit != right
    probs = torch.full((len(tokenizer),), 0.3 / (len(tokenizer) - 2), dtype=torch.float64)
    probs[habit], probs[right] = 0.6, 0.1

    class Set(torch.nn.Module):
        def forward(self, input_ids):
            return type("Out", (), {"logits": probs.log().float().expand(1, input_ids.shape[1], -1)})

    row = decision_probabilities(Set(), tokenizer, problems)[0]
    assert torch.allclose(row, torch.tensor([0.6, 0.1, 0.3], dtype=torch.float64), atol=1e-6)
