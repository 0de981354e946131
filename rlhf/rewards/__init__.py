"""Reward functions, plugged in by name: `reward.function=<module>:<callable>`.

    reward_fn = load_reward(cfg)                                          # imported and checked (ConfigError)
    scores = score(reward_fn, tokenizer, prompts, completion_ids, fields)  # (B,) float32, checked

The calling convention is TRL's `reward_funcs` (verl's `custom_reward_function` is the same idea). For a
batch of B responses the trainer calls

    fn(prompts=[...], completions=[...], completion_ids=[[...], ...], **fields) -> B numbers

- `prompts`: B str, each response's prompt as the model saw it, decoded with its special tokens (so a chat
  template shows);
- `completions`: B str, the responses decoded without special tokens (the stop token and padding dropped);
- `completion_ids`: B lists of int, each response's tokens without padding, up to and including its stop
  token (a response cut at data.max_response_length has none), the tokens the trainer's response_mask covers;
- `**fields`: every other column of the prompt rows, as a list with one entry per response: `ground_truth`
  (the reference number) for the GSM8K data the trainer loads (PROMPT_FIELDS).

It returns one real number per response (a list, tuple, 1-D tensor or array; bools count as 0 and 1), which
is the response's score: its reward on the last token (rlhf.ppo.token_rewards), `critic/score/mean`. Every
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
PROMPT_FIELDS = ("ground_truth",)  # the columns of the prompt rows (rlhf.data.tokenize_prompts) besides input_ids
_CALL = "fn(prompts=..., completions=..., completion_ids=..., **fields)"


class RewardError(ValueError):
    """A reward function's result that is not one finite number per response; the message names the
    function, what it returned and what was expected."""


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
        num = len(completions)
        for key, values in {"prompts": prompts, "completion_ids": completion_ids, **fields}.items():
            if len(values) != num:
                raise ValueError(f"reward inputs: {key} has {len(values)} entries for {num} completions")
        check_signature(self.fn, self.name, fields, self.kwargs, error=RewardError)
        result = self.fn(prompts=list(prompts), completions=list(completions),
                         completion_ids=[list(ids) for ids in completion_ids],
                         **{key: list(values) for key, values in fields.items()}, **self.kwargs)
        return check_scores(result, num, self.name)

    def is_correct(self, scores: Sequence[float]) -> list[bool]:
        """Whether each held-out response counts as right: score >= correct_threshold."""
        return [s >= self.correct_threshold for s in scores]

    def answers(self, completions: Sequence[str]) -> list[Hashable | None]:
        """Each completion's final answer, what maj@n votes on (see the module)."""
        extract = getattr(self.fn, "extract_answer", None)
        if extract is None:
            return [text.strip() for text in completions]
        return [extract(text, **self.kwargs) for text in completions]


def load_reward(cfg, prompt_fields: Sequence[str] = PROMPT_FIELDS) -> RewardFn:
    """The reward of config `cfg` (its `reward` section; data.reward_method for GSM8K's rule), imported and
    checked against the prompt rows' fields (the task's, rlhf.tasks.Task.prompt_fields; GSM8K's by default).
    Raises ConfigError."""
    name = cfg.reward.function
    fn = import_reward(name)
    kwargs = {"method": cfg.data.reward_method} if name == GSM8K_REWARD else {}
    check_signature(fn, name, dict.fromkeys(prompt_fields), kwargs)
    return RewardFn(fn, name, kwargs, cfg.reward.correct_threshold)


def score(reward_fn: RewardFn, tokenizer, prompts: Sequence[str], completion_ids: Sequence[Sequence[int]],
          fields: dict[str, Sequence]) -> torch.Tensor:
    """(B,) float32 scores of B (prompt, completion) pairs, no model needed: `prompts` as text, each
    completion as its token ids (without padding; the stop token, if any, included), decoded here as the
    trainer decodes them; `fields` the rows' other columns, one entry per pair (e.g. {"ground_truth": [...]})."""
    completions = tokenizer.batch_decode([list(ids) for ids in completion_ids], skip_special_tokens=True)
    return torch.tensor(reward_fn(prompts, completions, completion_ids, fields), dtype=torch.float32)


def score_responses(reward_fn: RewardFn, tokenizer, batch, rows) -> torch.Tensor:
    """(B,) float32 scores of the batch's responses by the configured reward (`score`): each row's
    prompt decoded with its special tokens, its response's tokens up to and including the stop token (the
    response mask), and the rows' other columns as the function's fields."""
    lengths = batch["response_mask"].sum(dim=1).tolist()
    completion_ids = [ids[:length] for ids, length in zip(batch["response_ids"].tolist(), lengths)]
    prompts = tokenizer.batch_decode(rows["input_ids"])
    fields = {key: values for key, values in rows.items() if key != "input_ids"}
    return score(reward_fn, tokenizer, prompts, completion_ids, fields).to(batch["response_ids"].device)



def import_reward(name: str) -> Callable:
    """The callable `module:attribute` names (the attribute may be dotted: `module:Class.method`). Raises
    ConfigError saying what was expected, for a name without a colon, a module that does not import, a missing
    attribute or one that is not callable."""
    from rlhf.errors import ConfigError

    where = f"config key 'reward.function' got {name!r}"
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
