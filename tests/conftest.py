from __future__ import annotations

import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
# CI lays shared/ beside the checkout; a developer's worktree has it there too.
SHARED = REPO.parent / "shared"
CORPUS = SHARED / "corpus"
FIXTURES = REPO / "fixtures"
sys.path.insert(0, str(TESTS))


@pytest.fixture(scope="session")
def corpus() -> Path:
    if not CORPUS.is_dir():
        pytest.fail(f"shared corpus not found at {CORPUS}: the tests need ../shared beside the repo")
    return CORPUS
