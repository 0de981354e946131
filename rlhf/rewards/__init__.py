"""Reward functions, plugged in by name: `reward.function=<module>:<callable>`.

    reward_fn = load_reward(cfg)                                          # imported and checked (ConfigError)
    scores = score(reward_fn, tokenizer, prompts, completion_ids, fields)  # (B,) float32, checked

The calling convention is TRL's `reward_funcs` (verl's `custom_reward_function` is the same idea). For a
batch of B responses the trainer calls

    fn(prompts=[...], completions=[...], completion_ids=[[...], ...], **fields) -> B numbers

- `prompts`: B str, each response's prompt as the model saw it: the text its token ids encode, with the chat
  template (the prompt rows' `prompt` column, made once when the data is tokenized; rows without one, as a task
  may make them, have their ids decoded with the special tokens);
- `completions`: B str, the responses decoded without special tokens (the stop token and padding dropped);
- `completion_ids`: B lists of int, each response's tokens without padding, up to and including its stop
  token (a response cut at data.max_response_length has none), the tokens the trainer's response_mask covers;
- `**fields`: every other column of the prompt rows (besides `input_ids` and `prompt`), as a list with one entry
  per response: `ground_truth` (the reference number) for the GSM8K data the trainer loads (PROMPT_FIELDS).

It returns one real number per response (a list, tuple, 1-D tensor or array; bools count as 0 and 1), which
is the response's score: its reward on the last token (rlhf.core_algos.token_rewards), `critic/score/mean`. Every
call's result is checked, and a wrong length, a value that is not a number or one that is not finite raises
RewardError naming the function, what it returned and what was expected. The import, the attribute and the
signature (can it take the keyword call?) are checked by rlhf.config.validate, before any model loads.

The held-out evaluation scores with the same function: a response is right when its score is at least
reward.correct_threshold (val/accuracy, val/pass@k); maj@n votes on each response's final answer, which a
function may define as an attribute `fn.extract_answer(completion, **kwargs) -> hashable or None` (None: no
answer, no vote); without one, the answer is the completion text without surrounding whitespace.

GSM8K's rule is the default entry, `rlhf.rewards.gsm8k:reward_func`, given data.reward_method as `method`
(the one setting the loader passes by itself).
"""

from __future__ import annotations

import importlib
import inspect
import math
import numbers
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

GSM8K_REWARD = "rlhf.rewards.gsm8k:reward_func"
PROMPT_COLUMNS = ("input_ids", "prompt")  # the prompt rows' columns that are not fields: the ids and their text
PROMPT_FIELDS = ("ground_truth",)  # the other columns of the prompt rows (rlhf.data.tokenize_prompts)
_CALL = "fn(prompts=..., completions=..., completion_ids=..., **fields)"


class RewardError(ValueError):
    """A reward function's result that is not one finite number per response, or a call it cannot take."""


@dataclass(frozen=True)
class RewardFn:
    """The configured reward: the function, its `module:callable` name, the keyword arguments the loader
    binds (GSM8K's `method`), and the score from which a held-out response counts as right."""

    fn: Callable
    name: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    correct_threshold: float = 1.0

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], completion_ids: Sequence[Sequence[int]],
                 fields: dict[str, Sequence]) -> list[float]:
        """The function's scores of B responses, as B finite floats; RewardError otherwise (see the module)."""
        result = self.fn(prompts=list(prompts), completions=list(completions),
                         completion_ids=[list(ids) for ids in completion_ids],
                         **{key: list(values) for key, values in fields.items()}, **self.kwargs)
        return check_scores(result, len(completions), self.name)

    @property
    def part_name(self) -> str:
        """Its name as a part of a reward of several (reward/<name>/mean): the callable's, e.g. `reward_func`."""
        return self.name.rpartition(":")[2].rpartition(".")[2]

    def is_correct(self, scores: Sequence[float]) -> list[bool]:
        """Whether each held-out response counts as right: score >= correct_threshold."""
        return [s >= self.correct_threshold for s in scores]

    def answers(self, completions: Sequence[str]) -> list[Hashable | None]:
        """Each completion's final answer, what maj@n votes on (see the module)."""
        extract = getattr(self.fn, "extract_answer", None)
        if extract is None:
            return [text.strip() for text in completions]
        return [extract(text, **self.kwargs) for text in completions]


@dataclass(frozen=True)
class WeightedReward:
    """reward.functions with reward.weights (TRL's reward_funcs and reward_weights): the score is the weighted
    sum of the parts' scores; whether a response is right and its final answer are the first part's alone, so a
    shaping part (a format reward) never counts as accuracy. Called as a RewardFn is; score_batch also logs each
    part's scores, as reward/<name>/mean."""

    parts: tuple[RewardFn, ...]
    weights: tuple[float, ...]

    @property
    def name(self) -> str:
        return " + ".join(f"{w:g} * {part.name}" for part, w in zip(self.parts, self.weights))

    @property
    def correct_threshold(self) -> float:
        return self.parts[0].correct_threshold

    def score_parts(self, prompts, completions, completion_ids, fields) -> dict[str, list[float]]:
        """{each part's name: its scores of the B responses}, in the order of reward.functions."""
        return {part.part_name: part(prompts, completions, completion_ids, fields) for part in self.parts}

    def combine(self, parts: dict[str, Any]) -> Any:
        """The weighted sum of `score_parts`'s result (lists of floats, or tensors)."""
        values = [parts[part.part_name] for part in self.parts]
        if isinstance(values[0], torch.Tensor):
            return sum(w * v for w, v in zip(self.weights, values))
        return [sum(w * v for w, v in zip(self.weights, column)) for column in zip(*values)]

    def correctness(self, parts: dict[str, Any]) -> Any:
        """The scores `is_correct` reads: the first part's."""
        return parts[self.parts[0].part_name]

    def __call__(self, prompts, completions, completion_ids, fields) -> list[float]:
        return self.combine(self.score_parts(prompts, completions, completion_ids, fields))

    def is_correct(self, scores: Sequence[float]) -> list[bool]:
        """Whether each response is right by the first part's scores (`correctness`)."""
        return self.parts[0].is_correct(scores)

    def answers(self, completions: Sequence[str]) -> list[Hashable | None]:
        return self.parts[0].answers(completions)


def load_reward(cfg, prompt_fields: Sequence[str] = PROMPT_FIELDS) -> RewardFn | WeightedReward:
    """The reward of config `cfg` (its `reward` section; data.reward_method for GSM8K's rule): reward.function,
    or the WeightedReward of reward.functions and reward.weights; each function imported and checked against
    the prompt rows' fields (the task's, rlhf.tasks.Task.prompt_fields; GSM8K's by default). Raises ConfigError."""
    from rlhf.errors import ConfigError

    r = cfg.reward
    names = r.functions or [r.function]
    if r.functions and r.function != GSM8K_REWARD:
        raise ConfigError(f"config keys 'reward.function' ({r.function!r}) and 'reward.functions' ({r.functions!r}) "
                          "are both set; give one: reward.function for one function, reward.functions for several.")
    if r.weights and len(r.weights) != len(r.functions):
        raise ConfigError(f"config key 'reward.weights' has {len(r.weights)} entries for {len(r.functions)} "
                          f"reward.functions ({r.weights!r}); expected one weight per function, or [] for 1.0 each.")
    if not all(math.isfinite(w) for w in r.weights):
        raise ConfigError(f"config key 'reward.weights' must hold finite numbers, got {r.weights!r}.")
    parts = []
    for name in names:
        fn = import_reward(name, key="reward.functions" if r.functions else "reward.function")
        kwargs = {"method": cfg.data.reward_method} if name == GSM8K_REWARD else {}
        check_signature(fn, name, dict.fromkeys(prompt_fields), kwargs)
        parts.append(RewardFn(fn, name, kwargs, r.correct_threshold))
    if not r.functions:
        return parts[0]
    part_names = [part.part_name for part in parts]
    if len(set(part_names)) < len(part_names):
        raise ConfigError(f"config key 'reward.functions': {r.functions!r} gives two parts the same name "
                          f"({', '.join(part_names)}), which their metrics reward/<name>/mean need apart; expected "
                          "callables of different names.")
    return WeightedReward(tuple(parts), tuple(r.weights) or (1.0,) * len(parts))


def score(reward_fn: RewardFn, tokenizer, prompts: Sequence[str], completion_ids: Sequence[Sequence[int]],
          fields: dict[str, Sequence]) -> torch.Tensor:
    """(B,) float32 scores of B (prompt, completion) pairs, no model needed: `prompts` as text, each
    completion as its token ids (without padding; the stop token, if any, included), decoded here as the
    trainer decodes them; `fields` the rows' other columns, one entry per pair (e.g. {"ground_truth": [...]}).
    Inputs of different lengths are a ValueError, a function that cannot take `fields` a RewardError."""
    for key, values in {"prompts": prompts, **fields}.items():
        if len(values) != len(completion_ids):
            raise ValueError(f"reward inputs: {key} has {len(values)} entries for {len(completion_ids)} completions")
    for part in getattr(reward_fn, "parts", (reward_fn,)):  # a WeightedReward's functions, each checked
        check_signature(part.fn, part.name, fields, part.kwargs, error=RewardError)
    completions = tokenizer.batch_decode([list(ids) for ids in completion_ids], skip_special_tokens=True)
    return torch.tensor(reward_fn(prompts, completions, completion_ids, fields), dtype=torch.float32)


@dataclass
class Scored:
    """The configured reward's verdict on a batch of B responses (score_batch)."""

    scores: torch.Tensor  # (B,) float32: each response's score, its reward on the last token
    correct: torch.Tensor  # (B,) bool: right by the reward's is_correct (reward.correct_threshold)
    parts: dict[str, torch.Tensor]  # reward/<name>: each part's (B,) scores, for a reward of several; else empty


def score_batch(reward_fn: RewardFn | WeightedReward, tokenizer, seq, rows) -> Scored:
    """The configured reward's verdict on a batch's responses (`seq`, rlhf.rollout.Sequences) to their prompt rows
    (`rows`, one per response: input_ids, prompt where the rows have it, and the task's fields), called as the
    module says."""
    lengths = seq.response_mask.sum(dim=1).tolist()
    completion_ids = [ids[:length] for ids, length in zip(seq.response_ids.tolist(), lengths)]
    completions = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    prompts = rows["prompt"] if "prompt" in rows else tokenizer.batch_decode(rows["input_ids"])  # a task's own rows
    fields = {key: values for key, values in rows.items() if key not in PROMPT_COLUMNS}

    def tensor(values):
        return torch.tensor(values, dtype=torch.float32, device=seq.response_ids.device)

    if isinstance(reward_fn, RewardFn):  # one function: one call, its scores are the score
        scores = judged = tensor(reward_fn(prompts, completions, completion_ids, fields))
        parts = {}
    else:  # several: each part's scores, weighted; the first part's judge correctness
        parts = {name: tensor(values)
                 for name, values in reward_fn.score_parts(prompts, completions, completion_ids, fields).items()}
        scores, judged = reward_fn.combine(parts), reward_fn.correctness(parts)
    correct = torch.tensor(reward_fn.is_correct(judged.tolist()), dtype=torch.bool, device=seq.response_ids.device)
    return Scored(scores, correct, {f"reward/{name}": values for name, values in parts.items()})


def import_reward(name: str, key: str = "reward.function") -> Callable:
    """The callable `module:attribute` names (the attribute may be dotted: `module:Class.method`). Raises
    ConfigError saying what was expected, for a name without a colon, a module that does not import, a missing
    attribute or one that is not callable."""
    from rlhf.errors import ConfigError

    where = f"config key {key!r} got {name!r}"
    module_name, sep, attribute = name.partition(":")
    if not sep or not module_name or not attribute:
        raise ConfigError(f"{where}; expected '<module>:<callable>', e.g. {GSM8K_REWARD!r} (a module on the Python "
                          "path, then the name of the function in it).")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or whatever the module raises while importing
        raise ConfigError(f"{where}: module {module_name!r} does not import ({type(e).__name__}: {e}); expected an "
                          "importable module (on sys.path or PYTHONPATH) that defines the reward function.") from None
    obj = module
    for part in attribute.split("."):
        if not hasattr(obj, part):
            found = [n for n, value in vars(module).items() if not n.startswith("_") and callable(value)
                     and getattr(value, "__module__", None) == module_name]
            raise ConfigError(f"{where}: module {module_name!r} has no attribute {attribute!r}; its callables: "
                              f"{', '.join(found) or 'none'}.")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{where}: {attribute!r} is a {type(obj).__name__}, not callable; expected a function "
                          f"called as {_CALL} that returns one number per completion.")
    return obj


def check_signature(fn: Callable, name: str, fields: dict | Sequence[str], kwargs: dict[str, Any] | None = None,
                    error: type[Exception] | None = None) -> None:
    """Refuse `fn` if it cannot be called with the keyword arguments prompts, completions, completion_ids, each
    of `fields` and `kwargs` (ConfigError, or `error`). Functions without a signature pass."""
    if error is None:
        from rlhf.errors import ConfigError as error
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have none
        return
    keywords = ["prompts", "completions", "completion_ids", *fields, *(kwargs or {})]
    try:
        signature.bind(**dict.fromkeys(keywords))
    except TypeError as e:
        raise error(f"config key 'reward.function': {name}{signature} cannot be called as "
                    f"fn({'=..., '.join(keywords)}=...) ({e}); expected a function that takes these keyword arguments "
                    "(with **kwargs for those it does not use).") from None


def check_scores(result: Any, num: int, name: str) -> list[float]:
    """`result` as `num` floats, or RewardError naming the function, what it returned and what was expected."""
    expected = f"expected {num} finite numbers, one per completion (a list of floats)"
    if isinstance(result, torch.Tensor) or hasattr(result, "ndim"):  # a tensor or an array
        if result.ndim != 1:
            raise RewardError(f"reward function {name!r} returned a {type(result).__name__} of shape "
                              f"{tuple(result.shape)}; {expected}.")
        result = result.tolist()
    if not isinstance(result, Sequence) or isinstance(result, (str, bytes)):
        raise RewardError(f"reward function {name!r} returned {_show(result)} ({type(result).__name__}); {expected}.")
    if len(result) != num:
        raise RewardError(f"reward function {name!r} returned {len(result)} values for {num} completions "
                          f"({_show(result)}); {expected}.")
    for i, value in enumerate(result):
        if not isinstance(value, numbers.Real):
            raise RewardError(f"reward function {name!r} returned {value!r} ({type(value).__name__}) for completion "
                              f"{i}, not a number; {expected}.")
        if not math.isfinite(value):
            raise RewardError(f"reward function {name!r} returned {value!r} for completion {i}; {expected}.")
    return [float(value) for value in result]


def _show(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
