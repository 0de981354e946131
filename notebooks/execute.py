"""Execute notebooks/kl_walkthrough.ipynb in a Jupyter kernel and store it with its outputs, so that a code host
(GitHub) shows its tables and figures.

    python notebooks/execute.py                    # from anywhere; rewrites the notebook in place
    python notebooks/execute.py --output other.ipynb

It runs every cell in order with nbclient, in a python3 kernel of this interpreter (no `ipykernel install`
needed), the way tests/test_notebook.py does, and writes the notebook with its outputs: figures as PNG, text,
tables. Each code cell's metadata gets `source_sha256`, the SHA-256 of the source it ran, so that
tests/test_notebook.py can tell when a cell was edited after its outputs were stored. The kernel runs with
progress bars off and wandb offline, so that the stored outputs hold no progress bars and nothing is uploaded. A cell
that fails stops it, and the notebook is left as it was. It prints the time the cells took, in all and per
section: the notebook's first cell states it.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time

NOTEBOOK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kl_walkthrough.ipynb")
HASH_KEY = "source_sha256"  # in each code cell's metadata: the source its outputs came from
KERNEL_ENV = {
    "MPLBACKEND": "module://matplotlib_inline.backend_inline",  # figures as PNG outputs
    "WANDB_MODE": "offline",  # the runs' wandb copies stay under their output directories
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # transformers' "Loading weights" bars
}
# Run by the kernel before the first cell (an IPython startup file): tqdm's bars off, even where the code passes
# disable=False (rlhf.held_out's), and without tqdm.auto's warning that ipywidgets is not installed.
QUIET_TQDM = """\
import warnings

import tqdm

warnings.filterwarnings("ignore", category=tqdm.TqdmWarning)
import tqdm.auto


class QuietTqdm(tqdm.tqdm):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**kwargs, "disable": True})


tqdm.auto.tqdm = QuietTqdm
"""


def source_sha256(source: str) -> str:
    """The SHA-256 of a cell's source text, as hex."""
    return hashlib.sha256(source.encode("utf-8")).hexdigest()


def cell_seconds(cell) -> float:
    """How long a code cell ran, from the timestamps nbclient records in its metadata (0 if there are none)."""
    from datetime import datetime

    times = cell.metadata.get("execution", {})
    start, end = times.get("iopub.execute_input"), times.get("shell.execute_reply")
    if not (start and end):
        return 0.0
    return (datetime.fromisoformat(end.replace("Z", "+00:00")) -
            datetime.fromisoformat(start.replace("Z", "+00:00"))).total_seconds()


def section_seconds(nb) -> dict[str, float]:
    """{heading of each '## ' section (or the opening cells'): seconds its code cells ran}."""
    sections, current = {}, "(setup)"
    for cell in nb.cells:
        if cell.cell_type == "markdown" and cell.source.startswith("## "):
            current = cell.source.splitlines()[0][3:]
        elif cell.cell_type == "code":
            sections[current] = sections.get(current, 0.0) + cell_seconds(cell)
    return sections


def execute(nb, directory: str = os.path.dirname(NOTEBOOK), extra_env: dict[str, str] | None = None,
            timeout: int = 1800) -> None:
    """Run every cell of the notebook `nb` in order, in a fresh kernel started in `directory` with KERNEL_ENV and
    `extra_env`, and stamp each code cell with its source's hash (in place; raises CellExecutionError, with the
    traceback, if a cell fails)."""
    from ipykernel.kernelspec import write_kernel_spec
    from nbclient import NotebookClient

    env = {key: value for key, value in os.environ.items() if key != "RLHF_NOTEBOOK_SMOKE"}  # the full setting
    with tempfile.TemporaryDirectory() as jupyter:
        # A kernelspec for this very interpreter, found first via JUPYTER_PATH (read by this process).
        write_kernel_spec(os.path.join(jupyter, "kernels", "python3"))
        startup = os.path.join(jupyter, "ipython", "profile_default", "startup")
        os.makedirs(startup)
        with open(os.path.join(startup, "00-quiet-tqdm.py"), "w") as f:
            f.write(QUIET_TQDM)
        env.update(KERNEL_ENV, **(extra_env or {}), JUPYTER_PATH=jupyter, IPYTHONDIR=os.path.join(jupyter, "ipython"))
        previous = os.environ.get("JUPYTER_PATH")
        os.environ["JUPYTER_PATH"] = jupyter
        try:
            client = NotebookClient(nb, kernel_name="python3", timeout=timeout,
                                    resources={"metadata": {"path": directory}})
            client.execute(env=env)  # the kernel's environment
        finally:
            if previous is None:
                del os.environ["JUPYTER_PATH"]
            else:
                os.environ["JUPYTER_PATH"] = previous
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.metadata[HASH_KEY] = source_sha256(cell.source)


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring)."""
    import nbformat

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--notebook", default=NOTEBOOK, help="the notebook to run (default: %(default)s)")
    parser.add_argument("--output", default=None, help="where to write it (default: in place)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    nb = nbformat.read(args.notebook, as_version=4)
    execute(nb, os.path.dirname(os.path.abspath(args.notebook)))
    wall = time.perf_counter() - start
    output = args.output or args.notebook
    nbformat.write(nb, output)
    print(f"executed in {wall:.0f} s wall (kernel start included); wrote {output} ({os.path.getsize(output) / 1e6:.2f} MB)")
    cells = sum(cell_seconds(c) for c in nb.cells if c.cell_type == "code")
    print(f"the cells took {cells:.0f} s = {cells / 60:.1f} minutes:")
    for section, seconds in section_seconds(nb).items():
        print(f"  {seconds:6.0f} s  {section}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
