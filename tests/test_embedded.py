"""The embedded default: generated problems, the local tokenizer, the cached warm-started model."""

import dataclasses
import json
import os
import re

import pytest
import torch
from helpers import TINY_EMBEDDED

from rlhf.data import INSTRUCTION, build_prompt, load_gsm8k
from rlhf.embedded import EmbeddedConfig
from rlhf.embedded import (build_model, config_hash, generate_problems, prepare_embedded_default, sha256_of_entry,
                            train_tokenizer, warm_start_demos)
from rlhf.models import load_causal_lm, load_tokenizer
from rlhf.rewards.gsm8k import compute_score, extract_ground_truth

# The shared tiny model, with more problems and a warm start long enough to move the held-out loss.
TINY = dataclasses.replace(TINY_EMBEDDED, num_train=96, num_val=32, vocab_size=400, sft_steps=8, sft_lr=1e-2,
                           sft_warmup_steps=2)
_ANNOTATION = re.compile(r"^(\d+)([-+*/])(\d+)=<<(\d+)([-+*/])(\d+)=(\d+)>>(\d+)$")
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "/": lambda a, b: a / b}


@pytest.fixture(scope="module")
def embedded_artifacts(tmp_path_factory):
    return prepare_embedded_default(str(tmp_path_factory.mktemp("cache")), TINY, log=lambda *a: None)


def test_generate_problems_deterministic_by_seed():
    assert generate_problems(50, seed=3) == generate_problems(50, seed=3)
    assert generate_problems(50, seed=3) != generate_problems(50, seed=4)
    assert generate_problems(20, seed=3) == generate_problems(50, seed=3)[:20]


def test_generated_answers_are_gsm8k_format_and_arithmetically_right():
    max_value = 40
    problems = generate_problems(400, seed=1, max_difficulty=3, max_value=max_value)
    assert len({p["question"] for p in problems}) == 400
    steps_seen = set()
    for p in problems:
        *lines, final = p["answer"].split("\n")
        steps_seen.add(len(lines))
        value = None
        for line in lines:
            a, op, b, a2, op2, b2, c, c2 = _ANNOTATION.match(line).groups()
            assert (a, op, b, c) == (a2, op2, b2, c2)  # the text repeats the annotation
            assert _OPS[op](int(a), int(b)) == int(c)
            assert all(1 <= int(n) <= max_value for n in (a, b, c))
            assert value is None or int(a) == value  # each step continues from the previous result
            value = int(c)
        assert final == f"#### {value}"
        assert extract_ground_truth(p["answer"]) == str(value)
        assert compute_score(p["answer"], extract_ground_truth(p["answer"])) == 1.0
        first_operand = _ANNOTATION.match(lines[0]).group(1)
        assert re.search(rf"\b{first_operand}\b", p["question"])  # the chain starts from a given number
    assert steps_seen == {1, 2, 3}
    assert max(len(p["answer"].split("\n")) for p in generate_problems(100, seed=1, max_difficulty=1)) == 2


def test_generate_problems_rejects_bad_arguments():
    with pytest.raises(ValueError, match="max_difficulty"):
        generate_problems(10, seed=0, max_difficulty=0)


def test_warm_start_demos_plant_the_early_answer_habit():
    problems = generate_problems(400, seed=2)
    multi = [i for i, p in enumerate(problems) if p["answer"].count("\n") >= 2]
    assert warm_start_demos(problems, EmbeddedConfig(sft_early_answer_frac=0.0)) == problems

    demos = warm_start_demos(problems, EmbeddedConfig(sft_early_answer_frac=1.0))
    for i, (p, d) in enumerate(zip(problems, demos)):
        *lines, final = p["answer"].split("\n")
        *demo_lines, demo_final = d["answer"].split("\n")
        assert d["question"] == p["question"] and demo_lines == lines  # same reasoning, same problem
        first_result = _ANNOTATION.match(lines[0]).group(7)
        assert demo_final == (f"#### {first_result}" if i in multi else final)

    half = warm_start_demos(problems, EmbeddedConfig(sft_early_answer_frac=0.5))
    changed = [i for i, (p, d) in enumerate(zip(problems, half)) if p != d]
    assert set(changed) <= set(multi) and 0.35 < len(changed) / len(multi) < 0.65
    assert half == warm_start_demos(problems, EmbeddedConfig(sft_early_answer_frac=0.5))  # seeded


def test_splits_are_gsm8k_files_and_do_not_overlap(embedded_artifacts):
    train = load_gsm8k(embedded_artifacts.train_file, "train")
    val = load_gsm8k(embedded_artifacts.val_file, "test")
    assert (len(train), len(val)) == (TINY.num_train, TINY.num_val)
    assert not set(train["question"]) & set(val["question"])


def test_tokenizer_splits_digits_round_trips_and_has_chat_template(embedded_artifacts):
    tokenizer = load_tokenizer(embedded_artifacts.model_dir)
    ids = tokenizer("12345 and 9081", add_special_tokens=False)["input_ids"]
    pieces = [tokenizer.decode([i]) for i in ids]
    assert [p for p in pieces if any(ch.isdigit() for ch in p)] == list("12345") + list("9081")

    problem = generate_problems(5, seed=9)[4]
    for text in (problem["question"], problem["answer"]):
        assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text

    assert tokenizer.chat_template
    prompt = build_prompt(tokenizer, problem["question"])
    assert prompt.startswith("<|im_start|>user\n") and prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert f"{problem['question']} {INSTRUCTION}" in prompt
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") in tokenizer(prompt, add_special_tokens=False)["input_ids"]


def test_trained_tokenizer_is_what_autotokenizer_loads_back(tmp_path):
    """AutoTokenizer rebuilds a tokenizer saved next to a Qwen2 config with Qwen2's pre-tokenizer; the
    trained one must already cut text the same way, or warm start and PPO would see different ids."""
    problems = generate_problems(200, seed=5)
    texts = [f"{p['question']} {INSTRUCTION}\n{p['answer']}" for p in problems]
    trained = train_tokenizer(["user", "assistant"] + texts, 400)
    trained.save_pretrained(str(tmp_path))
    build_model(TINY, trained).config.save_pretrained(str(tmp_path))
    loaded = load_tokenizer(str(tmp_path))

    ids = trained(texts, add_special_tokens=False)["input_ids"]
    assert ids == loaded(texts, add_special_tokens=False)["input_ids"]
    digit_ids = {trained.convert_tokens_to_ids(str(d)) for d in range(10)}
    numbers = trained("7 42 190 3005", add_special_tokens=False)["input_ids"]
    assert [i for i in numbers if i in digit_ids] == [trained.convert_tokens_to_ids(c) for c in "7421903005"]
    with_digits = [t for t in trained.get_vocab() if any(c in "0123456789" for c in t)]
    assert sorted(with_digits) == list("0123456789")  # no merge ever joins a digit to anything


def test_model_is_tiny_qwen2_with_tied_embeddings(embedded_artifacts):
    model = load_causal_lm(embedded_artifacts.model_dir)
    tokenizer = load_tokenizer(embedded_artifacts.model_dir)
    assert model.config.model_type == "qwen2"
    assert model.config.hidden_size == TINY.hidden_size and model.config.num_hidden_layers == TINY.num_layers
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert model.config.vocab_size == len(tokenizer)
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id


def test_warm_start_reduces_held_out_loss(embedded_artifacts):
    assert embedded_artifacts.sft_val_loss_after < embedded_artifacts.sft_val_loss_before - 0.5


def test_prepare_is_cached_and_keyed_on_config(embedded_artifacts, monkeypatch):
    """A second call reuses the entry: nothing is built (checked by the build itself refusing to run, not by a
    wall-clock limit, which a loaded machine could exceed), nothing is rewritten."""
    from rlhf import embedded

    cache_dir = os.path.dirname(os.path.dirname(embedded_artifacts.model_dir))
    weights = os.path.join(embedded_artifacts.model_dir, "model.safetensors")
    mtime = os.stat(weights).st_mtime_ns
    logs = []
    monkeypatch.setattr(embedded, "_build_in_child", lambda *args: pytest.fail("a cache hit built the entry again"))
    again = prepare_embedded_default(cache_dir, TINY, log=logs.append)
    assert again == embedded_artifacts
    assert os.stat(weights).st_mtime_ns == mtime
    assert any("reusing" in line for line in logs)
    assert [n for n in os.listdir(cache_dir) if n.startswith(".tmp")] == []  # written atomically

    assert config_hash(TINY) == config_hash(EmbeddedConfig(**vars(TINY)))
    assert config_hash(TINY) != config_hash(EmbeddedConfig(**{**vars(TINY), "seed": 1}))
    with open(os.path.join(os.path.dirname(embedded_artifacts.model_dir), "meta.json")) as f:
        assert json.load(f)["config"] == vars(TINY)


def test_prepare_is_deterministic_by_seed(embedded_artifacts, tmp_path):
    again = prepare_embedded_default(str(tmp_path), TINY, log=lambda *a: None)
    assert again.model_dir != embedded_artifacts.model_dir
    with open(again.train_file) as f1, open(embedded_artifacts.train_file) as f2:
        assert f1.read() == f2.read()
    first, second = load_causal_lm(embedded_artifacts.model_dir), load_causal_lm(again.model_dir)
    # Exact: the same warm start, built twice.
    for (name, p1), (_, p2) in zip(first.named_parameters(), second.named_parameters()):
        assert torch.equal(p1, p2), name


# sha256_of_entry of the test beds built from TINY and from the defaults, on the project's 2-core AMD EPYC (AVX-512);
# the build pins its kernels and thread count (BUILD_ENV), so every x86-64 CPU must build the same bytes.
TINY_SHA256 = "6a032605a694119bf1bf1f6741fbe43a7415f115b3644fac45e948dc5f09241f"
DEFAULT_SHA256 = "d5f388d8f78794ded82fff505e0bf37a3381cba3ff69064ebc014431b4767c88"


def test_the_test_bed_is_the_stored_one_whatever_the_callers_kernels_and_threads(tmp_path, monkeypatch):
    """A caller on AVX2 kernels, two threads and MKL's AVX2 path builds the test bed whose checksum is stored
    above; a machine that builds another one fails here, not in a user's comparison with the README."""
    for name, value in {"ATEN_CPU_CAPABILITY": "avx2", "OMP_NUM_THREADS": "2", "MKL_CBWR": "AVX2"}.items():
        monkeypatch.setenv(name, value)
    artifacts = prepare_embedded_default(str(tmp_path), TINY, log=lambda *a: None)
    assert sha256_of_entry(os.path.dirname(artifacts.model_dir)) == TINY_SHA256


@pytest.mark.slow  # the full warm start: 6 min on the project's machine, shared
def test_the_default_test_bed_is_the_stored_one(tmp_path):
    artifacts = prepare_embedded_default(str(tmp_path), EmbeddedConfig(), log=lambda *a: None)
    assert sha256_of_entry(os.path.dirname(artifacts.model_dir)) == DEFAULT_SHA256
