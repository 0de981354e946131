"""Rule-based GSM8K scorer: extract the final number from a response and compare it with the reference.

GSM8K reference answers end with a line `#### <number>`; models are prompted to end the same way. The
conventions here follow two peers, re-implemented:

- verl (`verl/utils/reward_score/gsm8k.py`): "strict" reads the number after the last `####`, "flexible"
  the last number anywhere; commas and dollar signs are dropped; no answer scores 0, a wrong answer
  `format_score`, a right one `score`.
- nanochat (`tasks/gsm8k.py`): the same `####` marker and comma removal, and the reward is the evaluation
  function itself, so training and evaluation cannot disagree on what counts as correct.

Where this scorer differs, on purpose:
- Numbers are matched by an explicit pattern (optional sign and `$`, digits with well-formed thousands
  separators, optional decimals) instead of "any run of digits, dots and commas", so "1,2,3" reads as three
  numbers and "12." as 12. Only ASCII digits count.
- Answers are compared as exact decimal values (`decimal.Decimal`), so "1,234" == "1234", "5.00" == "5",
  "-0" == "0", while "0.1" != "0.10000001" (no float rounding).

`reward_func` is the trainer's default `reward.function` (rlhf/rewards/__init__.py has the convention):
`compute_score` of each completion, with `final_answer` as the answer maj@n votes on.
"""

from __future__ import annotations

import re
from decimal import Decimal

METHODS = ("strict", "flexible")
# The instruction verl's GSM8K preprocessing appends to each question, so that "####" marks the final answer
# this rule reads: the default data.instruction (rlhf.data.build_prompt).
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'

# Sign and dollar in either order, then digits with correct thousands commas, or plain digits, optionally
# with a decimal part; or a bare decimal part (".5").
_NUMBER = (
    r"(?:-\$?|\$-?)?"
    r"(?:[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])(?:\.[0-9]+)?|[0-9]+(?:\.[0-9]+)?|\.[0-9]+)"
)
_NUMBER_RE = re.compile(_NUMBER)
_MARKED_NUMBER_RE = re.compile(rf"####\s*({_NUMBER})")


def _normalise(number: str) -> str:
    """Drop thousands commas and dollar signs: "-$1,234.5" -> "-1234.5"."""
    return number.replace(",", "").replace("$", "")


def extract_solution(text: str, method: str = "strict") -> str | None:
    """The final answer in `text` as a normalised number string ("1234", "-3.5"), or None if there is none.
    "strict" reads the number after the last `####` followed by one (whitespace and `$` allowed between)."""
    if method == "strict":
        matches = _MARKED_NUMBER_RE.findall(text)
    elif method == "flexible":
        matches = _NUMBER_RE.findall(text)
    else:
        raise ValueError(f"unknown extraction method {method!r}; valid methods: {', '.join(METHODS)}")
    return _normalise(matches[-1]) if matches else None


def extract_ground_truth(answer: str) -> str | None:
    """The normalised reference number from a GSM8K answer: the reasoning (with `<<48/2=24>>` calculator
    annotations) followed by `#### 72` gives "72"."""
    return extract_solution(answer, method="strict")


def _reference_value(ground_truth: str) -> Decimal | None:
    """The reference as a Decimal, from a bare number ("1,234") or a full GSM8K answer ending in `####`."""
    if "####" in ground_truth:
        number = extract_ground_truth(ground_truth)
    else:
        number = ground_truth.strip()
        number = _normalise(number) if _NUMBER_RE.fullmatch(number) else None
    return None if number is None else Decimal(number)


def compute_score(response: str, ground_truth: str, method: str = "strict", format_score: float = 0.0,
                  score: float = 1.0) -> float:
    """`score` if the answer in `response` equals `ground_truth` (a number, or a GSM8K answer ending in `#### N`)
    as a decimal value; 0.0 when either has no number, `format_score` when they differ. Raises only for an
    unknown `method`."""
    answer = extract_solution(response, method)
    if answer is None:
        return 0.0
    reference = _reference_value(str(ground_truth))
    if reference is None:
        return 0.0
    return float(score) if Decimal(answer) == reference else float(format_score)


def final_answer(completion: str, method: str = "strict") -> Decimal | None:
    """The final answer of a completion as a decimal value ("5" and "5.00" are one answer), None if it has none."""
    answer = extract_solution(completion, method)
    return None if answer is None else Decimal(answer)


def reward_func(prompts: list[str], completions: list[str], completion_ids: list[list[int]], ground_truth: list[str],
                method: str = "strict", **fields) -> list[float]:
    """compute_score of each completion against its ground truth; `method` is data.reward_method."""
    return [compute_score(text, truth, method=method) for text, truth in zip(completions, ground_truth, strict=True)]


reward_func.extract_answer = final_answer  # what maj@n votes on (rlhf.rewards.RewardFn.answers)


def has_answer_line(text: str) -> bool:
    """Whether `text` has a `#### N` answer line, what the strict rule reads."""
    return extract_solution(text, "strict") is not None


def format_reward(prompts: list[str], completions: list[str], completion_ids: list[list[int]], **fields) -> list[float]:
    """1.0 for a completion with an answer line (`#### N`, what the strict rule reads), 0.0 without: a part of
    a reward of several (reward.functions, after GSM8K's rule, which judges correctness), never a correctness."""
    return [float(has_answer_line(text)) for text in completions]


def answer_metrics(ground_truth: list[str]) -> dict:
    """The held-out metrics of GSM8K-schema tasks (rlhf.tasks), whatever reward the run trains with, each a
    function (responses' texts, their held-out row indices) -> one value per response: `strict_accuracy` (the
    strict rule: the number after the last `####`), `flexible_accuracy` (the last number anywhere) and
    `no_answer_rate` (no `#### N` line). Strict at 0 with flexible above it is a format problem, not maths."""
    def accuracy(method):
        return lambda texts, indices: [compute_score(t, ground_truth[i], method) for t, i in zip(texts, indices)]

    return {"strict_accuracy": accuracy("strict"), "flexible_accuracy": accuracy("flexible"),
            "no_answer_rate": lambda texts, indices: [float(not has_answer_line(t)) for t in texts]}
