"""Tests for rlhf.rewards.gsm8k: extraction and scoring on GSM8K-style text, plus a no-raise property."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlhf.rewards.gsm8k import compute_score, extract_ground_truth, extract_solution

GSM8K_ANSWER = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n"
    "#### 72"
)


def test_extract_ground_truth_from_annotated_answer():
    assert extract_ground_truth(GSM8K_ANSWER) == "72"
    assert extract_ground_truth("He pays 1000+234=<<1000+234=1234>>1234 dollars.\n#### 1,234") == "1234"
    assert extract_ground_truth("no marker here 5") is None


@pytest.mark.parametrize(
    "text, expected",
    [
        ("So the total is 1,234 apples.\n#### 1,234", "1234"),
        ("It costs $5 each.\n#### $5", "5"),
        ("The temperature dropped to -3 degrees.\n#### -3", "-3"),
        ("#### -$1,000.50", "-1000.50"),
        ("Each share is 2.5 dollars.\n####2.5", "2.5"),
        ("#### 42 apples in total, as computed above.", "42"),
        ("#### 18.", "18"),
        ("First guess:\n#### 10\nWait, I forgot the tax.\n#### 12", "12"),
        ("#### 7\nThe '####' marker goes last.", "7"),
    ],
)
def test_extract_solution_strict(text, expected):
    assert extract_solution(text, "strict") == expected


def test_strict_needs_marker_and_flexible_takes_last_number():
    text = "She has 3 boxes of 12 eggs, so 3 * 12 = 36 eggs. The answer is 36."
    assert extract_solution(text, "strict") is None
    assert extract_solution(text, "flexible") == "36"
    assert extract_solution("The loss was -$1,250 overall", "flexible") == "-1250"
    assert extract_solution("pick 1,2,3", "flexible") == "3"  # not one number "123"
    assert extract_solution("no numbers at all", "flexible") is None
    assert extract_solution("#### ٣", "strict") is None  # only ASCII digits count


def test_unknown_method_lists_valid_ones():
    with pytest.raises(ValueError) as excinfo:
        extract_solution("#### 1", "lenient")
    assert "strict" in str(excinfo.value) and "flexible" in str(excinfo.value)
    with pytest.raises(ValueError):
        compute_score("#### 1", "1", method="lenient")


@pytest.mark.parametrize(
    "response, ground_truth, expected",
    [
        ("#### 1,234", "1234", 1.0),
        ("#### 1234", "1,234", 1.0),
        ("#### $5", "5", 1.0),
        ("#### 5.00", "5", 1.0),  # compared as decimal values
        ("#### -3", "-3", 1.0),
        ("#### 3", "-3", 0.0),
        ("#### 2.5", "2.05", 0.0),
        ("#### 0.1", "0.10000001", 0.0),
        ("The answer is 72.", "72", 0.0),  # strict: no marker, no credit
        ("Thinking...\n#### 72 clips", GSM8K_ANSWER, 1.0),  # reference given as the full answer
        ("#### 24", GSM8K_ANSWER, 0.0),  # the <<48/2=24>> annotation is not the answer
        ("#### 72", "seventy-two", 0.0),  # unreadable reference
    ],
)
def test_compute_score_strict(response, ground_truth, expected):
    assert compute_score(response, ground_truth) == expected


def test_compute_score_flexible_and_format_score():
    assert compute_score("The answer is 72.", "72", method="flexible") == 1.0
    assert compute_score("#### 71", "72", format_score=0.1) == 0.1  # answered, but wrong
    assert compute_score("I don't know", "72", format_score=0.1) == 0.0  # no answer at all


@given(n=st.integers(min_value=-(10**12), max_value=10**12))
@settings(derandomize=True, max_examples=100, deadline=None, database=None)
def test_comma_formatted_integers_match(n):
    assert compute_score(f"Computing...\n#### {n:,}", str(n)) == 1.0
    assert compute_score(f"#### {n + 1:,}", str(n)) == 0.0


_MARKER_TEXT = st.lists(
    st.sampled_from(["####", "#", " ", "\n", "$", ",", ".", "-", "0", "7", "12", "1,000", "x", "<<2=2>>"]),
    max_size=20,
).map("".join)


@given(
    response=st.one_of(st.text(), _MARKER_TEXT),
    ground_truth=st.one_of(st.text(), _MARKER_TEXT),
    method=st.sampled_from(["strict", "flexible"]),
)
@settings(
    derandomize=True,
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
def test_compute_score_never_raises_and_is_binary(response, ground_truth, method):
    assert compute_score(response, ground_truth, method=method) in (0.0, 1.0)
