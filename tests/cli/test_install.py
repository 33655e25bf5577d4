"""scripts/install: a clear message (exit 2) when `python3 -m venv` cannot work (Debian without python3-venv)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO


def test_missing_venv_support_is_named_with_the_package_to_install(tmp_path):
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "install", repo / "scripts" / "install")
    fake = tmp_path / "python3"
    fake.write_text(f"""#!/bin/sh
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then
  echo "The virtual environment was not created successfully because ensurepip is not available." >&2
  exit 1
fi
exec {sys.executable} "$@"
""")
    fake.chmod(0o755)
    p = subprocess.run(["bash", str(repo / "scripts" / "install")], env={"PATH": "/usr/bin:/bin", "PYTHON": str(fake)},
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "ensurepip is not available" in p.stderr and "apt-get install python3-venv" in p.stderr
    assert not (repo / ".venv").exists()


def test_the_wheel_builds_without_warnings_and_carries_the_recipes_data(tmp_path):
    """A new user saw ~40 lines of setuptools' "Package 'broker.recipes.data' is absent from the packages
    configuration" during the install: every folder shipped is a declared package, and the wheel has the data."""
    import sys
    import zipfile
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(repo),
                        "-w", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "absent from the packages" not in p.stdout + p.stderr and "BuildBackendWarning" not in p.stderr
    names = zipfile.ZipFile(next(tmp_path.glob("broker-*.whl"))).namelist()
    assert "broker/recipes/data/digits.csv.gz" in names and "broker/recipes/ddp_2node.yaml" in names


def test_the_install_compiles_the_sources_so_a_start_without_bytecode_writes_compiles_nothing(tmp_path):
    """With PYTHONDONTWRITEBYTECODE=1 an editable install's modules compile from source at every start unless the
    install compiled them: scripts/install runs scripts/compile-sources, which leaves a current .pyc for every
    module, and an import then reads them instead of compiling."""
    import importlib.util
    import shutil

    install = (REPO / "scripts" / "install").read_text()
    assert "scripts/compile-sources .venv/bin/python" in install
    pkg = tmp_path / "pkg"
    shutil.copytree(REPO / "broker" / "core", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([str(REPO / "scripts" / "compile-sources"), sys.executable, str(pkg)], check=True, timeout=120)
    sources = sorted(pkg.rglob("*.py"))
    assert sources
    missing = [p.name for p in sources if not Path(importlib.util.cache_from_source(str(p))).is_file()]
    assert missing == []
