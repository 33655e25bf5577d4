"""scripts/install: a clear message (exit 2) when `python3 -m venv` cannot work (Debian without python3-venv)."""

from __future__ import annotations

import shutil
import subprocess
import sys

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
