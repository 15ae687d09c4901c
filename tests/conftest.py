"""Shared pytest fixtures for skafa's tests."""

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _cores():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def pytest_configure(config):
    """Pin ``dtype="auto"`` to float32; share the cores among pytest-xdist workers.

    Each worker is a process with its own torch thread pool, which by default
    takes every core: two workers on two cores would run four spinning OpenMP
    threads, and a tiny model's many small parallel regions then wait for
    descheduled threads. Each worker gets
    ``cores // workers`` threads (at least one), and so do the processes it
    starts (Dask workers, subprocess tests) through ``OMP_NUM_THREADS``, unless the
    caller set it. A run without workers is left as it is.
    """
    # dtype="auto" means bfloat16 on a CPU with bfloat16 units (AMX, AVX512-BF16): the
    # tests' expectations (float32 references, cache keys, exact equalities) must not
    # change with the machine, so "auto" is float32 here and in every process a test
    # starts; tests of the rule itself fake the CPU (tests/llm/test_dtype.py).
    os.environ.setdefault("SKAFA_CPU_BF16", "0")
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not workers:
        return
    threads = max(1, _cores() // max(1, int(workers)))
    given = os.environ.get("OMP_NUM_THREADS", "")
    if given.isdigit() and int(given) > 0:
        threads = int(given)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)


def who_and_when_location() -> Path:
    """``$SKAFA_WHO_AND_WHEN`` when set, else ``<repo>/../shared/data/who_and_when``."""
    env = os.environ.get("SKAFA_WHO_AND_WHEN")
    return Path(env).expanduser() if env else REPO.parent / "shared" / "data" / "who_and_when"


@pytest.fixture(scope="session")
def who_and_when_dir() -> Path:
    """Folder of the Who&When data (``Algorithm-Generated/``, ``Hand-Crafted/``).

    Skips the test when the folder is absent: the data are never copied into the
    repository.
    """
    path = who_and_when_location()
    if not path.is_dir():
        pytest.skip(
            f"Who&When data not found at {path}; set SKAFA_WHO_AND_WHEN to a folder "
            "holding Algorithm-Generated/ and Hand-Crafted/ (or run "
            "skafa.datasets.fetch_who_and_when())."
        )
    return path


@pytest.fixture(scope="session")
def benchmarks_md_table():
    """``table(marker) -> (header, rows)``: the Markdown table of a study page
    (docs/benchmarks/*.md, one page per study of the benchmarks) between
    ``<!-- marker -->`` and ``<!-- /marker -->``, each row a list of cells (stripped, bold
    removed), the separator line left out. Fails when the marker is missing or on two
    pages, so a table that moves out of its markers fails its test."""
    import re

    pages = sorted((REPO / "docs" / "benchmarks").glob("*.md"))

    def table(marker):
        pattern = rf"<!-- {re.escape(marker)} -->\n(.*?)<!-- /{re.escape(marker)} -->"
        hits = [m for page in pages
                for m in re.finditer(pattern, page.read_text(encoding="utf-8"), re.S)]
        assert hits, f"no table marked {marker} in docs/benchmarks/*.md"
        assert len(hits) == 1, f"{len(hits)} tables marked {marker} in docs/benchmarks/*.md"
        found = hits[0]
        lines = [ln for ln in found.group(1).splitlines() if ln.startswith("|")]
        cells = [[c.strip().replace("**", "") for c in ln.strip().strip("|").split("|")]
                 for ln in lines]
        return cells[0], cells[2:]

    return table
