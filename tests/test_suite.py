"""The test suite's own set-up (tests/conftest.py): pytest-xdist workers share the cores."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CONFTEST = Path(__file__).resolve().parent / "conftest.py"

PROBE = '''
import os
from pathlib import Path

import torch


def test_threads():
    Path(__file__).with_name("threads.txt").write_text(" ".join(
        [str(os.environ.get("PYTEST_XDIST_WORKER")), str(torch.get_num_threads()),
         str(os.environ.get("OMP_NUM_THREADS"))]))
'''


def _cores():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _run(folder, *args, omp=None):
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT",
                        "PYTEST_ADDOPTS")}
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "--rootdir", str(folder), *args, str(folder)],
                         capture_output=True, text=True, env=env, cwd=folder, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return (folder / "threads.txt").read_text().split()


def test_xdist_workers_get_their_share_of_the_cores(tmp_path):
    pytest.importorskip("xdist")
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "test_probe.py").write_text(PROBE)
    share = str(max(1, _cores() // 2))
    # two workers: each gets cores // 2 threads, and so do the processes it starts
    worker, threads, omp = _run(tmp_path, "-n", "2")
    assert worker.startswith("gw") and threads == omp == share
    # a caller's OMP_NUM_THREADS is kept
    assert _run(tmp_path, "-n", "2", omp="1")[1:] == ["1", "1"]
    # without workers nothing is changed
    worker, threads, omp = _run(tmp_path)
    assert worker == omp == "None" and int(threads) >= 1
