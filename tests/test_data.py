"""GSM8K loading from local files (one code path with the hub), validation messages, prompts, filtering."""

import json

import datasets
import pytest

from rlhf import data
from rlhf.data import INSTRUCTION, build_prompt, check_data_file, load_gsm8k, tokenize_prompts, write_jsonl
from rlhf.embedded import generate_problems, train_tokenizer

ROWS = [
    {"question": "Ann has 3 pens and buys 4. How many?", "answer": "3+4=<<3+4=7>>7\n#### 7", "id": 0},
    {"question": "A farm sells 1,200 eggs a day. How many in 2 days?",
     "answer": "1200*2=<<1200*2=2400>>2400\n#### 2,400", "id": 1},
    {"question": "What is 5-8?", "answer": "5-8=<<5-8=-3>>-3\n#### -3", "id": 2},
]


@pytest.fixture(scope="module")
def tokenizer():
    problems = generate_problems(64, seed=0)
    return train_tokenizer(["user", "assistant"] + [p["question"] + " " + p["answer"] for p in problems], 300)


def test_load_gsm8k_jsonl_and_parquet_same_rows(tmp_path):
    jsonl = tmp_path / "rows.jsonl"
    write_jsonl(ROWS, str(jsonl))
    parquet = tmp_path / "rows.parquet"
    datasets.Dataset.from_list(ROWS).to_parquet(str(parquet))
    for path in (jsonl, parquet):
        ds = load_gsm8k(str(path), "train")
        assert ds.column_names == ["question", "answer", "ground_truth"]
        assert ds["ground_truth"] == ["7", "2400", "-3"]
        assert ds["question"] == [r["question"] for r in ROWS]


def test_load_gsm8k_json_array(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(ROWS))
    assert check_data_file(str(path)) == 3
    assert load_gsm8k(str(path), "test")["ground_truth"] == ["7", "2400", "-3"]


def test_load_gsm8k_hub_name_goes_through_load_dataset(monkeypatch):
    calls = []

    def fake_load_dataset(*args, **kwargs):
        calls.append((args, kwargs))
        return datasets.Dataset.from_list(ROWS)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    ds = load_gsm8k("openai/gsm8k", "test", subset="socratic")
    assert calls == [(("openai/gsm8k", "socratic"), {"split": "test"})]
    assert ds["ground_truth"] == ["7", "2400", "-3"]


def test_load_gsm8k_names_bad_rows(tmp_path, monkeypatch):
    rows = [dict(r) for r in ROWS] + [{"question": "Q?", "answer": "no marker"}, {"question": "", "answer": "#### 1"}]
    # Past the early file check, the loaded dataset itself is validated too (the hub path has no file).
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: datasets.Dataset.from_list(rows))
    with pytest.raises(ValueError, match=r"2 of 5 rows .*indices: 3, 4\)"):
        load_gsm8k("openai/gsm8k", "train")
    path = tmp_path / "bad.jsonl"
    write_jsonl(rows, str(path))
    with pytest.raises(ValueError, match=r"bad.jsonl.*indices: 3, 4\)"):
        load_gsm8k(str(path), "train")


def test_check_data_file_errors(tmp_path):
    with pytest.raises(ValueError, match="nope.jsonl.*does not exist"):
        check_data_file(str(tmp_path / "nope.jsonl"))

    with pytest.raises(ValueError, match="is a directory"):
        check_data_file(str(tmp_path))

    csv = tmp_path / "rows.csv"
    csv.write_text("question,answer\n")
    with pytest.raises(ValueError, match=r"unsupported extension '.csv'"):
        check_data_file(str(csv))

    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps(ROWS[1]) + "\n{oops\n")
    with pytest.raises(ValueError, match="invalid JSON on line 3"):
        check_data_file(str(broken))

    unmarked = tmp_path / "unmarked.jsonl"
    write_jsonl([ROWS[0], {"question": "Q?", "answer": "42"}, ROWS[1], {"question": "Q?", "answer": "#### x"}],
                str(unmarked))
    with pytest.raises(ValueError, match=r"2 of 4 rows .*indices: 1, 3\)"):
        check_data_file(str(unmarked))

    no_answer = tmp_path / "no_answer.parquet"
    datasets.Dataset.from_list([{"question": "Q?", "solution": "#### 1"}]).to_parquet(str(no_answer))
    with pytest.raises(ValueError, match=r"missing column\(s\) \['answer'\]"):
        check_data_file(str(no_answer))

    good = tmp_path / "good.jsonl"
    write_jsonl(ROWS, str(good))
    assert check_data_file(str(good)) == 3


def test_check_data_file_names_only_the_first_bad_rows(tmp_path):
    path = tmp_path / "many.jsonl"
    write_jsonl([{"question": "Q?", "answer": "none"}] * 9, str(path))
    with pytest.raises(ValueError, match=r"9 of 9 rows .*indices: 0, 1, 2, 3, 4, \.\.\.\)"):
        check_data_file(str(path))


def test_build_prompt_plain_text_without_chat_template(tokenizer):
    plain = train_tokenizer(["some text"], 300)
    plain.chat_template = None
    assert build_prompt(plain, "What is 2+2?") == "What is 2+2? " + INSTRUCTION


def test_build_prompt_uses_chat_template(tokenizer):
    prompt = build_prompt(tokenizer, "What is 2+2?")
    assert prompt == f"<|im_start|>user\nWhat is 2+2? {INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n"


def test_tokenize_prompts_filters_long_prompts_and_counts_them(tokenizer):
    questions = ["Tom has 3 apples.", "Tom has 3 apples. " * 20, "Anna has 5 books.", "Anna has 5 books. " * 30]
    ds = datasets.Dataset.from_dict({"question": questions, "answer": ["#### 3", "#### 4", "#### 5", "#### 6"],
                                     "ground_truth": ["3", "4", "5", "6"]})
    lengths = [len(tokenizer(build_prompt(tokenizer, q), add_special_tokens=False)["input_ids"]) for q in questions]
    limit = max(lengths[0], lengths[2])
    assert limit < min(lengths[1], lengths[3])

    out, num_filtered = tokenize_prompts(ds, tokenizer, max_prompt_length=limit)
    assert num_filtered == 2
    assert out["ground_truth"] == ["3", "5"]
    # kept prompts are whole (never cut) and decode back to the prompt text
    assert [len(ids) for ids in out["input_ids"]] == [lengths[0], lengths[2]]
    assert tokenizer.decode(out["input_ids"][1]) == build_prompt(tokenizer, questions[2])

    out, num_filtered = tokenize_prompts(ds, tokenizer, max_prompt_length=max(lengths))
    assert num_filtered == 0 and len(out) == 4


def test_write_jsonl_round_trip(tmp_path):
    path = tmp_path / "sub" / "rows.jsonl"
    write_jsonl(ROWS, str(path))
    assert [json.loads(line) for line in path.read_text().splitlines()] == ROWS


def test_the_default_prompt_is_pinned(artifacts):
    """data.instruction and data.system_prompt at their defaults give the prompt every run has trained on: the
    question, a space and verl's GSM8K instruction as the chat template's user turn, token for token."""
    from rlhf.config import DataConfig
    from rlhf.models import load_tokenizer

    tok = load_tokenizer(artifacts.model_dir)
    question = "Lucy has 17 books. She loses 5. She gives 10 to Tom. How many books does Lucy have now?"
    assert DataConfig().instruction == INSTRUCTION and DataConfig().system_prompt is None
    assert build_prompt(tok, question) == (
        f"<|im_start|>user\n{question} Let's think step by step and output the final answer after \"####\"."
        "<|im_end|>\n<|im_start|>assistant\n")
    rows, _ = tokenize_prompts(datasets.Dataset.from_dict({"question": [question], "ground_truth": ["2"]}), tok, 256)
    assert rows["input_ids"][0] == [
        1, 489, 201, 469, 305, 223, 19, 25, 364, 16, 335, 370, 223, 23, 16, 335, 345, 223, 19, 18, 357, 422, 16, 306,
        310, 364, 328, 454, 326, 327, 33, 309, 293, 314, 275, 301, 275, 303, 308, 281, 307, 315, 313, 298, 291, 2,
        201, 1, 493, 201]


def test_instruction_and_system_prompt():
    question, plain = "What is 5-8?", object()  # a tokenizer without a chat template
    assert build_prompt(plain, question, instruction="") == question
    assert build_prompt(plain, question, instruction="Answer.", system_prompt="Be brief.") == \
        "Be brief.\n\nWhat is 5-8? Answer."
    chat = type("Chat", (), {"chat_template": "x", "apply_chat_template": staticmethod(
        lambda messages, **kwargs: " | ".join(f"{m['role']}: {m['content']}" for m in messages))})()
    assert build_prompt(chat, question, "Answer.", "Be brief.") == "system: Be brief. | user: What is 5-8? Answer."
    assert build_prompt(chat, question) == f"user: What is 5-8? {INSTRUCTION}"


def test_columns_of_your_own(tmp_path):
    """data.question_key and data.answer_key name the columns; a file without them is refused before any
    model loads, naming the columns it has."""
    from rlhf.config import ConfigError, load_config

    path = tmp_path / "mine.jsonl"
    write_jsonl([{"problem": r["question"], "solution": r["answer"]} for r in ROWS], str(path))
    ds = load_gsm8k(str(path), "train", keys=("problem", "solution"))
    assert ds["question"] == [r["question"] for r in ROWS] and ds["ground_truth"] == ["7", "2400", "-3"]
    base = ["task.name=gsm8k", f"data.train_files={path}", f"data.val_files={path}"]
    load_config(None, [*base, "data.question_key=problem", "data.answer_key=solution"])
    with pytest.raises(ConfigError) as e:
        load_config(None, [*base, "data.question_key=problem"])
    assert "missing column(s) ['answer']" in str(e.value) and "['problem', 'solution']" in str(e.value)
    assert "data.answer_key" in str(e.value)


def loaded_task(artifacts, tmp_path, *overrides):
    """Task gsm8k's data, loaded as a run loads it, from copies of the tiny embedded files whose question and
    answer columns are called `problem` and `solution`; returns (the task's data, the copies' rows)."""
    from accelerate import Accelerator

    from rlhf.config import load_config
    from rlhf.tasks import get_task

    files, rows = {}, {}
    for split, source in (("train", artifacts.train_file), ("val", artifacts.val_file)):
        rows[split] = [json.loads(line) for line in open(source)][:12]
        files[split] = str(tmp_path / f"{split}.jsonl")
        write_jsonl([{"solution": r["answer"], "problem": r["question"]} for r in rows[split]], files[split])
    cfg = load_config(None, ["task.name=gsm8k", f"model.path={artifacts.model_dir}", f"data.train_files={files['train']}",
                             f"data.val_files={files['val']}", "data.question_key=problem",
                             "data.answer_key=solution", *overrides])
    return get_task("gsm8k").load(cfg, Accelerator(cpu=True)), rows


def test_both_splits_read_the_columns_the_config_names(artifacts, tmp_path):
    """data.question_key and data.answer_key hold for the training split as for the held-out one: each row's
    prompt is its own question's, its ground truth its own answer's."""
    loaded, rows = loaded_task(artifacts, tmp_path)
    for split, prompt_rows in (("train", loaded.train_set), ("val", loaded.val_set)):
        expected = [loaded.tokenizer(build_prompt(loaded.tokenizer, r["question"]), add_special_tokens=False)["input_ids"]
                    for r in rows[split]]
        assert prompt_rows["input_ids"] == expected, split
        assert prompt_rows["ground_truth"] == [r["answer"].rpartition("#### ")[2] for r in rows[split]], split


def test_training_and_held_out_prompts_carry_the_same_system_prompt(artifacts, tmp_path):
    """data.system_prompt and data.instruction reach the training prompts as they reach the held-out ones, so
    that the policy is trained on the prompts it is evaluated on."""
    system, instruction = "Answer with one line of arithmetic per step.", "Be brief."
    loaded, rows = loaded_task(artifacts, tmp_path, f"data.system_prompt={system}", f"data.instruction={instruction}")
    tokenizer = loaded.tokenizer
    for split, prompt_rows in (("train", loaded.train_set), ("val", loaded.val_set)):
        texts = tokenizer.batch_decode(list(prompt_rows["input_ids"]))
        assert texts == [build_prompt(tokenizer, r["question"], instruction, system) for r in rows[split]], split
        assert all(text.startswith(f"<|im_start|>system\n{system}<|im_end|>") for text in texts), split
