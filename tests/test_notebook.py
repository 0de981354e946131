"""notebooks/kl_walkthrough.ipynb: stored without outputs, and runs end to end in a real Jupyter kernel."""

import glob
import json
import os
import time

import nbformat
import pytest
from ipykernel.kernelspec import write_kernel_spec
from nbclient import NotebookClient

from rlhf.tracking import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "notebooks", "kl_walkthrough.ipynb")


def test_notebook_is_stored_with_outputs_cleared():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.outputs == [] and c.execution_count is None for c in code)


def test_notebook_imports_rlhf_instead_of_copying_it():
    source = "\n".join(c.source for c in nbformat.read(NOTEBOOK, as_version=4).cells if c.cell_type == "code")
    for use in ("from rlhf import compare, kl, theory", "kl.kl_penalty(", "theory.expected_loss_grad",
                "kl.full_kl(", "compare.main("):
        assert use in source, use
    assert "def kl_penalty" not in source and "def expected_loss_grad" not in source


@pytest.mark.slow  # ~45 s: a kernel and three train.py runs; python -m pytest -q -m slow
def test_notebook_runs_end_to_end(tmp_path, monkeypatch):
    """Every cell, in order, through a python3 kernel of this interpreter; section 3 in its small CI setting."""
    # A kernelspec for this very interpreter, found first via JUPYTER_PATH (no `ipykernel install` needed).
    write_kernel_spec(tmp_path / "jupyter" / "kernels" / "python3")
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("RLHF_NOTEBOOK_SMOKE", str(tmp_path / "runs"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")  # figures as outputs
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(nb, kernel_name="python3", timeout=600,
                            resources={"metadata": {"path": os.path.dirname(NOTEBOOK)}})
    start = time.perf_counter()
    client.execute()  # raises CellExecutionError (with the traceback) if any cell fails
    print(f"notebook executed in {time.perf_counter() - start:.0f}s")

    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    # estimator shapes, gradient bars, the bandit's landing and its report's figure, the KL panel, the runner's report
    assert len(images) == 6
    text = json.dumps([o.get("data", {}).get("text/markdown", "") for o in outputs])
    assert "Schulman (2020)" in text and "k3 without clamp" in text  # section 1's table was shown
    assert "corrected: max error" in text and "| k3+ | detached | +0.965 |" in text  # the off-policy table
    assert "Where the trainer lands: the bandit" in text  # the landing report, from the smoke's own two runs
    for run in ("reward-k1", "loss-k3+"):  # section 3 trained both runs and logged the KL panel
        rows = read_metrics(tmp_path / "runs" / run / "metrics.jsonl")
        assert all(f"kl/{k}" in rows[-1] for k in ("k1", "k2", "k3", "abs", "full"))
    assert glob.glob(str(tmp_path / "runs" / "*" / "wandb" / "offline-run-*"))  # section 4 lists these
