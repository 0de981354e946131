"""docs/reading.md, the reading order of one PPO step, against the code: every row's line count is the span of
the definitions it names, the total and the number of files are the rows', every function the step calls is
in a row or in the list of what it calls by name alone, and the README quotes the same total.

When the code moves, the failure message gives the numbers to write."""

import ast
import importlib
import inspect
import os
import re

from helpers import REPO

import rlhf.step

PAGE = os.path.join(REPO, "docs", "reading.md")
ROW = re.compile(r"^\| (\d+) \| `([^`]+)` \| (the top|`[^`]+`) \| (the end|`[^`]+`) \| [^|]+ \| ([\d,]+) \|$", re.M)


def read(path: str) -> str:
    with open(os.path.join(REPO, path)) as f:
        return f.read()


def definitions(path: str) -> dict[str, tuple[int, int]]:
    """Each top-level definition of a file (and each class's methods, as Class.method) -> its first line (its
    decorators' and its leading comment lines included) and last line."""
    lines = read(path).splitlines()
    spans = {}

    def first_line(node) -> int:
        start = min([d.lineno for d in getattr(node, "decorator_list", [])] + [node.lineno])
        while start > 1 and lines[start - 2].lstrip().startswith("#"):  # a comment that opens the definition
            start -= 1
        return start

    for node in ast.parse("\n".join(lines)).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            spans[node.name] = (first_line(node), node.end_lineno)
            for inner in (n for n in node.body if isinstance(n, ast.FunctionDef) and isinstance(node, ast.ClassDef)):
                spans[f"{node.name}.{inner.name}"] = (first_line(inner), inner.end_lineno)
    return spans


def rows() -> list[tuple[int, str, int, int, int]]:
    """(number, file, first line, last line, the lines the page states) of each row of the table."""
    found = []
    for number, path, start, end, stated in ROW.findall(read("docs/reading.md")):
        spans, length = definitions(path), len(read(path).splitlines())
        first = 1 if start == "the top" else spans[start.strip("`")][0]
        last = length if end == "the end" else spans[end.strip("`")][1]
        found.append((int(number), path, first, last, int(stated.replace(",", ""))))
    return found


def total_and_files() -> tuple[int, int]:
    counted = rows()
    return sum(last - first + 1 for _, _, first, last, _ in counted), len({path for _, path, *_ in counted})


def test_each_rows_count_is_the_span_of_the_definitions_it_names():
    counted = rows()
    assert [number for number, *_ in counted] == list(range(1, len(counted) + 1)) and len(counted) >= 10
    wrong = [f"row {n} ({path}): {last - first + 1}, not {stated}" for n, path, first, last, stated in counted
             if last - first + 1 != stated]
    assert not wrong, f"docs/reading.md's counts: {wrong}"


def test_the_total_is_the_rows_and_the_readme_quotes_it():
    total, files = total_and_files()
    stated = re.search(r"\*\*([\d,]+) lines in (\w+) files\*\*", read("docs/reading.md"))
    words = {"five": 5, "six": 6, "seven": 7}
    assert stated and (int(stated.group(1).replace(",", "")), words[stated.group(2)]) == (total, files), (
        f"docs/reading.md should say **{total:,} lines in {files} files**")
    assert files <= 6
    readme = re.search(r"one step of the trainer in ([\d,]+) lines", read("README.md").replace("\n", " "))
    assert readme and readme.group(1) == f"{total:,}", f"the README should quote {total:,} lines"


def test_ppo_py_is_about_300_lines_as_the_pages_say():
    length = len(read("ppo.py").splitlines())
    assert length <= 300
    for page in ("docs/reading.md", "README.md"):
        quoted = re.findall(r"ppo\.py\S* (\d[\d,]*) lines", read(page).replace("\n", " "))
        assert quoted and all(q == str(length) for q in quoted), (page, quoted, length)


def test_every_row_is_inside_its_file_and_the_step_module_is_read_whole():
    counted = rows()
    step_lines = set()
    for _, path, first, last, _ in counted:
        assert 1 <= first <= last <= len(read(path).splitlines())
        if path == "rlhf/step.py":
            step_lines |= set(range(first, last + 1))
    for name, (first, last) in definitions("rlhf/step.py").items():
        assert set(range(first, last + 1)) <= step_lines, f"rlhf/step.py's {name} is in no row"


def called_by_the_step() -> set[tuple[str, str]]:
    """(file, definition) of every project function or class rlhf/step.py calls by name, `module.name` or an
    attribute of a class it names (ADV_ESTIMATOR_REGISTRY's entries count as core_algos' estimators)."""
    tree = ast.parse(read("rlhf/step.py"))
    found = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        target = node.func
        if isinstance(target, ast.Name):
            obj = getattr(rlhf.step, target.id, None)
        elif isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
            obj = getattr(getattr(rlhf.step, target.value.id, None), target.attr, None)
        else:
            continue
        obj = inspect.unwrap(obj) if callable(obj) else None  # parse_estimator's cache, for one
        if not (inspect.isfunction(obj) or inspect.isclass(obj)) or not obj.__module__.startswith("rlhf"):
            continue
        found.add((os.path.relpath(inspect.getfile(obj), REPO), obj.__qualname__))
    return found


def test_every_function_the_step_calls_is_read_or_named_in_what_it_calls_by_name_alone():
    counted = rows()
    by_name = read("docs/reading.md").partition("## What the step calls by name alone")[2]
    assert by_name, "docs/reading.md has no section 'What the step calls by name alone'"
    missing = []
    calls = called_by_the_step()
    assert {("rlhf/core_algos.py", "token_rewards"), ("rlhf/processes.py", "optimizer_steps"),
            ("rlhf/rollout.py", "generate")} <= calls  # the scan sees the step's calls
    for path, name in sorted(calls):
        spans = definitions(path)
        if name not in spans:
            continue  # a method reached through an object, e.g. a registry's
        first, last = spans[name]
        inside = any(p == path and f <= first and last <= l for _, p, f, l, _ in counted)
        if not inside and f"`{name.rpartition('.')[2]}`" not in by_name:
            missing.append(f"{path}: {name}")
    assert not missing, f"the step calls these, which docs/reading.md neither lists nor names: {missing}"
    assert importlib.import_module("rlhf.kl").full_kl.__module__ == "rlhf.kl.exact"
