"""The installed distribution holds every package of the source tree."""

from __future__ import annotations

import tomllib

import pytest
from conftest import REPO

FOLDERS = {"topoagent": "topoagent", "collectors": "topoagent.collectors",
           "probes": "topoagent.probes", "exporters": "topoagent.exporters"}


def test_every_source_package_is_installed():
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    for folder in FOLDERS:
        if folder != "topoagent":  # reached through topoagent/<folder> -> ../<folder>
            link = REPO / "topoagent" / folder
            assert link.is_symlink() and link.resolve() == (REPO / folder).resolve()
    found = set()
    for folder, namespace in FOLDERS.items():
        for init in (REPO / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(REPO / folder).parts
            found.add(".".join((namespace, *relative)))
    assert found == listed, "add new packages to [tool.setuptools] packages in pyproject.toml"


def test_a_checkout_imports_as_laid_out():
    """From the checkout root, with no install: the package, its command and a collector."""
    import subprocess
    import sys

    env = {"PATH": "/usr/bin:/bin"}  # no PYTHONPATH: only the working directory
    probe = "import topoagent, topoagent.collectors.pci as m; print(topoagent.__file__, m.__file__)"
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    for path in done.stdout.split():
        assert path.startswith(str(REPO)), done.stdout
    version = subprocess.run([sys.executable, "-m", "topoagent", "--version"], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=60)
    assert version.returncode == 0 and version.stdout.startswith("topoagent "), version.stderr


def test_version_matches_the_installed_distribution():
    import subprocess
    import sys
    from importlib.metadata import version

    proc = subprocess.run([sys.executable, "-P", "-m", "topoagent", "--version"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    assert proc.stdout == f"topoagent {version('topoagent')}\n"
    with open(REPO / "pyproject.toml", "rb") as handle:
        assert version("topoagent") == tomllib.load(handle)["project"]["version"]


# --- the built wheel, installed in a fresh venv, deploys a node --------------------------

WHEEL_SOURCES = ["pyproject.toml", "README.md", "LICENSE", "topoagent", "collectors", "probes", "exporters", "systemd"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    return build_wheel(tmp_path_factory.mktemp("wheel"))


def build_wheel(tmp_path):
    """`pip wheel` of a copy of the tree (the build leaves build/ and *.egg-info beside the
    sources), offline: no build isolation, the test venv's setuptools does the build."""
    import shutil
    import subprocess
    import sys

    source = tmp_path / "source"
    source.mkdir()
    for name in WHEEL_SOURCES:
        path = REPO / name
        if path.is_dir() and not path.is_symlink():
            shutil.copytree(path, source / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(path, source / name, follow_symlinks=False)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "-q", "-w", str(tmp_path / "dist"), str(source)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    (wheel,) = (tmp_path / "dist").glob("topoagent-*.whl")
    return wheel


def test_the_wheel_carries_licence_types_deployment_files_and_honest_metadata(wheel):
    import zipfile
    from email.parser import Parser

    wheel = zipfile.ZipFile(wheel)
    names = set(wheel.namelist())
    assert {"topoagent/py.typed", "topoagent/data/topoagent.service", "topoagent/data/topoagent.toml",
            "topoagent/data/grafana-dashboard.json", "topoagent/data/topoagent-alerts.yml", "topoagent/collectors/pci.py", "topoagent/exporters/nfd.py"} <= names
    (license_file,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
    assert b"Apache License" in wheel.read(license_file) and b"Version 2.0, January 2004" in wheel.read(license_file)
    (metadata_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
    metadata = Parser().parsestr(wheel.read(metadata_name).decode())
    assert metadata["Metadata-Version"] >= "2.4" and metadata["License-Expression"] == "Apache-2.0"
    assert metadata["License-File"] == "LICENSE"
    requires = metadata.get_all("Requires-Dist")
    assert {r for r in requires if "extra ==" not in r} == {
        "aiohttp>=3.9", "prometheus-client>=0.14", "nvidia-ml-py>=13.615.71", "pyudev>=0.16"}
    assert 'torch<3,>=2.1; extra == "probes"' in requires
    assert "Typing :: Typed" in metadata.get_all("Classifier")
    assert any(url.startswith("Homepage, ") for url in metadata.get_all("Project-URL"))


def test_the_wheel_publishes_extras_only_for_what_it_ships(wheel):
    """An extra is a promise to users of the wheel: torch for its probe worker, gRPC and the
    Kubernetes client for its device plugin and extender.  Test and benchmark tools serve
    tests/ and bench/, which the wheel does not carry: they are requirements files."""
    import zipfile
    from email.parser import Parser

    wheel = zipfile.ZipFile(wheel)
    (metadata_name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    metadata = Parser().parsestr(wheel.read(metadata_name).decode())
    assert sorted(metadata.get_all("Provides-Extra")) == ["kubernetes", "probes"]
    assert not any(n.startswith(("tests/", "bench/")) for n in wheel.namelist())
    required = " ".join(metadata.get_all("Requires-Dist"))
    for tool in ("pytest", "hypothesis", "ruff", "mypy", "psutil", "trustme", "kubernetes-validate"):
        assert tool not in required, tool
    # ...and scripts/test installs them from the file that lists them.
    script = (REPO / "scripts" / "test").read_text()
    assert "-r requirements/test.txt" in script and "'torch==2.13.0'" in script
    listed = {line.split("#")[0].strip() for line in (REPO / "requirements" / "test.txt").read_text().splitlines()} - {""}
    assert {"pytest", "hypothesis", "ruff", "mypy", "kubernetes-validate", "trustme", "grpcio-tools"} <= listed
    assert "psutil>=5.6" in (REPO / "requirements" / "bench.txt").read_text().split()


def test_the_wheel_installed_in_a_fresh_venv_serves_a_recorded_node_and_installs_its_files(wheel, tmp_path):
    import http.client
    import json
    import os
    import signal
    import subprocess
    import sys
    import sysconfig
    import time
    import venv

    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    # Without PYTHONPATH: the checkout on it (a build leaves topoagent.egg-info there) would
    # make pip take topoagent for installed already and skip the wheel.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                           "-q", str(wheel)], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    # The venv's own topoagent, with its dependencies borrowed from this test environment's
    # site-packages (offline, and no second copy) by a .pth line, which comes after the
    # venv's own site-packages: the wheel's topoagent wins over one installed there.  The
    # checkout is not on the path (no PYTHONPATH, and the commands run elsewhere).
    (site,) = (env_dir / "lib").glob("python3*/site-packages")
    (site / "borrowed-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    where = subprocess.run([str(python), "-c", "import topoagent; print(topoagent.__file__)"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=60)
    assert where.stdout.startswith(str(env_dir)), where.stdout + where.stderr

    files = subprocess.run([str(env_dir / "bin/topoagent"), "install-files", str(tmp_path / "etc")], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=60)
    assert files.returncode == 0, files.stderr
    assert (tmp_path / "etc/topoagent.service").read_bytes() == (REPO / "systemd/topoagent.service").read_bytes()
    assert (tmp_path / "etc/topoagent-alerts.yml").read_bytes() == (REPO / "systemd/topoagent-alerts.yml").read_bytes()
    assert len(files.stdout.splitlines()) == 4

    serve = subprocess.Popen([str(env_dir / "bin/topoagent"), "serve", "--root", str(REPO / "fixtures/snapshots/dgx-a100"),
                              "--listen", "127.0.0.1:0", "--state-dir", str(tmp_path / "state")],
                             cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = serve.stdout.readline()
        host, port = line.rsplit("http://", 1)[1].split()[0].rstrip("/").rsplit(":", 1)

        def get(path: str) -> tuple[int, bytes]:
            for _ in range(200):  # until discovery of the recorded node is done
                conn = http.client.HTTPConnection(host, int(port), timeout=30)
                conn.request("GET", path)
                reply = conn.getresponse()
                body = reply.read()
                conn.close()
                if reply.status != 503:
                    return reply.status, body
                time.sleep(0.05)
            return reply.status, body

        assert get("/healthz") == (200, b'{"status": "alive"}')
        status, body = get("/topology")
        assert status == 200 and len(json.loads(body)["gpus"]) == 8
    finally:
        serve.send_signal(signal.SIGTERM)
        _, err = serve.communicate(timeout=30)
    assert serve.returncode == 0, err
