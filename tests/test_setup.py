"""`make`'s own set-up on a fresh Debian machine (README: `make run` and `make test` do
it all): the virtualenv step, run for real on a copy of the Makefile.

Debian keeps ``ensurepip``, which ``python3 -m venv`` needs, in the python3-venv package,
which a fresh install lacks. A private mount namespace hides ensurepip from Debian's
python3 for one ``make`` (the host is untouched), and an ``apt-get`` first on PATH records
what it is asked instead of installing (the point here is what make asks for and does
after; no network)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.process import REPO_ROOT

ENSUREPIP = Path(f"/usr/lib/python{sys.version_info.major}.{sys.version_info.minor}/ensurepip")
DEBIAN_PYTHON = Path("/usr/bin/python3")

pytestmark = [
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("make") is None,
        reason="needs root, unshare and make (a private mount namespace hides ensurepip)",
    ),
    pytest.mark.skipif(
        not (ENSUREPIP / "__main__.py").exists() or not DEBIAN_PYTHON.exists(),
        reason="needs Debian's python3 with python3-venv installed",
    ),
]


def test_make_venv_asks_for_python3_venv_and_recovers_once_it_is_there(tmp_path: Path) -> None:
    """``make`` never installed python3-venv, so ``python3 -m venv`` failed on a fresh
    Debian; and the half-made .venv it left (bin/python, no pip) made every later make
    fail on the missing pip, python3-venv installed or not, until .venv was deleted by
    hand (found by an audit)."""
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(REPO_ROOT / name, repo / name)
    empty = tmp_path / "empty"
    empty.mkdir()
    shims = tmp_path / "bin"
    shims.mkdir()
    asked = tmp_path / "apt-get.args"
    (shims / "apt-get").write_text(
        f'#!/bin/sh\necho "$@" >> {asked}\n[ "$1" = update ] && exit 0\nexit 1\n'
    )
    (shims / "apt-get").chmod(0o755)
    # Offline: the project install after a working venv fails at once, not downloading.
    env = dict(os.environ, PIP_NO_INDEX="1", PATH=f"{shims}:{os.environ['PATH']}")
    hidden = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c",
         f"mount --bind {empty} {ENSUREPIP} && make -C {repo} venv PY={DEBIAN_PYTHON}"],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert hidden.returncode != 0
    assert "install -y -qq python3-venv" in asked.read_text()
    # python3-venv installed (ensurepip visible again): the venv is made, with its pip.
    again = subprocess.run(
        ["make", "-C", str(repo), "venv", f"PY={DEBIAN_PYTHON}"],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert (repo / ".venv" / "bin" / "pip").exists(), (again.stdout + again.stderr)[-800:]
