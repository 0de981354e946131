"""docs/reading.md, the reading order of one PPO step, against the code: every row's line count is the span of
the definitions it names, the total and the number of files are the rows', everything a reader must read to
follow the step (what rlhf/step.py uses, what that uses, and so on, the decoder that runs included; only the
reference decoding loop, which the default model never runs, left out) is in a row, and the README quotes the
same totals.

When the code moves, the failure message gives the numbers to write."""

import ast
import importlib
import inspect
import os
import re

from helpers import REPO

import ppo
import rlhf.step
from rlhf import decode
from rlhf.config import load_config
from rlhf.models import load_causal_lm
from rlhf.rewards import load_reward

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
    stated = re.search(r"\*\*([\d,]+) lines in (\d+) files\*\*", read("docs/reading.md"))
    assert stated and (int(stated.group(1).replace(",", "")), int(stated.group(2))) == (total, files), (
        f"docs/reading.md should say **{total:,} lines in {files} files**")
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


def walk(node):
    """ast.walk, less annotations: a type named in a signature is not read to follow the code."""
    todo = [node]
    while todo:
        node = todo.pop()
        yield node
        for field, value in ast.iter_fields(node):
            if field not in ("annotation", "returns"):
                todo += [child for child in (value if isinstance(value, list) else [value]) if isinstance(child, ast.AST)]


def project_definition(obj) -> tuple[str, str] | None:
    """(file, top-level name) of a project function or class; None for anything else."""
    obj = inspect.unwrap(obj) if callable(obj) else obj  # parse_estimator's cache, for one
    if not (inspect.isfunction(obj) or inspect.isclass(obj)) or not obj.__module__.startswith(("rlhf", "ppo")):
        return None
    return os.path.relpath(inspect.getfile(obj), REPO), obj.__qualname__.split(".")[0]


def module(path: str):
    return importlib.import_module(path.removesuffix(".py").removesuffix("/__init__").replace("/", "."))


def used_by(path: str, name: str) -> set[tuple[str, str]]:
    """The project definitions a definition names (calls, decorators, base classes, a function passed as a
    value), as `name` or `module.name`, resolved in its module."""
    node, namespace, found = definitions_nodes(path)[name], module(path), set()
    for n in walk(node):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load):
            found.add(project_definition(getattr(namespace, n.id, None)))
        elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name):
            found.add(project_definition(getattr(getattr(namespace, n.value.id, None), n.attr, None)))
    return found - {None}


def definitions_nodes(path: str) -> dict[str, ast.AST]:
    return {node.name: node for node in ast.parse(read(path)).body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}


# What the step reaches through an object rather than a name, for the default config (checked below): the
# registries' entries, the KL controller, the reward function, the prompt order, the timer.
REACHED_THROUGH_OBJECTS = [
    ("rlhf/core_algos.py", "_gae_advantages"),  # ADV_ESTIMATOR_REGISTRY[algorithm.adv_estimator]
    ("rlhf/core_algos.py", "_agg_token_mean"),  # LOSS_AGG_REGISTRY[actor.loss_agg_mode]
    ("rlhf/kl/estimators.py", "kl_k1"),  # the reward's estimator, algorithm.kl_penalty
    ("rlhf/kl/controllers.py", "FixedKLController"),  # run.kl_ctrl
    ("rlhf/rewards/__init__.py", "RewardFn"),  # run.reward: reward.function, called and checked
    ("rlhf/rewards/gsm8k.py", "reward_func"),  # run.reward.fn: reward.function
    ("rlhf/prompt_order.py", "PromptOrder"),  # run.prompt_order
    ("rlhf/registry.py", "Registry"),  # the registries' lookups
    ("rlhf/tracking.py", "Timer"),  # timer
]


# What the step names but never runs under the default config (checked below), the one branch the count does not
# follow: generate's reference decoding loop, for the models rlhf.decode.supports refuses (FSDP2-sharded weights,
# other architectures). The default model runs rlhf/decode.py's `decode`, which the count follows; the reference
# loop is what tests/test_decode.py holds it to, token for token.
NOT_RUN_BY_DEFAULT = {("rlhf/decode.py", "reference_decode")}


def reached(roots) -> set[tuple[str, str]]:
    """Every project definition reachable from `roots` by the names each one uses (NOT_RUN_BY_DEFAULT aside)."""
    seen, todo = set(), list(roots)
    while todo:
        key = todo.pop()
        if key not in seen and key not in NOT_RUN_BY_DEFAULT:
            seen.add(key)
            todo += used_by(*key) - seen
    return seen


def the_steps_reach() -> set[tuple[str, str]]:
    top_level = [name for name in definitions("rlhf/step.py") if "." not in name]
    return reached([("rlhf/step.py", name) for name in top_level] + REACHED_THROUGH_OBJECTS)


def test_the_definitions_reached_through_objects_are_the_default_configs():
    cfg = load_config(None, [])
    assert (cfg.algorithm.adv_estimator, cfg.actor.loss_agg_mode, cfg.algorithm.kl_penalty) == ("gae", "token-mean", "k1")
    assert (cfg.algorithm.kl_ctrl.type, cfg.reward.function) == ("fixed", "rlhf.rewards.gsm8k:reward_func")
    assert rlhf.step.core_algos.ADV_ESTIMATOR_REGISTRY["gae"].__name__ == "_gae_advantages"
    reward = load_reward(cfg)
    assert (type(reward).__name__, reward.fn.__name__) == ("RewardFn", "reward_func")
    assert rlhf.step.core_algos.LOSS_AGG_REGISTRY["token-mean"].__name__ == "_agg_token_mean"


def test_the_reference_loop_is_named_on_the_path_and_not_run_by_the_default_model(artifacts):
    """generate names the reference loop (so leaving it out is a choice, made here), and the default config's model
    (the embedded default's kind: a Qwen2 causal LM, SDPA attention, one process: no stop rule of several) takes
    the static-cache loop instead."""
    assert ("rlhf/decode.py", "reference_decode") in used_by("rlhf/rollout.py", "generate")
    assert load_config(None, []).model.path == "embedded"
    assert decode.supports(load_causal_lm(artifacts.model_dir))


def test_every_definition_a_reader_needs_to_follow_the_step_is_in_a_row():
    """The count is the reader's: what the step uses, and what that uses, down to the decoder that runs
    (rlhf/decode.py); and a row begins and ends at a definition the reader needs (it may hold others between)."""
    counted, needed = rows(), the_steps_reach()
    assert ("rlhf/decode.py", "decode") in needed and ("rlhf/kl/exact.py", "full_kl") in needed
    missing = []
    for path, name in sorted(needed):
        first, last = definitions(path)[name]
        if not any(p == path and f <= first and last <= l for _, p, f, l, _ in counted):
            missing.append(f"{path}: {name} (lines {first}-{last})")
    assert not missing, f"docs/reading.md's rows miss what the step uses: {missing}"
    for number, path, first, last, _ in counted:
        ends = {name for name, (f, l) in definitions(path).items() if f == first or l == last}
        assert first == 1 or ends & {name for p, name in needed if p == path}, f"row {number} starts or ends outside"


def test_the_sentence_about_the_step_modules_rows_is_the_tables():
    numbers = [number for number, path, *_ in rows() if path == "rlhf/step.py"]
    expected = ", ".join(map(str, numbers[:-1])) + f" and {numbers[-1]}"
    assert f"rows {expected} are the whole of `rlhf/step.py`" in read("docs/reading.md").replace("\n", " ")


def test_the_one_files_count_with_what_it_imports():
    """ppo.py and what it uses from the package (rlhf/embedded.py aside: it builds the test bed, not the
    algorithm), as docs/reading.md and the README quote it."""
    top_level = [name for name in definitions("ppo.py") if "." not in name]
    needed = reached([("ppo.py", name) for name in top_level] + [("rlhf/kl/estimators.py", "kl_k1")])
    spans = {}
    for path, name in needed:
        if path not in ("ppo.py", "rlhf/embedded.py"):
            spans.setdefault(path, set()).update(range(definitions(path)[name][0], definitions(path)[name][1] + 1))
    total = len(read("ppo.py").splitlines()) + sum(len(lines) for lines in spans.values())
    for page in ("docs/reading.md", "README.md"):
        quoted = re.search(r"with what it imports,? ([\d,]+) lines", read(page).replace("\n", " "), re.I)
        assert quoted and quoted.group(1) == f"{total:,}", (page, total)
