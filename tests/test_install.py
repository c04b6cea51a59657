"""Installing tracekit into a user's training environment: plain `pip install PATH` builds a
pure-Python wheel (no torch, no compiler at build time), and installed into a venv holding torch
and TorchRec it leaves torch's version as it was, and record, analyze and report work from the
installed copy, run from outside the repository. Real pip and real subprocesses throughout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from collections import Counter
from pathlib import Path

import pytest

from tests.prerequisites import missing
from tests.torchrec_env import source_tree, torchrec_python  # noqa: F401 (the fixture)
from tracekit.run import open_run

pytestmark = pytest.mark.slow  # pip builds and installs, subprocesses

PACKAGES = ("tracekit", "collectors", "analyses", "reports")

# A user's own tiny model, 3 steps; STEP_IDS[s] are the two bags of step s
STEP_IDS = [[[1, 2, 3], [3, 4, 5]], [[1, 1, 9], [0, 2, 7]], [[5, 6, 7], [8, 9, 9]]]
SCRIPT = f"""
import torch

emb = torch.nn.EmbeddingBag(10, 4, mode="sum")
opt = torch.optim.SGD(emb.parameters(), lr=0.1)
for ids in {STEP_IDS!r}:
    opt.zero_grad()
    emb(torch.tensor(ids)).sum().backward()
    opt.step()
"""


def run(*command: str | Path, cwd: Path) -> subprocess.CompletedProcess:
    """Run a command as a user's shell would, without this checkout on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([str(c) for c in command], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_pip_builds_a_pure_python_wheel_without_torch(tmp_path: Path) -> None:
    src = source_tree(tmp_path / "src")
    proc = run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--disable-pip-version-check", "-w",
               tmp_path / "dist", src, cwd=tmp_path)  # build isolation: setuptools only, no torch
    if proc.returncode != 0 and "No matching distribution found for setuptools" in proc.stdout + proc.stderr:
        missing("no package index to fetch setuptools from into the isolated build environment")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [wheel] = (tmp_path / "dist").glob("*.whl")
    assert wheel.name == "tracekit-0.1.0-py3-none-any.whl"  # pure Python: no extension, any platform
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {p.relative_to(src).as_posix() for package in PACKAGES for p in (src / package).rglob("*.py")}
    assert sources - names == set()  # every module, collectors/site/sitecustomize.py included
    assert not [n for n in names if n.endswith((".so", ".pyd", ".cpp"))]
    assert "tracekit = tracekit.app.cli:main" in zipfile.ZipFile(wheel).read("tracekit-0.1.0.dist-info/entry_points.txt").decode()


def test_install_keeps_torch_and_the_installed_copy_runs_outside_the_repo(torchrec_python: Path,  # noqa: F811
                                                                         tmp_path: Path) -> None:
    probe = run(torchrec_python, "-c", """
import json, sysconfig, torch, torchrec, tracekit, collectors, analyses, reports
print(json.dumps({"torch": torch.__version__, "torchrec": torchrec.__version__,
                  "site": sysconfig.get_paths()["purelib"],
                  "files": [m.__file__ for m in (tracekit, collectors, analyses, reports)]}))
""", cwd=tmp_path)
    assert probe.returncode == 0, probe.stderr
    found = json.loads(probe.stdout)
    assert (found["torch"], found["torchrec"]) == ("2.13.0+cpu", "1.8.0")  # the fixture fails if pip touched torch
    site = Path(found["site"]).resolve()
    for file in found["files"]:
        assert Path(file).resolve().is_relative_to(site), (file, site)  # the installed copy, not this checkout
    helped = run(torchrec_python.parent / "tracekit", "--help", cwd=tmp_path)
    assert helped.returncode == 0, helped.stderr
    assert all(command in helped.stdout for command in ("record", "analyze", "report")), helped.stdout


def test_the_trainer_uses_index_add_without_the_cpp_kernel(torchrec_python: Path, tmp_path: Path) -> None:  # noqa: F811
    """The installed copy has no tracekit/dlrm/_sparse_update: SparseSGD falls back, same update."""
    proc = run(torchrec_python, "-c", """
import torch
from tracekit.dlrm import optim
assert optim._sparse_update is None, optim._sparse_update
weight = torch.zeros(6, 2)
ids, lengths, offsets = torch.tensor([1, 4, 4, 5]), torch.tensor([1, 3]), torch.tensor([0, 1])
grads = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
assert not optim.use_fused_kernel(weight, grads)
optim.SparseSGD(0.5).update(weight, ids, grads, lengths, offsets)
print(weight.tolist())
""", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [[0, 0], [-0.5, -1], [0, 0], [0, 0], [-3, -4], [-1.5, -2]]


def test_record_analyze_and_report_from_the_installed_copy(torchrec_python: Path, tmp_path: Path) -> None:  # noqa: F811
    bin_dir = torchrec_python.parent
    (tmp_path / "train.py").write_text(SCRIPT)
    recorded = run(bin_dir / "tracekit", "record", "-o", "run", "--flush-interval", "0.2", "--",
                   torchrec_python, "train.py", cwd=tmp_path)
    assert recorded.returncode == 0, recorded.stderr
    accesses = open_run(tmp_path / "run").scan("accesses").collect()
    counts = Counter({(step, row): n for step, row, n in accesses.select("step", "row", "count").rows()})
    assert counts == Counter((step, i) for step, bags in enumerate(STEP_IDS) for bag in bags for i in bag)
    assert accesses["count"].sum() == 18  # every id fed, once

    analyzed = run(bin_dir / "tracekit", "analyze", "run", "--json", "--no-report", cwd=tmp_path)
    assert analyzed.returncode == 0, analyzed.stderr
    json.loads(analyzed.stdout)  # one JSON document on stdout
    reported = run(bin_dir / "tracekit", "report", "run", "-o", "report.html", cwd=tmp_path)
    assert reported.returncode == 0, reported.stderr
    html = (tmp_path / "report.html").read_text()
    assert "plotly.js v" in html and 'src="http' not in html  # plotly.js inlined from the installed plotly
