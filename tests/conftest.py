from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
# CI lays shared/ beside the checkout; a developer's worktree has it there too.
SHARED = REPO.parent / "shared"
CORPUS = SHARED / "corpus"
FIXTURES = REPO / "fixtures"
# Recorded nodes whose GPU stack does not answer (issue 27: no NVML, no nvidia-smi; or no GPU
# at all): the agent says what it cannot see and gives no placement, gres.conf or NCCL file.
# Tests of what a working stack gives leave them out; tests/test_witnesses.py covers them.
WITHOUT_GPU_STACK = frozenset({"no-gpu-stack", "no-nvidia-driver", "no-gpus"})
# Recorded nodes whose NVLink fabric is down or not yet up (issue 27): NVSwitches and not one
# active NVLink, or NVML's fabric registration not completed.  Their GPU stack answers, but
# they are not ready for placement either: no placement, gres.conf or NCCL file.
FABRIC_DOWN = frozenset({"no-fabric-manager", "fabric-not-started", "fabric-in-progress"})
# The recorded nodes GET /readyz calls not ready for placement: tests of placement answers
# and of the files that state every link leave them out.
NOT_READY = WITHOUT_GPU_STACK | FABRIC_DOWN
# Recorded nodes that are real, recorded by `topoagent snapshot` on the hardware and copied
# as recorded (fixtures/build_snapshots.py RECORDED): tests of what the generator writes into
# every generated node (its two counter samples 10 s apart, an RDMA NIC on each) leave them out.
REAL_NODES = frozenset({"h200-vm"})
# The suite checks this checkout, in process and in the commands it starts (they run
# `python -P -m topoagent`, which ignores the working directory but not PYTHONPATH), so
# a change is tested without reinstalling; tests/test_packaging.py checks the install.
sys.path[:0] = [str(TESTS), str(REPO)]
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))

import nvml_stub as nvml_stub_module  # noqa: E402 (needs TESTS on sys.path)


@pytest.fixture(autouse=True)
def topoagent_logger_as_found() -> Iterator[None]:
    """In-process commands configure the `topoagent` logger (a handler, a level, no
    propagation); put it back, or a later test's caplog sees nothing, depending on
    which tests a worker ran before it."""
    log = logging.getLogger("topoagent")
    handlers, level, propagate = log.handlers[:], log.level, log.propagate
    yield
    log.handlers[:], log.level, log.propagate = handlers, level, propagate


@pytest.fixture(scope="session")
def corpus() -> Path:
    if not CORPUS.is_dir():
        pytest.fail(f"shared corpus not found at {CORPUS}: the tests need ../shared beside the repo")
    return CORPUS


# The files that take longest (the image build, real daemons, many agents) go to the workers
# first: with whole files per worker (scripts/test: --dist loadfile), one started last would
# leave the other worker idle for minutes at the end.
SLOW_FIRST = ("test_image.py", "test_device_plugin.py", "test_page_live.py", "test_lease_integrity.py",
              "test_golden_outputs.py", "test_extender.py", "test_examples.py", "test_slurm_jobs.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FIRST)))  # stable: the rest keep their order


@pytest.fixture
def nvml_stub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[nvml_stub_module.StubNode]:
    """The suite's NVML in this process: the stub libnvidia-ml.so.1 (tests/nvml_stub.py)
    preloaded for the real pynvml, serving a node file in tmp_path (empty until the test
    calls ``serve``/``serve_recording``); its variables set for child processes too.
    NVML is shut down afterwards, so the next test's init reads its own file."""
    nvml_stub_module.preload()
    nvml_stub_module.check_pynvml_loads_stub()
    node = nvml_stub_module.StubNode(tmp_path / "nvml-stub")
    for key, value in node.env().items():
        monkeypatch.setenv(key, value)
    yield node
    nvml_stub_module.shutdown_all()


@pytest.fixture(params=sorted(set(nvml_stub_module.admitted_versions())), ids=lambda v: f"nvidia-ml-py-{v}")
def nvml_binding(request: pytest.FixtureRequest) -> nvml_stub_module.Binding:
    """Each nvidia-ml-py the project admits (pyproject's lower bound, the installed one: one
    version while they are the same), as a
    PYTHONPATH directory for a child process: ``env={**os.environ, **nvml_binding.env()}``."""
    return nvml_stub_module.binding(request.param)
