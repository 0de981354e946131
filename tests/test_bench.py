"""bench/common.py's process-per-side rounds (each side in a fresh process of its own, stepped in turn, the order
rotating), and bench/ppo_step.py and bench/grpo_step.py run in both modes, saying which made the numbers.

The two whole-benchmark tests need TRL (the bench extras) and are marked `bench`: run them in the benchmark's
environment with `python -m pytest -q -m bench tests/test_bench.py`."""

import os
import subprocess
import sys

import pytest
from helpers import REPO

BENCH = os.path.join(REPO, "bench")

# A side whose step burns about 50 ms of CPU in its own process and says where and when it ran.
SIDE_SCRIPT = """
import os, sys, time
from common import serve_side

class Side:
    def __init__(self):
        self.calls = 0

    def step(self):
        self.calls += 1
        start = time.process_time()
        while time.process_time() - start < 0.05:
            pass
        print("a library's print, not an answer")
        return {"step": 0.05, "pid": os.getpid(), "calls": self.calls, "at": time.monotonic()}

key = sys.argv[sys.argv.index("--side-child") + 1]
if key == "broken":
    raise SystemExit("this side cannot be built")
serve_side(Side(), {"name": f"side {key}", "pid": os.getpid()})
"""


@pytest.fixture
def common(monkeypatch):
    """bench/common.py, imported as the benchmarks import it (bench/ on the path, in the side processes too)."""
    monkeypatch.syspath_prepend(BENCH)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([BENCH, REPO, os.environ.get("PYTHONPATH", "")]))
    import common

    return common


def test_each_side_steps_in_its_own_process_in_rotating_order(common, tmp_path):
    script = tmp_path / "side.py"
    script.write_text(SIDE_SCRIPT)
    keys = ["a", "b", "c"]
    with common.side_processes(str(script), keys, str(tmp_path), None, False) as sides:
        pids = {key: side.about["pid"] for key, side in sides}
        assert [side.name for _, side in sides] == ["side a", "side b", "side c"]
        times = common.interleaved_rounds(sides, warmup=1, iters=4)
    assert len(set(pids.values()) | {os.getpid()}) == 4  # three processes, none of them this one
    for key in keys:
        assert [t["pid"] for t in times[key]] == [pids[key]] * 4
        assert [t["calls"] for t in times[key]] == [2, 3, 4, 5]  # the same process, after one warm-up step
        assert all(t["cpu_s"] >= 0.04 for t in times[key])  # the side's CPU time, not this idle process's
    for r in range(4):  # round r starts at side r % 3
        order = sorted(keys, key=lambda k: times[k][r]["at"])
        assert order == keys[r % 3:] + keys[:r % 3]
    for _, side in sides:
        assert side.proc.returncode == 0  # closed: stdin shut, the process ended


def test_a_side_that_fails_to_start_shows_its_error(common, tmp_path):
    script = tmp_path / "side.py"
    script.write_text(SIDE_SCRIPT)
    with pytest.raises(RuntimeError, match="(?s)side broken stopped:.*this side cannot be built"):
        with common.side_processes(str(script), ["a", "broken"], str(tmp_path), None, False):
            pass


def run_bench(script: str, *flags: str) -> str:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, os.path.join(BENCH, script), "--iters", "1", "--warmup", "0",
                          "--skip-memory", *flags], capture_output=True, text=True, env=env, cwd=REPO, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.bench
@pytest.mark.parametrize("script,rows", [
    ("ppo_step.py", ["TRL PPOTrainer", "ours train_step", "ours, panel off", "ours, panel off, no pass", "floor"]),
    ("grpo_step.py", ["TRL GRPOTrainer", "ours grpo", "ours grpo, old-log-prob pass", "ours grpo, KL panel on",
                      "ours gae", "floor"]),
])
@pytest.mark.parametrize("shared", [False, True])
def test_the_benchmark_reports_its_mode_and_openmp_settings(script, rows, shared):
    out = run_bench(script, *(["--shared-process"] if shared else []))
    lines = out.splitlines()
    mode = "mode: shared process" if shared else "mode: one fresh process per side"
    assert [line for line in lines if line.startswith("mode: ")][0].startswith(mode)  # (TRL may print first)
    assert "torch threads 1, OMP_NUM_THREADS=1, OMP_WAIT_POLICY=PASSIVE (the environment's, as seen)" in out
    assert ("all sides in one process" if shared else "each side in its own process") in out
    assert "load average" in out and "at the start of the rounds" in out
    for row in rows:
        assert any(line.strip().startswith(row) and line.rstrip().endswith(")") for line in lines), row
    assert lines[-1].endswith(f"mode={'shared-process' if shared else 'process-per-side'}"), lines[-1]
