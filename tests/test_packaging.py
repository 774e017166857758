"""The installed distribution holds every package of the source tree."""

from __future__ import annotations

import tomllib

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
