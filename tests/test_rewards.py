"""Pluggable rewards (`reward.function=<module>:<callable>`): what the function is given, that it changes the
scores the trainer trains and evaluates on, that bad functions and bad results are refused early with a
message saying what was expected, and that the default is GSM8K's rule exactly."""

import itertools
import math
import os
import sys
import uuid

import numpy as np
import pytest
import torch
from helpers import tiny_overrides

from transformers import GenerationConfig

import rlhf.setup
import train
from rlhf import rewards
from rlhf.config import ConfigError, load_config, warnings_for
from rlhf.models import load_tokenizer
from rlhf.rewards import RewardError, load_reward, score
from rlhf.rewards.gsm8k import compute_score
from rlhf.rollout import Sequences
from rlhf.tracking import read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    """write(source) -> the name of a new module holding `source`, importable from here on."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(source: str) -> str:
        name = f"reward_{uuid.uuid4().hex[:8]}"
        (tmp_path / f"{name}.py").write_text(source)
        return name

    return write


RECORDING = """
calls = []

def length(prompts, completions, completion_ids, ground_truth, **fields):
    calls.append(dict(prompts=prompts, completions=completions, completion_ids=completion_ids,
                      ground_truth=ground_truth, **fields))
    return [float(len(ids)) for ids in completion_ids]

def everything_right(completions, **fields):
    return [1.0] * len(completions)
"""


def test_a_custom_reward_is_what_the_trainer_scores_and_evaluates_with(artifacts, tmp_path, reward_module):
    """The response length (stop token included) as the reward: critic/score/mean is then exactly
    response_length/mean, and the function was given the decoded prompts and responses, the unpadded tokens and
    the ground truths. A reward that calls everything right gives val/accuracy 1, or 0 with a threshold above it."""
    name = reward_module(RECORDING)
    cfg = load_config(None, tiny_overrides(artifacts, str(tmp_path / "length"), f"reward.function={name}:length",
                                           "trainer.logger=none", "trainer.total_steps=1"))
    rows = read_metrics_of(cfg)
    assert rows[1]["critic/score/mean"] == rows[1]["response_length/mean"] > 0
    assert rows[1]["critic/score/mean"] != 0  # what GSM8K's rule gives the tiny model

    calls, tokenizer = sys.modules[name].calls, load_tokenizer(artifacts.model_dir)
    stop_ids = {tokenizer.eos_token_id, GenerationConfig.from_pretrained(artifacts.model_dir).eos_token_id}
    assert len(calls) == 2 + 1  # step 0's and the last evaluation (8 problems each), the step's rollout
    rollout = calls[1]
    assert len(rollout["prompts"]) == cfg.data.train_batch_size and set(rollout) == {
        "prompts", "completions", "completion_ids", "ground_truth"}
    assert all(p.startswith("<|im_start|>user\n") and p.endswith("<|im_start|>assistant\n") for p in rollout["prompts"])
    for text, ids in zip(rollout["completions"], rollout["completion_ids"]):
        assert text == tokenizer.decode(ids, skip_special_tokens=True)
        assert not stop_ids & set(ids[:-1])  # nothing after the first stop token
        assert len(ids) == cfg.data.max_response_length or ids[-1] in stop_ids  # the stop token kept
    assert all(isinstance(truth, str) and truth.lstrip("-").isdigit() for truth in rollout["ground_truth"])

    for threshold, accuracy in ((1.0, 1.0), (1.5, 0.0)):
        cfg = load_config(None, tiny_overrides(artifacts, str(tmp_path / f"right{threshold}"), "trainer.logger=none",
                                               f"reward.function={name}:everything_right", "trainer.total_steps=1",
                                               f"reward.correct_threshold={threshold}", "trainer.val_samples=2"))
        last = read_metrics_of(cfg)[-1]
        assert last["critic/score/mean"] == 1.0
        assert (last["val/accuracy"], last["val/pass@2"], last["val/maj@2"]) == (accuracy,) * 3


def read_metrics_of(cfg):
    train.main(cfg)
    return read_metrics(os.path.join(cfg.trainer.output_dir, "metrics.jsonl"))


def test_score_batch_decodes_the_batch_as_the_reward_sees_it(artifacts):
    """rewards.score_batch on a batch made by hand: responses padded after their stop token are given to the
    function without the padding, the stop token kept; a response cut at the length limit keeps all its tokens; the
    prompts are the rows' text, not their ids decoded."""
    tokenizer = load_tokenizer(artifacts.model_dir)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    seen = {}

    def record(prompts, completions, completion_ids, **fields):
        seen.update(prompts=prompts, completions=completions, completion_ids=completion_ids, **fields)
        return [len(ids) + 0.5 for ids in completion_ids]

    answers = [tokenizer.encode("#### 12") + [eos], tokenizer.encode("3 + 4 = 7")]
    width = max(map(len, answers)) + 2
    response_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids in answers])
    response_mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids in answers])
    prompt_ids = torch.tensor([tokenizer.encode("q1"), tokenizer.encode("q2")])
    batch = Sequences.build(prompt_ids, torch.ones_like(prompt_ids), response_ids, response_mask)
    rows = {"input_ids": prompt_ids.tolist(), "prompt": ["the first question", "the second"],  # nothing decodes them
            "ground_truth": ["12", "7"], "source": ["a", "b"]}
    reward_fn = rewards.RewardFn(record, "test:record")
    scored = rewards.score_batch(reward_fn, tokenizer, batch, rows)
    scores = scored.scores
    assert scores.dtype == torch.float32 and scores.tolist() == [len(answers[0]) + 0.5, len(answers[1]) + 0.5]
    assert scored.parts == {}  # one function: its score is logged once, as the score
    weighted = rewards.WeightedReward((reward_fn, rewards.RewardFn(record, "test:again")), (1.0, 2.0))
    scored = rewards.score_batch(weighted, tokenizer, batch, rows)
    assert scored.scores.tolist() == [3 * (len(answers[0]) + 0.5), 3 * (len(answers[1]) + 0.5)]
    assert sorted(scored.parts) == ["reward/again", "reward/record"]  # several: each part logged too
    assert seen == {"prompts": ["the first question", "the second"], "completions": ["#### 12", "3 + 4 = 7"],
                    "completion_ids": answers, "ground_truth": ["12", "7"], "source": ["a", "b"]}
    del rows["prompt"]  # a task's rows without their text: the ids decoded
    rewards.score_batch(reward_fn, tokenizer, batch, rows)
    assert seen["prompts"] == ["q1", "q2"]


def test_score_evaluates_a_reward_on_one_token_responses_without_a_model(artifacts, reward_module):
    """rlhf.rewards.score on every arm of a bandit (one-token responses): the configured reward, loaded from
    the config as the trainer loads it, scores each arm."""
    name = reward_module("def arm(completion_ids, **fields):\n    return [ids[0] % 3 - 1.0 for ids in completion_ids]")
    tokenizer = load_tokenizer(artifacts.model_dir)
    reward_fn = load_reward(load_config(None, [f"reward.function={name}:arm"]))
    arms = [[v] for v in range(10)]
    scores = score(reward_fn, tokenizer, ["pick"] * 10, arms, {"ground_truth": ["0"] * 10})
    assert scores.shape == (10,) and scores.dtype == torch.float32
    assert scores.tolist() == [v % 3 - 1.0 for v in range(10)]


def test_score_refuses_fields_a_function_cannot_take_and_inputs_of_other_lengths(artifacts):
    """rlhf.rewards.score takes any fields, so it checks each function's signature against them (each part of a
    reward of several) and the inputs' lengths against the completions'."""
    tokenizer = load_tokenizer(artifacts.model_dir)
    narrow = rewards.RewardFn(lambda prompts, completions, completion_ids, ground_truth: [0.0], "m:f")
    wide = rewards.RewardFn(lambda completions, **fields: [1.0], "m:g")
    assert score(narrow, tokenizer, ["p"], [[1]], {"ground_truth": ["1"]}).tolist() == [0.0]
    for reward_fn in (narrow, rewards.WeightedReward((wide, narrow), (1.0, 1.0))):
        with pytest.raises(RewardError, match=r"m:f\(prompts.* cannot be called .*unexpected keyword arg.* 'source'"):
            score(reward_fn, tokenizer, ["p"], [[1]], {"ground_truth": ["1"], "source": ["x"]})
    assert score(wide, tokenizer, ["p"], [[1]], {"ground_truth": ["1"], "source": ["x"]}).tolist() == [1.0]
    with pytest.raises(ValueError, match="reward inputs: ground_truth has 2 entries for 1 completions"):
        score(narrow, tokenizer, ["p"], [[1]], {"ground_truth": ["1", "2"]})
    with pytest.raises(ValueError, match="reward inputs: prompts has 2 entries for 1 completions"):
        score(narrow, tokenizer, ["p", "q"], [[1]], {"ground_truth": ["1"]})


def test_gsm8k_default_gives_todays_scores(artifacts):
    """The default reward.function is compute_score, for both methods, on texts and through the tokenizer."""
    texts = ["#### 72", "so 48 + 24 = 72\n#### 72", "#### 1,234", "#### 71", "The answer is 72.", "no answer",
             "#### $72.00", "#### -3", "72 #### 7 2", "", "#### 72 or 73", "<think>72</think> #### 72"]
    truths = ["72", "72", "1234", "72", "72", "72", "72", "-3", "72", "0", "73", "72"]
    tokenizer = load_tokenizer(artifacts.model_dir)
    for method in ("strict", "flexible"):
        reward_fn = load_reward(load_config(None, [f"data.reward_method={method}"]))
        assert reward_fn.name == rewards.GSM8K_REWARD
        expected = [compute_score(t, g, method=method) for t, g in zip(texts, truths)]
        assert 0 < sum(expected) < len(texts)
        assert reward_fn([""] * len(texts), texts, [[]] * len(texts), {"ground_truth": truths}) == expected
        ids = [tokenizer.encode(t) + [tokenizer.eos_token_id] for t in texts]
        decoded = tokenizer.batch_decode(ids, skip_special_tokens=True)
        assert score(reward_fn, tokenizer, [""] * len(texts), ids, {"ground_truth": truths}).tolist() == [
            compute_score(t, g, method=method) for t, g in zip(decoded, truths)]


BAD_FUNCTIONS = {  # name: (module source or None for no module, attribute, what the message must say)
    "no colon": (None, "rlhf.rewards.gsm8k.reward_func", ["'reward.function'", "expected '<module>:<callable>'"]),
    "module missing": (None, "no_such_module_xyz:f", ["'no_such_module_xyz'", "does not import",
                                                       "ModuleNotFoundError"]),
    "module raises": ("raise RuntimeError('needs a GPU')\n", "f", ["does not import", "RuntimeError: needs a GPU"]),
    "syntax error": ("def f(:\n", "f", ["does not import", "SyntaxError"]),
    "missing attribute": ("def score(completions, **kw):\n    return []\n", "scor",
                          ["has no attribute 'scor'", "its callables: score"]),
    "not callable": ("f = 3\n", "f", ["'f' is a int, not callable", "fn(prompts=..., completions=..."]),
    "positional only": ("def f(texts):\n    return []\n", "f",
                        ["cannot be called as fn(prompts=..., completions=..., completion_ids=..., ground_truth=...)",
                         "texts", "**kwargs"]),
    "no room for fields": ("def f(prompts, completions, completion_ids):\n    return []\n", "f",
                           ["unexpected keyword argument 'ground_truth'", "**kwargs"]),
}


@pytest.mark.parametrize("case", BAD_FUNCTIONS)
def test_bad_reward_functions_are_refused_before_any_model_loads(case, reward_module, monkeypatch, capsys, tmp_path):
    source, attribute, needles = BAD_FUNCTIONS[case]
    spec = attribute if source is None else f"{reward_module(source)}:{attribute}"
    with pytest.raises(ConfigError) as refused:
        load_config(None, [f"reward.function={spec}"])
    message = str(refused.value)
    for needle in needles:
        assert needle in message, (needle, message)
    monkeypatch.setattr(rlhf.setup, "prepare_data_and_models", lambda *a: pytest.fail("a model was loaded"))
    assert train.cli([f"reward.function={spec}", f"trainer.output_dir={tmp_path}", "trainer.logger=none"]) == 2
    out, err = capsys.readouterr()
    assert [line for line in err.splitlines() if line.startswith("error: ")] == [f"error: {message}"]
    assert "resolved config" not in out  # main() prints it before it loads anything


BAD_RESULTS = {  # the function's body, then what the message must say besides its name
    "too few": ("return [0.0] * (len(completions) - 1)", ["returned 7 values for 8 completions", "expected 8"]),
    "a scalar": ("return 1.0", ["returned 1.0 (float)", "expected 8 finite numbers, one per completion"]),
    "text": ("return ['1'] * len(completions)", ["returned '1' (str) for completion 0, not a number"]),
    "none": ("return [None] * len(completions)", ["returned None (NoneType) for completion 0"]),
    "nan": ("return [0.0] * 3 + [float('nan')] * 5", ["returned nan for completion 3", "finite"]),
    "inf": ("return [float('-inf')] * len(completions)", ["returned -inf for completion 0", "finite"]),
    "2-d tensor": ("import torch; return torch.zeros(len(completions), 1)", ["Tensor of shape (8, 1)"]),
}


@pytest.mark.parametrize("case", BAD_RESULTS)
def test_bad_results_are_refused_at_their_first_call(case, artifacts, tmp_path, reward_module, monkeypatch, capsys):
    """The first call is step 0's evaluation (8 held-out problems): refused there, with exit status 2, before
    any update; nothing was logged."""
    body, needles = BAD_RESULTS[case]
    name = reward_module(f"def f(completions, **fields):\n    {body}\n")
    argv = tiny_overrides(artifacts, str(tmp_path / "run"), f"reward.function={name}:f", "trainer.logger=none")
    assert train.cli(argv) == 2
    message = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(message) == 1 and f"reward function '{name}:f' returned" in message[0], message
    for needle in needles:
        assert needle in message[0], (needle, message[0])
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not os.path.exists(metrics) or not read_metrics(metrics)


def test_every_call_is_checked_and_array_results_are_accepted():
    """A result that is bad only on a later call is refused then (the rollout's, after a good evaluation), and
    lists, tuples, arrays, 1-D tensors and bools are one number per completion."""
    state = itertools.count()

    def later_bad(completions, **fields):
        return [0.0] * len(completions) if next(state) == 0 else [0.0]

    reward_fn = rewards.RewardFn(later_bad, "m:later_bad")
    assert reward_fn(["p", "p"], ["a", "b"], [[1], [2]], {}) == [0.0, 0.0]
    with pytest.raises(RewardError, match=r"'m:later_bad' returned 1 values for 2 completions"):
        reward_fn(["p", "p"], ["a", "b"], [[1], [2]], {})
    for result in ([1, 0.5], (1, 0.5), np.array([1.0, 0.5], dtype=np.float32), torch.tensor([1.0, 0.5]),
                   [True, np.float64(0.5)]):
        reward_fn = rewards.RewardFn(lambda completions, **fields: result, "m:f")
        assert reward_fn(["p"] * 2, ["a", "b"], [[1], [2]], {}) == [1.0, 0.5]


def test_reward_settings_are_checked_and_warned_about(reward_module):
    name = reward_module("def f(**fields):\n    return []\n")
    with pytest.raises(ConfigError, match="reward.correct_threshold"):
        load_config(None, ["reward.correct_threshold=.nan"])
    assert any("data.reward_method=flexible" in w and "does not use" in w
               for w in warnings_for(load_config(None, [f"reward.function={name}:f", "data.reward_method=flexible"])))
    assert warnings_for(load_config(None, ["data.reward_method=flexible"])) == []
    assert math.isclose(load_config(None, ["reward.correct_threshold=0.5"]).reward.correct_threshold, 0.5)


def test_a_reward_of_weighted_parts():
    """reward.functions and reward.weights: the score is the weighted sum, each part kept by name; correctness
    and the answers maj@n votes on are the first part's (the format reward never counts as accuracy)."""
    from rlhf.rewards.gsm8k import format_reward

    cfg = load_config(None, ["reward.functions=[rlhf.rewards.gsm8k:reward_func, rlhf.rewards.gsm8k:format_reward]",
                             "reward.weights=[1.0, 0.25]"])
    reward = load_reward(cfg)
    texts, truths = ["#### 5", "#### 6", "it is 5", ""], ["5", "5", "5", "5"]
    parts = reward.score_parts([""] * 4, texts, [[]] * 4, {"ground_truth": truths})
    assert parts == {"reward_func": [1.0, 0.0, 0.0, 0.0], "format_reward": [1.0, 1.0, 0.0, 0.0]}
    assert format_reward([""] * 4, texts, [[]] * 4) == parts["format_reward"]
    assert reward([""] * 4, texts, [[]] * 4, {"ground_truth": truths}) == [1.25, 0.25, 0.0, 0.0]
    assert reward.is_correct(reward.correctness(parts)) == [True, False, False, False]
    assert reward.answers(texts)[:2] == [5, 6]
    unweighted = load_reward(load_config(None, ["reward.functions=[rlhf.rewards.gsm8k:format_reward]"]))
    assert unweighted.weights == (1.0,)


@pytest.mark.parametrize("overrides, message", [
    (["reward.function=rlhf.rewards.gsm8k:format_reward", "reward.functions=[rlhf.rewards.gsm8k:reward_func]"],
     "are both set"),
    (["reward.functions=[rlhf.rewards.gsm8k:reward_func]", "reward.weights=[1.0, 2.0]"], "2 entries for 1"),
    (["reward.functions=[rlhf.rewards.gsm8k:reward_func, rlhf.rewards.gsm8k:reward_func]"], "the same name"),
    (["reward.functions=[rlhf.rewards.gsm8k:nothing]"], "'reward.functions' got"),
    (["reward.weights=[a]"], "reward.weights[0]' expects float"),
    (["reward.functions=rlhf.rewards.gsm8k:reward_func"], "expects a list"),
])
def test_a_bad_reward_of_parts_is_refused_before_any_model_loads(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert message in str(e.value)
