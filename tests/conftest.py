import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
SHARED = REPO.parent / "shared"
sys.path.insert(0, str(TESTS))
