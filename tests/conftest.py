"""Shared fixtures: the tiny embedded model and data (see helpers.py), single-threaded runs."""

import pytest
import torch
from helpers import TINY_EMBEDDED

from rlhf.embedded import prepare_embedded_default


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory):
    """The tiny warm-started model and GSM8K-schema JSONL files, written once per test session."""
    return prepare_embedded_default(str(tmp_path_factory.getbasetemp() / "tiny-embedded"), TINY_EMBEDDED,
                                    log=lambda *a: None)


@pytest.fixture(scope="module")
def one_thread():
    """Single-threaded like the subprocesses (OMP_NUM_THREADS=1), so in- and out-of-process runs agree exactly;
    on a shared 2-core machine it is also several times faster."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: tests of 15 s and more (a real model, the notebook's kernel, FSDP "
                                       "launches); run only when selected with -m (python -m pytest -q -m slow)")


    config.addinivalue_line("markers", "cuda: tests that need a CUDA device (tests/test_cuda.py); run only when "
                                       "selected with -m cuda, as bench/gpu_check.py does on a GPU machine")
    config.addinivalue_line("markers", "bench: tests that run a benchmark against TRL (the bench extras' "
                                       "environments); run only when selected with -m bench")


def pytest_collection_modifyitems(config, items):
    """Tests marked `slow`, `cuda` or `bench` run only when a -m expression names their marker (`-m slow`, `-m cuda`);
    otherwise they are deselected (reported as such, not skipped), so `python -m pytest -q` stays fast and runs
    on a machine without a GPU."""
    for marker in ("slow", "cuda", "bench"):
        if marker in (config.getoption("markexpr") or ""):
            continue
        marked = [item for item in items if item.get_closest_marker(marker)]
        if marked:
            config.hook.pytest_deselected(items=marked)
            items[:] = [item for item in items if not item.get_closest_marker(marker)]
