"""GSM8K loading: hub datasets and local files through one code path, prompts, tokenization.

    train = load_gsm8k("openai/gsm8k", "train")                 # the hub (needs network)
    val = load_gsm8k("data/val.jsonl", "test")                   # a local .jsonl/.json/.parquet file
    prompts, num_filtered = tokenize_prompts(train, tokenizer, max_prompt_length=256)

Every row carries `question`, `answer` (GSM8K's reasoning ending in `#### N`) and `ground_truth` (the
normalised N, parsed by `rlhf.rewards.gsm8k.extract_ground_truth`, the same parser the reward uses).
Bad rows are an error naming their indices, never silently dropped: a dataset that loses rows without a
word gives accuracies that cannot be compared.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from rlhf.rewards.gsm8k import INSTRUCTION, extract_ground_truth  # INSTRUCTION: the default data.instruction


if TYPE_CHECKING:  # annotations only: `datasets` is imported where data is loaded, so that building prompts
    import datasets  # (build_prompt) works where it is not installed (bench/gpu_check.py on a bare CUDA image)

SUPPORTED_EXTENSIONS = (".jsonl", ".json", ".parquet")
_MAX_NAMED = 5  # bad rows named in an error message; the count is always given


def build_prompt(tokenizer, question: str, instruction: str = INSTRUCTION, system_prompt: str | None = None) -> str:
    """The prompt text for one question: `question + " " + instruction` (the question alone for an empty
    instruction), wrapped in the tokenizer's chat template as a user turn (after a system turn `system_prompt`,
    if given) followed by the assistant header; plain text if it has no template (the system prompt, a blank
    line, then the question)."""
    content = f"{question} {instruction}" if instruction else question
    system = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [*system, {"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )
    return content if system_prompt is None else f"{system_prompt}\n\n{content}"


def looks_like_path(source: str) -> bool:
    """A hub id is `name` or `org/name`; anything else (./x, /x, a/b/c, x.jsonl) is a local path."""
    return (source.startswith((".", "/", "~")) or source.count("/") > 1
            or source.endswith((".jsonl", ".json", ".parquet")) or os.path.exists(source))


def _is_local(source: str) -> bool:
    return source.endswith(SUPPORTED_EXTENSIONS) or os.path.exists(source)


def _format_bad_rows(bad: Sequence[int], total: int, where: str) -> str:
    named = ", ".join(str(i) for i in bad[:_MAX_NAMED]) + (", ..." if len(bad) > _MAX_NAMED else "")
    return (f"{where}: {len(bad)} of {total} rows lack a question or an answer ending in a parseable "
            f'"#### <number>" (0-based row indices: {named}).')


def _bad_rows(questions: Iterable, answers: Iterable) -> list[int]:
    """Indices of rows whose question is empty/missing or whose answer has no parseable `#### N`."""
    bad = []
    for i, (question, answer) in enumerate(zip(questions, answers, strict=True)):
        if not isinstance(question, str) or not question.strip() or not isinstance(answer, str) \
                or extract_ground_truth(answer) is None:
            bad.append(i)
    return bad


def _check_columns(columns: Iterable[str], where: str, keys: tuple[str, str] = ("question", "answer")) -> None:
    missing = [c for c in keys if c not in columns]
    if missing:
        raise ValueError(f"{where}: missing column(s) {missing}; the rows need a question column and an answer "
                         f"column ending in \"#### <number>\" (data.question_key={keys[0]!r}, data.answer_key="
                         f"{keys[1]!r}); the file has the columns {sorted(columns)}.")


def check_data_file(path: str, keys: tuple[str, str] = ("question", "answer")) -> int:
    """Cheap validation of a local GSM8K file before any model loads; returns its number of rows.

    Raises ValueError if the file is missing, has an unsupported extension, holds invalid JSON (the line
    number is given for JSON lines), lacks the question and answer columns `keys` (data.question_key,
    data.answer_key), or has rows without a parseable `#### N` answer (the first bad row indices are given).
    """
    if os.path.isdir(path):
        raise ValueError(f"data file {path!r} is a directory; give a {'/'.join(SUPPORTED_EXTENSIONS)} file.")
    if not os.path.isfile(path):
        raise ValueError(f"data file {path!r} does not exist.")
    ext = os.path.splitext(path)[1]
    if ext not in SUPPORTED_EXTENSIONS:
        raise ValueError(f"data file {path!r}: unsupported extension {ext!r}; "
                         f"use one of {', '.join(SUPPORTED_EXTENSIONS)}.")
    if ext == ".parquet":
        import pyarrow.parquet as pq  # a dependency of `datasets`

        table = pq.read_table(path)
        _check_columns(table.column_names, f"data file {path!r}", keys)
        rows = table.select(list(keys)).to_pydict()
        questions, answers = rows[keys[0]], rows[keys[1]]
    else:
        records = _read_json_records(path)
        for i, record in enumerate(records):
            if not isinstance(record, dict):
                raise ValueError(f"data file {path!r}: row {i} is a {type(record).__name__}, not an object "
                                 "with 'question' and 'answer'.")
        _check_columns(set().union(*records) if records else (), f"data file {path!r}", keys)
        questions = [r.get(keys[0]) for r in records]
        answers = [r.get(keys[1]) for r in records]
    if not questions:
        raise ValueError(f"data file {path!r} has no rows.")
    bad = _bad_rows(questions, answers)
    if bad:
        raise ValueError(_format_bad_rows(bad, len(questions), f"data file {path!r}"))
    return len(questions)


def _read_json_records(path: str) -> list:
    """Rows of a .json (one array, or JSON lines as `datasets` also accepts) or .jsonl file."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.endswith(".json") and text.lstrip().startswith("["):
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"data file {path!r}: invalid JSON at line {e.lineno}: {e.msg}.") from None
    records = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"data file {path!r}: invalid JSON on line {lineno}: {e.msg}.") from None
    return records


def load_gsm8k(source: str, split: str, subset: str = "main",
               keys: tuple[str, str] = ("question", "answer")) -> datasets.Dataset:
    """GSM8K as a Dataset with columns question, answer, ground_truth (the normalised final number).

    `source` is a hub dataset name ("openai/gsm8k", loaded as `load_dataset(source, subset, split=split)`)
    or a local .jsonl/.json/.parquet file (the whole file is the split; `subset` is ignored). Raises
    ValueError naming the first bad rows if any row lacks a question or a parseable `#### N` answer. `keys`
    names the question and answer columns (data.question_key, data.answer_key), renamed question and answer.
    """
    import datasets

    if _is_local(source):
        check_data_file(source, keys)  # clear messages (missing file, bad line) before `datasets` sees it
        builder = "parquet" if source.endswith(".parquet") else "json"
        ds = datasets.load_dataset(builder, data_files={split: source}, split=split)
    else:
        ds = datasets.load_dataset(source, subset, split=split)
    where = f"dataset {source!r} (split {split!r})"
    _check_columns(ds.column_names, where, keys)
    bad = _bad_rows(ds[keys[0]], ds[keys[1]])
    if bad:
        raise ValueError(_format_bad_rows(bad, len(ds), where))
    ds = ds.select_columns(list(keys))
    if keys != ("question", "answer"):
        ds = ds.rename_columns(dict(zip(keys, ("question", "answer"))))
    return ds.add_column("ground_truth", [extract_ground_truth(a) for a in ds["answer"]])


def tokenize_prompts(dataset: datasets.Dataset, tokenizer, max_prompt_length: int, instruction: str = INSTRUCTION,
                     system_prompt: str | None = None) -> tuple[datasets.Dataset, int]:
    """Prompt token ids for each row: returns (Dataset with "input_ids" (list[int]), "prompt" (the text they encode,
    which the reward function receives) and "ground_truth", num_filtered). Prompts longer than `max_prompt_length`
    tokens are dropped and counted, never cut: a truncated question is a different problem with the same reference
    answer. The prompts are build_prompt's with `instruction` and `system_prompt` (data.instruction,
    data.system_prompt).
    """
    import datasets

    prompts = [build_prompt(tokenizer, q, instruction, system_prompt) for q in dataset["question"]]
    # A chat template already writes every special token (e.g. Llama's BOS); adding them again would
    # double them. Plain-text prompts get the tokenizer's usual specials.
    add_special_tokens = not getattr(tokenizer, "chat_template", None)
    input_ids = tokenizer(prompts, add_special_tokens=add_special_tokens)["input_ids"]
    keep = [i for i, ids in enumerate(input_ids) if len(ids) <= max_prompt_length]
    ground_truth = dataset["ground_truth"]
    out = datasets.Dataset.from_dict({
        "input_ids": [list(input_ids[i]) for i in keep],
        "prompt": [prompts[i] for i in keep],
        "ground_truth": [ground_truth[i] for i in keep],
    })
    return out, len(prompts) - len(keep)


def write_jsonl(rows: Iterable[dict], path: str) -> None:
    """Write one JSON object per line (UTF-8), creating parent directories."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def load_prompts(cfg, tokenizer, source: str, split: str, max_rows: int | None = None):
    """The problems of `source` (a hub dataset name or a local file; "embedded" resolved already), split `split`,
    the first `max_rows` of them (None: all), as prompt token ids (tokenize_prompts): returns (prompt rows, how
    many prompts were dropped as longer than data.max_prompt_length). The one path of the training and the
    held-out split alike: both read the columns data.question_key and data.answer_key and build their prompts
    with data.instruction and data.system_prompt."""
    d = cfg.data
    dataset = load_gsm8k(source, split, d.subset, (d.question_key, d.answer_key))
    if max_rows:
        dataset = dataset.select(range(min(max_rows, len(dataset))))
    return tokenize_prompts(dataset, tokenizer, d.max_prompt_length, d.instruction, d.system_prompt)


def load_held_out(cfg, tokenizer, val_source: str):
    """The held-out prompt rows of `val_source`: data.val_split, its first data.max_val_samples (load_prompts)."""
    return load_prompts(cfg, tokenizer, val_source, cfg.data.val_split, cfg.data.max_val_samples)
