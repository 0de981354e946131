"""The two layers: the trainer (train.py, ppo.py and rlhf/) never imports the lab (lab/), not even inside a
function; the imports of the whole house (train.py, ppo.py, rlhf/, lab/) form no circle; and the trainer
stands at most 10 layers tall (each module above all it imports; imports under `if TYPE_CHECKING:` are for
annotations and never run)."""

import ast
import glob
import os
import subprocess
import sys

from helpers import REPO, embedded_overrides, tiny_overrides

MAX_LAYERS = 10


def module_name(path: str) -> str:
    rel = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
    return rel.removesuffix(".__init__")


def source_files() -> dict[str, str]:
    files = [os.path.join(REPO, "train.py"), os.path.join(REPO, "ppo.py"),
             *glob.glob(f"{REPO}/rlhf/**/*.py", recursive=True),
             *glob.glob(f"{REPO}/lab/**/*.py", recursive=True)]
    return {module_name(path): path for path in files}


def runtime_nodes(tree: ast.AST):
    """Every node of `tree` but those under `if TYPE_CHECKING:` (imports for annotations, never run)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            continue
        yield node
        yield from runtime_nodes(node)


def imports(path: str, known: set[str]) -> set[str]:
    """The project's modules `path` imports anywhere in it (top level or inside a function)."""
    found = set()
    for node in runtime_nodes(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    files = source_files()
    known = set(files)
    return {name: imports(path, known) - {name} for name, path in files.items()}


def is_core(name: str) -> bool:
    return name in ("train", "ppo", "rlhf") or name.startswith("rlhf.")


def test_the_core_never_imports_the_lab():
    graph = import_graph()
    assert any(n.startswith("lab.") for n in graph) and "rlhf.kl.estimators" in graph  # the scan sees both
    wrong = sorted(f"{a} -> {b}" for a, targets in graph.items() if is_core(a) for b in targets if not is_core(b))
    assert not wrong, f"the trainer imports the lab: {wrong}"


def test_no_circles_and_at_most_ten_layers():
    graph = import_graph()
    layer, visiting = {}, []

    def height(name: str) -> int:
        if name in layer:
            return layer[name]
        assert name not in visiting, f"import circle: {' -> '.join(visiting[visiting.index(name):] + [name])}"
        visiting.append(name)
        layer[name] = 1 + max((height(t) for t in graph[name]), default=0)
        visiting.pop()
        return layer[name]

    for name in graph:
        height(name)
    tallest = max((n for n in graph if is_core(n)), key=height)
    assert layer[tallest] <= MAX_LAYERS, f"{tallest} stands on {layer[tallest]} layers"


def test_an_import_graph_with_a_circle_is_caught(monkeypatch):
    """The circle check above would notice one (a two-module circle, made up)."""
    import pytest

    graph = {"a": {"b"}, "b": {"a"}}
    monkeypatch.setattr(sys.modules[__name__], "import_graph", lambda: graph)
    with pytest.raises(AssertionError, match="import circle"):
        test_no_circles_and_at_most_ten_layers()


TRAIN_AND_LIST_MODULES = """
import sys, train
from rlhf.config import load_config
train.main(load_config(None, sys.argv[1:]))
print("LAB MODULES:", sorted(m for m in sys.modules if m == "lab" or m.startswith("lab.")))
"""


def run_trainer(overrides) -> list[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", TRAIN_AND_LIST_MODULES, *overrides], capture_output=True,
                         text=True, cwd=REPO, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(line for line in out.stdout.splitlines() if line.startswith("LAB MODULES:"))
    return line.removeprefix("LAB MODULES: ")


def test_a_run_on_the_embedded_default_loads_no_lab_module(artifacts, tmp_path):
    """The embedded default built by the trainer itself (task embedded, its files and model, the session's
    cached warm start): the trainer runs two steps and evaluates, and no lab module was imported."""
    cache = os.path.dirname(os.path.dirname(artifacts.model_dir))
    overrides = tiny_overrides(artifacts, str(tmp_path / "run"), "trainer.logger=none", "model.path=embedded",
                               "data.train_files=embedded", "data.val_files=embedded", f"trainer.cache_dir={cache}",
                               *embedded_overrides())
    assert run_trainer(overrides) == "[]"


def test_a_run_on_a_gsm8k_file_loads_no_lab_module(artifacts, tmp_path):
    """Task gsm8k on local GSM8K-schema files."""
    overrides = tiny_overrides(artifacts, str(tmp_path / "run"), "trainer.logger=none", "task.name=gsm8k")
    assert run_trainer(overrides) == "[]"


def test_the_check_would_see_a_lab_module(artifacts, tmp_path, monkeypatch):
    """The same run on the lab's bandit lists the lab's modules: the probe above is not blind."""
    overrides = ["task.name=lab.tasks:bandit", "rollout.ignore_eos=true", "rollout.n=4",
                 "data.max_response_length=1", "data.max_prompt_length=1", "data.train_batch_size=4",
                 "data.val_batch_size=1", "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size=16",
                 "algorithm.adv_estimator=rloo", "algorithm.use_kl_in_reward=false",
                 "reward.function=lab.synthetic:table_reward", "trainer.total_steps=1", "trainer.test_freq=0",
                 "task.options.fit_steps=5", f"trainer.output_dir={tmp_path / 'run'}", "trainer.logger=none"]
    assert "lab.synthetic" in run_trainer(overrides)
