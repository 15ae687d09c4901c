"""Shared pytest fixtures for skafa's tests."""

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


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
