"""A TorchRec training environment with tracekit installed into it the way a user would.

The venv is bench/.venv-torchrec (`bash bench/setup_torchrec_venv.sh`, which `make test` runs
first): torch 2.13.0+cpu, fbgemm-gpu-cpu 1.8.0 and torchrec 1.8.0. TRACEKIT_TORCHREC_PYTHON
names another venv's python instead. Once per session, the tracekit there is uninstalled and this
working tree is installed with a plain `pip install PATH` (build isolation on, dependencies
resolved by pip): a non-editable copy, so it must be reinstalled to test the current code
(~4 s, pure Python; the first install also fetches tracekit's dependencies, ~20 s). Torch's
version is read before and after, and the session fails if the install changed or reinstalled it.

A test module uses it with `from tests.torchrec_env import torchrec_python  # noqa: F401`; where
the venv is missing or does not import torchrec, the tests that use it skip saying why (and fail in
CI, tests/prerequisites.py).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.prerequisites import missing

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PYTHON = REPO / "bench" / ".venv-torchrec" / "bin" / "python"
SETUP = "build it with bash bench/setup_torchrec_venv.sh"
PIP = ["-m", "pip", "--disable-pip-version-check"]


def source_tree(dest: Path) -> Path:
    """Copy the working tree as git sees it (tracked and untracked files, none it ignores) to `dest`:
    what a user's checkout holds. Building from it can't pick up ignored leftovers (build/, a
    compiled .so), and setuptools' in-tree build writes nothing into the repository."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        if (REPO / name).is_file():  # a tracked file deleted in the working tree is skipped
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)
    return dest


def _torch_version(python: Path) -> str:
    proc = subprocess.run([str(python), "-c", "import torch; print(torch.__version__)"],
                          capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        pytest.fail(f"{python} no longer imports torch:\n{proc.stderr}")
    return proc.stdout.strip()


def _pip(python: Path, *args: str) -> None:
    proc = subprocess.run([str(python), *PIP, *args], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"pip {' '.join(args)} failed in {python} (exit {proc.returncode}):\n"
                    f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")


def _usable_python() -> tuple[Path, str]:
    """The TorchRec venv's python and its torch version, or a skip that says why there is none."""
    python = Path(os.environ.get("TRACEKIT_TORCHREC_PYTHON", DEFAULT_PYTHON))
    if not os.access(python, os.X_OK):
        missing(f"TorchRec venv not available: no {python}; {SETUP}")
    proc = subprocess.run([str(python), "-c", "import torch, torchrec; print(torch.__version__)"],
                          capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        why = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        missing(f"TorchRec venv not available: `import torchrec` fails in {python} ({why}); {SETUP}")
    return python, proc.stdout.strip()


@pytest.fixture(scope="session")
def torchrec_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The python of a venv holding torch 2.13.0+cpu, torchrec 1.8.0, fbgemm-gpu-cpu 1.8.0 and tracekit
    installed from this working tree by a plain `pip install PATH` (non-editable); see the module."""
    python, torch_before = _usable_python()
    work = tmp_path_factory.mktemp("torchrec_install")
    src = source_tree(work / "tracekit")
    report = work / "pip-report.json"
    lock_path = Path(tempfile.gettempdir()) / f"tracekit-install-{hashlib.sha1(bytes(python)).hexdigest()[:12]}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two sessions at once must not install over each other
        _pip(python, "uninstall", "--yes", "--quiet", "tracekit")  # succeeds (with a warning) if absent
        _pip(python, "install", "--quiet", "--report", str(report), str(src))
    torch_after = _torch_version(python)
    installed = sorted(item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"])
    if torch_after != torch_before or "torch" in installed:
        pytest.fail(f"`pip install {src}` changed the venv's torch: {torch_before} before, {torch_after} after, "
                    f"pip installed {installed}; pyproject.toml's torch requirement must be a range the "
                    f"user's torch satisfies")
    return python
