from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# CI lays shared/ beside the checkout; a developer's worktree has it there too.
SHARED = REPO.parent / "shared"
CORPUS = SHARED / "corpus"
FIXTURES = REPO / "fixtures"


@pytest.fixture(scope="session")
def corpus() -> Path:
    if not CORPUS.is_dir():
        pytest.fail(f"shared corpus not found at {CORPUS}: the tests need ../shared beside the repo")
    return CORPUS
