"""notebooks/kl_walkthrough.ipynb: stored with the outputs of its current cells, and runs end to end in a real
Jupyter kernel."""

import glob
import importlib.util
import json
import os
import re
import time

import nbformat
import pytest

from rlhf.tracking import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "notebooks", "kl_walkthrough.ipynb")
CURVES = os.path.join(ROOT, "docs", "kl_binding_curves.json")  # shipped; the notebook plots it when present
MAX_BYTES = 1_500_000
_spec = importlib.util.spec_from_file_location("execute", os.path.join(ROOT, "notebooks", "execute.py"))
execute = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(execute)
RERUN = "store the notebook again with `python notebooks/execute.py`"


def code_cells(nb):
    return [c for c in nb.cells if c.cell_type == "code"]


def outputs(nb):
    return [o for c in code_cells(nb) for o in c.outputs]


def test_stored_outputs_are_those_of_the_current_cells():
    """Every code cell ran, in order, from the source stored with it (its hash in the cell's metadata), without
    an error or stray stderr; the file stays small enough for a code host to render."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = code_cells(nb)
    changed = [i for i, c in enumerate(code, 1) if c.metadata.get(execute.HASH_KEY) != execute.source_sha256(c.source)]
    assert not changed, f"code cells {changed} (1-based) were edited after their outputs were stored: {RERUN}"
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), f"not run in order, once: {RERUN}"
    assert not [o for o in outputs(nb) if o.output_type == "error"]
    assert not [o.text[:200] for o in outputs(nb) if o.output_type == "stream" and o.name == "stderr"]
    text = json.dumps([o for o in outputs(nb)])
    assert "outputs/notebook/" in text and "RLHF_NOTEBOOK_SMOKE" not in text  # the full setting, in its own folder
    assert len([o for o in outputs(nb) if "image/png" in o.get("data", {})]) >= 6
    assert os.path.getsize(NOTEBOOK) < MAX_BYTES


def test_first_cell_states_the_measured_time():
    """The first cell's 'about N minutes' is the stored run's time (the cells' own timestamps), within 20%."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    minutes = sum(execute.cell_seconds(c) for c in code_cells(nb)) / 60
    stated = re.search(r"about (\d+) minutes?", nb.cells[0].source)
    assert stated, "the first cell says how long the notebook takes: 'about N minutes ...'"
    assert abs(int(stated.group(1)) - minutes) <= max(1.0, 0.2 * minutes), (stated.group(0), f"{minutes:.1f} measured")


def test_reader_text_speaks_of_the_project():
    """No test-suite talk in the prose or the outputs, and the GPU command as docs/gpu.md gives it."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown") + json.dumps(outputs(nb))
    assert not re.search(r"(?<!% )\bCI\b", text)  # "95% CI" in a report's table is a confidence interval
    for word in ("RLHF_NOTEBOOK_SMOKE", "pytest", "--mixed_precision", "wandb sweep"):  # the sweep: docs/comparison.md
        assert word not in text, word
    assert "accelerate launch train.py --config configs/gsm8k_qwen2.5_0.5b.yaml" in text


def test_notebook_imports_rlhf_instead_of_copying_it():
    source = "\n".join(c.source for c in nbformat.read(NOTEBOOK, as_version=4).cells if c.cell_type == "code")
    for use in ("from lab import compare, theory", "from rlhf import kl", "kl.kl_penalty(", "theory.expected_loss_grad",
                "kl.full_kl(", "compare.main(", "AutoModelForCausalLM.from_pretrained(", "evaluate_models(",
                "kl_binding_curves.json"):
        assert use in source, use
    assert "def kl_penalty" not in source and "def expected_loss_grad" not in source


@pytest.mark.slow  # ~45 s: a kernel, four train.py runs and an evaluation; python -m pytest -q -m slow
def test_notebook_runs_end_to_end(tmp_path):
    """Every cell, in order, through a python3 kernel of this interpreter (notebooks/execute.py), every run on
    the much smaller setting RLHF_NOTEBOOK_SMOKE=<dir> selects."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    start = time.perf_counter()
    # raises CellExecutionError (with the traceback) if any cell fails
    execute.execute(nb, os.path.dirname(NOTEBOOK), {"RLHF_NOTEBOOK_SMOKE": str(tmp_path / "runs")})
    print(f"notebook executed in {time.perf_counter() - start:.0f}s")

    assert not [o for o in outputs(nb) if o.output_type == "error"]
    images = [o for o in outputs(nb) if "image/png" in o.get("data", {})]
    # estimator shapes, gradient bars, the bandit's landing and its report's figure, the KL panel, the runner's
    # report, and the binding regime's curves where docs/kl_binding_curves.json is
    assert len(images) == 6 + os.path.exists(CURVES)
    text = json.dumps([o.get("data", {}).get("text/markdown", "") for o in outputs(nb)])
    assert "Schulman (2020)" in text and "k3 without clamp" in text  # section 1's table was shown
    assert "corrected: max error" in text and "| k3+ | detached | +0.965 |" in text  # the off-policy table
    assert "Where the trainer lands: the bandit" in text  # the landing report, of the notebook's own two runs
    assert "model - baseline [95% interval, paired by problem]" in text and "| val/accuracy |" in text  # section 5
    runs = tmp_path / "runs"
    assert sorted(os.listdir(runs / "landing" / "rloo")) == ["loss-k3", "loss-k3+"]
    for run in ("reward-k1", "loss-k3+"):  # section 3 trained both runs, logged the KL panel, exported its model
        rows = read_metrics(runs / "ppo" / run / "metrics.jsonl")
        assert all(f"kl/{k}" in rows[-1] for k in ("k1", "k2", "k3", "abs", "full"))
        assert (runs / "ppo" / run / "model" / "config.json").exists()
    assert glob.glob(str(runs / "ppo" / "*" / "wandb" / "offline-run-*"))  # section 3 lists these
    printed = "".join(o.get("text", "") for o in outputs(nb) if o.output_type == "stream")
    assert "answer:" in printed and "reference:" in printed  # section 5 sampled an answer
