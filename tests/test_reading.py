"""docs/reading.md, the reading order of one PPO step, against what runs: one step of the trainer with the
default config (its plan, then the step) and ppo.py's loop run under sys.setprofile, which records every project
function entered (rlhf/ and ppo.py), in order. What a reader reads is counted from that record, and the page and
the README quote it:

- lines: the non-blank lines of the definitions that ran (a function, or a class's method, whole: its decorators,
  docstring and comments included; a function nested in one, a lambda or a comprehension is part of it), of the
  bodies of the classes whose methods ran, whose records were built or which the step is handed (their fields,
  without the methods), and of the module-level assignments those lines read (a regular expression, a constant),
  and so on;
- files: the files those lines are in;
- file switches: following the calls in the order they first run, each definition read where it is first called
  and the reader back in its caller's file to go on, how often the file changes;
- depth: the most project calls nested under the step (the step's own callees are at depth 1).

Each row of the page's table is a span of a file (`from` a definition or a module-level name `to` another, or the
file's top or end); its count is the traced lines inside it, every traced line is in one row, and the rows add up
to the total. When the code moves, the failure message gives the numbers to write."""

import ast
import os
import re
import sys
from dataclasses import dataclass, field

import pytest
from accelerate import Accelerator
from helpers import REPO, tiny_overrides

import ppo
import rlhf.setup
from rlhf import step
from rlhf.config import load_config
from rlhf.tracking import Timer

ROW = re.compile(r"^\| (\d+) \| `([^`]+)` \| (the top|`[^`]+`) \| (the end|`[^`]+`) \| [^|]+ \| ([\d,]+) \|$", re.M)


def read(path: str) -> str:
    """A file of the repository."""
    with open(os.path.join(REPO, path)) as f:
        return f.read()


def project_path(filename: str) -> str | None:
    """A project file's path relative to the repository (the package and ppo.py), else None."""
    path = os.path.relpath(filename, REPO)
    return path if path.startswith("rlhf/") or path == "ppo.py" else None


_SPANS: dict = {}


def spans(path: str):
    """(each definition's (first, last) line: top-level functions and classes' methods; each class's body
    without its methods; each module-level assignment's lines by the names it binds)."""
    if path not in _SPANS:
        tree = ast.parse(read(path))
        functions, bodies, constants = {}, {}, {}

        def first(node):
            return min([d.lineno for d in getattr(node, "decorator_list", [])] + [node.lineno])

        for node in tree.body:
            if isinstance(node, ast.FunctionDef):
                functions[node.name] = (first(node), node.end_lineno)
            elif isinstance(node, ast.ClassDef):
                lines = set(range(first(node), node.end_lineno + 1))
                for inner in node.body:
                    if isinstance(inner, ast.FunctionDef):
                        functions[f"{node.name}.{inner.name}"] = (first(inner), inner.end_lineno)
                        lines -= set(range(first(inner), inner.end_lineno + 1))
                bodies[node.name] = lines
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    for name in ast.walk(target):
                        if isinstance(name, ast.Name):
                            constants[name.id] = node
        _SPANS[path] = functions, bodies, constants, tree
    return _SPANS[path]


def definition_of(path: str, line: int) -> str | None:
    """The definition (function, or Class.method) whose span holds `line`: nested functions, lambdas and
    comprehensions belong to the definition around them."""
    functions = spans(path)[0]
    inside = [(l - f, name) for name, (f, l) in functions.items() if f <= line <= l]
    return max(inside)[1] if inside else None  # the outermost (a method, not a function nested in it)


@dataclass
class Trace:
    order: list = field(default_factory=list)  # (path, definition) in the order first entered
    classes: set = field(default_factory=set)  # (path, class) whose code ran or whose record was built
    walk: list = field(default_factory=list)  # the file a reader is in: at each first call, the caller's, the callee's
    max_depth: int = 0
    deepest: list = field(default_factory=list)  # the chain of definitions at the maximum depth

    def lines(self) -> dict[str, set[int]]:
        """Each file's lines a reader reads: the definitions that ran, the class bodies of their classes and of
        the records built, and the module-level assignments they (and those) read; blank lines left out."""
        by_file: dict[str, set[int]] = {}
        for path, name in self.order:
            first, last = spans(path)[0][name]
            by_file.setdefault(path, set()).update(range(first, last + 1))
            if "." in name:
                self.classes.add((path, name.split(".")[0]))
        for path, name in self.classes:
            by_file.setdefault(path, set()).update(spans(path)[1][name])
        for path in list(by_file):
            constants, tree = spans(path)[2], spans(path)[3]
            todo = [node for node in ast.walk(tree) if getattr(node, "lineno", 0) in by_file[path]
                    and isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)]
            seen = set()
            while todo:
                name = todo.pop().id
                if name in constants and name not in seen:
                    seen.add(name)
                    node = constants[name]
                    by_file[path].update(range(node.lineno, node.end_lineno + 1))
                    todo += [n for n in ast.walk(node.value) if isinstance(n, ast.Name)] if node.value else []
        for path, lines in by_file.items():
            text = read(path).splitlines()
            by_file[path] = {n for n in lines if text[n - 1].strip()}
        return by_file

    def count(self) -> tuple[int, int, int, int]:
        """(lines, files, file switches in call order, max call depth)."""
        lines = self.lines()
        switches = sum(a != b for a, b in zip(self.walk, self.walk[1:]))
        return sum(map(len, lines.values())), len(lines), switches, self.max_depth


def trace(fn, *args, **kwargs) -> tuple[object, Trace]:
    """fn(*args, **kwargs) under sys.setprofile: every project definition entered, in the order first entered,
    the classes whose records were built, and the deepest chain of project calls below `fn`."""
    record, stack = Trace(), []
    entered = set()

    def profile(frame, event, arg):
        if event == "call":
            code = frame.f_code
            path = project_path(code.co_filename)
            if path is None:
                if code.co_name == "__init__" and code.co_filename == "<string>":  # a dataclass's record
                    owner = type(frame.f_locals.get("self"))
                    where = project_path(getattr(sys.modules.get(owner.__module__), "__file__", "") or "")
                    if where:
                        record.classes.add((where, owner.__qualname__.split(".")[0]))
                return
            name = definition_of(path, code.co_firstlineno)
            if name is None:
                return
            if (path, name) not in entered:
                entered.add((path, name))
                record.order.append((path, name))
                record.walk += ([stack[-1][1]] if stack else []) + [path]
            stack.append((frame, path, name))
            chain = [s for i, s in enumerate(stack) if i == 0 or s[1:] != stack[i - 1][1:]]
            if len(chain) - 1 > record.max_depth:
                record.max_depth, record.deepest = len(chain) - 1, [f"{p}:{n}" for _, p, n in chain]
        elif event == "return" and stack and stack[-1][0] is frame:
            stack.pop()

    sys.setprofile(profile)
    try:
        result = fn(*args, **kwargs)
    finally:
        sys.setprofile(None)
    return result, record


# ----------------------------------------------------------------------------- the two traces


def read_page(path: str) -> str:
    return read(path).replace("\n", " ")


@pytest.fixture(scope="module")
def step_trace(artifacts, tmp_path_factory, one_thread):
    """One default step, traced: the plan (what the config decides once; train.py makes it before the first
    step), then train_step on a fresh run. The records the step is handed (the plan and the run, not the config's
    schema) count as read."""
    cfg = load_config(None, tiny_overrides(artifacts, str(tmp_path_factory.mktemp("reading")), "trainer.logger=none"))
    accelerator = Accelerator(cpu=True)
    run, timer = rlhf.setup.setup(cfg, accelerator), Timer()

    def one_step():
        plan = step.plan_step(cfg, accelerator.mixed_precision)
        return step.train_step(cfg, plan, accelerator, run, 1, timer)

    result, record = trace(one_step)
    assert "kl/full" in result.metrics  # the default path: the KL panel on
    record.classes |= {("rlhf/step.py", "Plan"), ("rlhf/setup.py", "Setup")}
    return record


@pytest.fixture(scope="module")
def ppo_trace(artifacts, one_thread):
    """ppo.py's program for one step of 8 problems (its evaluation before and after included), traced."""
    args = ppo.Args(total_steps=1, batch_size=8, max_response_length=16, mini_batch_size=4)
    return trace(ppo.main, args, artifacts)[1]


def ppo_count(record: Trace) -> tuple[int, int]:
    """(lines, files) of ppo.py read whole (its non-blank lines) and what runs of the package beside it (not
    rlhf/embedded.py, which builds the test bed: not the algorithm)."""
    lines = record.lines()
    lines.pop("rlhf/embedded.py", None)
    lines["ppo.py"] = {n for n, text in enumerate(read("ppo.py").splitlines(), 1) if text.strip()}
    return sum(map(len, lines.values())), len(lines)


def test_the_trace_is_the_default_path(step_trace):
    """What the count stands on: the fast decoder, the exact KL, the reward's rule, GAE, the losses and the KL
    panel ran; the reference decoding loop (for models the fast one does not take) did not."""
    ran = set(step_trace.order)
    for expected in [("rlhf/decode.py", "decode"), ("rlhf/kl/exact.py", "full_kl"),
                     ("rlhf/rewards/gsm8k.py", "compute_score"), ("rlhf/core_algos.py", "compute_gae"),
                     ("rlhf/core_algos.py", "policy_loss"), ("rlhf/core_algos.py", "value_loss"),
                     ("rlhf/kl/estimators.py", "kl_panel")]:
        assert expected in ran, expected
    assert ("rlhf/decode.py", "reference_decode") not in ran
    assert ("rlhf/rollout.py", "Sequences") in step_trace.classes  # a record built: its fields are read


def rows() -> list[tuple[int, str, int, int, int]]:
    """(number, file, first line, last line, the lines the page states) of each row of the table."""
    found = []
    for number, path, start, end, stated in ROW.findall(read("docs/reading.md")):
        functions, bodies, constants, _ = spans(path)
        named = {**{name: (node.lineno, node.end_lineno) for name, node in constants.items()}, **functions,
                 **{name: (min(lines), max(lines | {functions[m][1] for m in functions if m.startswith(name + ".")}))
                    for name, lines in bodies.items()}}  # a class: from its first line to its last method's end
        first = 1 if start == "the top" else named[start.strip("`")][0]
        last = len(read(path).splitlines()) if end == "the end" else named[end.strip("`")][1]
        found.append((int(number), path, first, last, int(stated.replace(",", ""))))
    return found


def test_each_rows_count_is_the_traced_lines_in_it_and_every_traced_line_is_in_a_row(step_trace):
    traced, counted = step_trace.lines(), rows()
    assert [number for number, *_ in counted] == list(range(1, len(counted) + 1)) and len(counted) >= 10
    wrong = [f"row {n} ({path}): {len({x for x in traced.get(path, ()) if first <= x <= last})}, not {stated}"
             for n, path, first, last, stated in counted
             if len({x for x in traced.get(path, ()) if first <= x <= last}) != stated]
    assert not wrong, f"docs/reading.md's counts: {wrong}"
    outside = {path: sorted(x for x in lines if not any(p == path and f <= x <= l for _, p, f, l, _ in counted))
               for path, lines in traced.items()}
    assert not any(outside.values()), f"traced lines in no row: { {p: x for p, x in outside.items() if x} }"
    assert sum(stated for *_, stated in counted) == step_trace.count()[0]  # no line in two rows


def test_the_page_and_the_readme_quote_the_trace(step_trace):
    lines, files, switches, depth = step_trace.count()
    page = read_page("docs/reading.md")
    assert f"**{lines:,} lines in {files} files**" in page, f"docs/reading.md: **{lines:,} lines in {files} files**"
    assert f"switches files {switches} times" in page, f"docs/reading.md: switches files {switches} times"
    assert f"at most {depth} calls deep" in page, f"docs/reading.md: at most {depth} calls deep"
    assert f"one step of the trainer in {lines:,} lines" in read_page("README.md"), f"README: {lines:,} lines"


def test_the_one_files_count_with_what_it_runs_of_the_package(ppo_trace):
    """ppo.py and what runs of the package under its loop, as docs/reading.md and the README quote it."""
    lines, files = ppo_count(ppo_trace)
    assert files >= 4 and ("rlhf/rewards/gsm8k.py", "compute_score") in ppo_trace.order
    for page in ("docs/reading.md", "README.md"):
        quoted = re.search(r"with what it runs of the package,? ([\d,]+) lines", read_page(page), re.I)
        assert quoted and quoted.group(1) == f"{lines:,}", (page, lines)


def test_ppo_py_is_about_300_lines_as_the_pages_say():
    length = len(read("ppo.py").splitlines())
    assert length <= 300
    for page in ("docs/reading.md", "README.md"):
        quoted = re.findall(r"ppo\.py\S* (\d[\d,]*) lines", read_page(page))
        assert quoted and all(q == str(length) for q in quoted), (page, quoted, length)
