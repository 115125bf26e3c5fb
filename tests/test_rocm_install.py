"""``pip install -e ".[rocm]"`` resolves in a clean Python 3.11 and 3.12 environment.

Each Python gets a fresh virtual environment and a dry run of the README's ROCm install
(nothing is installed) with ``--isolated``: no local pip configuration, so PyPI alone, as
on a user's machine. This checks that the pinned jax / jax-rocm7-plugin / jax-rocm7-pjrt
release and every other dependency have a release for that Python. It needs PyPI, which
CI reaches.
"""

import glob
import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python(version: str) -> str | None:
  """An interpreter of ``version``: this one, one on PATH, or one pyenv installed."""
  if f"{sys.version_info.major}.{sys.version_info.minor}" == version:
    return sys.executable
  candidates = [shutil.which(f"python{version}")]
  pyenv = os.path.expanduser(f"~/.pyenv/versions/{version}.*/bin/python{version}")
  candidates += sorted(glob.glob(pyenv))
  for exe in filter(None, candidates):
    ok = subprocess.run([exe, "--version"], capture_output=True, text=True)
    if ok.returncode == 0 and ok.stdout.split()[1].startswith(version + "."):
      return exe
  return None


@pytest.mark.parametrize("version", ["3.11", "3.12"])
def test_rocm_extra_resolves(version, tmp_path):
  python = _python(version)
  if python is None:
    if os.environ.get("CI"):
      pytest.fail(f"no Python {version} on the CI machine")
    pytest.skip(f"no Python {version} here")
  venv = tmp_path / "venv"
  subprocess.run([python, "-m", "venv", str(venv)], check=True)
  proc = subprocess.run(
      [str(venv / "bin" / "python"), "-m", "pip", "install", "--isolated", "--dry-run",
       "--quiet", "--report", "-", "-e", f"{ROOT}[rocm]"],
      capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = json.loads(proc.stdout)
  resolved = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in report["install"]}
  for name in ("jax", "jaxlib", "jax-rocm7-plugin", "jax-rocm7-pjrt"):
    assert resolved.get(name) == "0.10.2", (name, resolved.get(name))
