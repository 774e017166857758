"""The installed distribution holds every package of the source tree."""

from __future__ import annotations

import tomllib

from conftest import REPO

FOLDERS = {"topoagent": "topoagent", "collectors": "topoagent.collectors",
           "probes": "topoagent.probes", "exporters": "topoagent.exporters"}


def test_every_source_package_is_installed():
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    mapping = config["package-dir"]
    assert {v for v in mapping.values()} == set(FOLDERS)
    found = set()
    for folder, namespace in FOLDERS.items():
        for init in (REPO / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(REPO / folder).parts
            found.add(".".join((namespace, *relative)))
    assert found == listed, "add new packages to [tool.setuptools] packages in pyproject.toml"


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
