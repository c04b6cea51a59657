"""What `tracekit record` says, and what its manifest keeps, when a run does not go as planned:
interrupted or killed commands, commands that trace nothing, a forgotten `--`, a script that is not
executable, numpy sizes in a user's model and a corrupted rank report. Real subprocesses throughout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from collectors.bootstrap import write_rank_report
from tests.recorded import REPO
from tracekit.app import recording
from tracekit.app.cli import cli


def record(run_dir: Path, *command: str, options: tuple[str, ...] = ()):
    return CliRunner().invoke(cli, ["record", "-o", str(run_dir), "--flush-interval", "0.2", *options, "--", *command])


def manifest_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "manifest.json").read_text())


STEPS_SCRIPT = """
import sys, torch
emb = torch.nn.EmbeddingBag(10, 4)
opt = torch.optim.SGD(emb.parameters(), lr=0.1)
for _ in range(int(sys.argv[1])):
    emb(torch.tensor([[1, 2]])).sum().backward()
    opt.step()
"""

INTERRUPTED_SCRIPT = STEPS_SCRIPT + """
import os, signal, time
try:
    os.killpg(0, signal.SIGINT)  # a terminal's Ctrl-C: record and this process both get it
    time.sleep(600)
except KeyboardInterrupt:
    sys.exit(1)
"""


def test_an_interrupted_run_says_steps_per_rank_and_both_exit_codes(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(INTERRUPTED_SCRIPT)
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "tracekit", "record", "-o", str(run_dir), "--", sys.executable,
                           str(script), "3"], cwd=REPO, capture_output=True, text=True, start_new_session=True)
    assert proc.returncode == 130, proc.stderr
    assert "tracekit: interrupted after" in proc.stderr, proc.stderr
    assert "command exited with 1; tracekit record exits with 130" in proc.stderr, proc.stderr
    assert "steps per rank: 0: 3\n" in proc.stderr, proc.stderr
    manifest = manifest_of(run_dir)
    assert (manifest["status"], manifest["exit_code"], manifest["record_exit_code"]) == ("interrupted", 1, 130)


def test_steps_are_told_per_rank_and_a_corrupted_rank_report_is_named_not_fatal(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(STEPS_SCRIPT)
    py = f"{sys.executable} {script}"
    # three "ranks" of one command; rank 2's report is overwritten with garbage once it has ended
    shell = (f"RANK=0 {py} 2 & RANK=1 {py} 3 & RANK=2 {py} 1; wait; "
             'printf "{not json" > "$TRACEKIT_RUN_DIR/ranks/rank=2.json"')
    run_dir = tmp_path / "run"
    r = record(run_dir, "sh", "-c", shell)
    assert r.exit_code == 0, r.output
    assert "steps per rank: 0: 2, 1: 3, 2: unknown\n" in r.stderr, r.stderr
    assert "manifest incomplete: ranks/rank=2.json: unreadable" in r.stderr, r.stderr
    manifest = manifest_of(run_dir)
    assert (manifest["status"], manifest["record_exit_code"], manifest["traced"]) == ("completed", 0, True)
    assert manifest["ranks"] == [0, 1, 2] and manifest["steps"] == {"0": 2, "1": 3}
    assert {s["rank"] for t in manifest["tables"] for s in t["shards"]} == {0, 1}  # only rank 2's report is lost
    assert manifest["written_rows"]["steps"] == 5
    assert set(manifest["clock_anchors"]) == {"0", "1"}
    assert len(manifest["finalise_errors"]) == 1 and "rank=2.json" in manifest["finalise_errors"][0]


def test_a_killed_command_is_told_by_its_signal(tmp_path: Path) -> None:
    r = record(tmp_path / "run", sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert r.exit_code == 137, r.output
    assert "command was killed by signal 9 (SIGKILL); tracekit record exits with 137" in r.stderr, r.stderr
    assert manifest_of(tmp_path / "run")["record_exit_code"] == 137


def test_a_command_that_never_imports_torch_says_nothing_was_traced_and_why(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    r = record(run_dir, sys.executable, "-c", "print(1)", options=("--json",))
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert (summary["traced"], summary["exit_code"], summary["record_exit_code"]) == (False, 0, 0)
    assert "no process of the command imported torch" in summary["untraced_reason"]
    manifest = manifest_of(run_dir)
    assert (manifest["traced"], manifest["untraced_reason"]) == (False, summary["untraced_reason"])
    r = record(run_dir, sys.executable, "-c", "print(1)", options=("--force",))
    assert f"nothing was traced into {run_dir}" in r.stderr and "why: no process of the command imported torch" \
        in r.stderr, r.stderr


def test_a_traced_run_says_it_was_traced(tmp_path: Path) -> None:
    r = record(tmp_path / "run", sys.executable, "-c", "import torch", options=("--json",))
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert (summary["traced"], summary["untraced_reason"], summary["ranks"]) == (True, None, [0]), summary


def test_options_after_a_command_without_dashdash_get_a_hint(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    r = CliRunner().invoke(cli, ["record", "-o", str(run_dir), "python", "train.py", "--steps", "3"])
    assert r.exit_code == 2, r.output
    # record has a --steps of its own (a window): a trainer's --steps after the command is not taken for it
    assert "'--steps' after the command is read as record's own option" in r.output, r.output
    assert f"put `--` before the command: tracekit record -o {run_dir} -- python train.py --steps 3" in r.output
    r = CliRunner().invoke(cli, ["record", "-o", str(run_dir), "python", "train.py", "--lr", "0.1"])
    assert r.exit_code == 2 and "No such option '--lr'" in r.output and "put `--` before the command" in r.output
    assert "Traceback" not in r.output and not run_dir.exists()
    r = CliRunner().invoke(cli, ["record", "--frobnicate", "--", "true"])  # record's own option misspelt: no hint
    assert r.exit_code == 2 and "No such option" in r.output and "put `--`" not in r.output, r.output


def test_a_script_that_is_not_executable_gets_a_hint(tmp_path: Path, monkeypatch) -> None:
    script = tmp_path / "train.py"
    script.write_text("print(1)\n")
    script.chmod(0o644)
    monkeypatch.chdir(tmp_path)
    for name in ("train.py", "./train.py"):
        r = CliRunner().invoke(cli, ["record", "-o", "run", "--", name, "--steps", "3"])
        assert r.exit_code == 2, r.output
        assert (f"{name} is a file but not an executable command: run it with its interpreter, "
                f"e.g. tracekit record -- python {name} --steps 3") in r.output, r.output
    script.chmod(0o755)
    r = CliRunner().invoke(cli, ["record", "-o", "run", "--", "train.py"])
    assert r.exit_code == 2 and "train.py is an executable file here but not a command on PATH" in r.output, r.output
    assert "tracekit record -- ./train.py" in r.output and not (tmp_path / "run").exists()


def test_an_executable_without_a_shebang_leaves_a_failed_manifest(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("print(1)\n")
    script.chmod(0o755)
    r = record(tmp_path / "run", str(script))
    assert r.exit_code == 126, r.output
    manifest = manifest_of(tmp_path / "run")
    assert (manifest["status"], manifest["exit_code"], manifest["traced"]) == ("failed", 126, False)
    assert "could not start (Exec format error" in manifest["untraced_reason"]
    assert f"a script needs a #! line, or its interpreter: tracekit record -- python {script}" in r.stderr


NUMPY_SCRIPT = """
import numpy as np, torch
emb = torch.nn.Embedding(np.int64(100), np.int32(4))
assert type(emb.num_embeddings) is np.int64  # what a public DLRM script does: sizes as numpy integers
opt = torch.optim.SGD(emb.parameters(), lr=0.1)
for _ in range(3):
    emb(torch.tensor([1, 2])).sum().backward()
    opt.step()
"""


def test_numpy_sizes_keep_the_rank_report_and_the_manifest_whole(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(NUMPY_SCRIPT)
    run_dir = tmp_path / "run"
    r = record(run_dir, sys.executable, str(script), options=("--json",))
    assert r.exit_code == 0 and "Traceback" not in r.stderr, r.output
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert (summary["ranks"], summary["steps"], summary["finalise_errors"]) == ([0], {"0": 3}, [])
    manifest = manifest_of(run_dir)
    assert [(t["num_rows"], t["dim"]) for t in manifest["tables"]] == [(100, 4)]
    report = json.loads((run_dir / "ranks" / "rank=0.json").read_text())
    assert report["report_errors"] == [] and report["tables"][0]["num_rows"] == 100

    # a rank whose report could only be written in part: the rest is kept and its failures named
    write_rank_report(run_dir / "ranks" / "rank=1.json",
                      {"rank": lambda: 1, "steps": lambda: 5, "tables": lambda: [{(1, 2): "tuple keys"}],
                       "clock_anchor": lambda: 1 / 0}, ["closing writer: OSError: disk full"])
    report = json.loads((run_dir / "ranks" / "rank=1.json").read_text())
    assert report["steps"] == 5 and "tables" not in report and "clock_anchor" not in report
    assert [e.split(":")[0] for e in report["report_errors"]] == ["closing writer", "tables", "clock_anchor"]
    manifest = recording.finalise(run_dir, 0, False).to_json()
    assert manifest["ranks"] == [0, 1] and manifest["steps"] == {"0": 3, "1": 5}
    assert [(t["num_rows"], t["dim"]) for t in manifest["tables"]] == [(100, 4)]  # rank 0's survive rank 1's failure
    assert [e.split(":")[0] for e in manifest["finalise_errors"]] == [
        "rank 1's report", "rank 1's report", "rank 1's report"]
    assert "clock_anchor: ZeroDivisionError" in manifest["finalise_errors"][2]


def test_a_part_that_raises_is_named_and_the_rest_of_the_manifest_written(tmp_path: Path) -> None:
    r = record(tmp_path / "run", sys.executable, "-c", "import torch")
    assert r.exit_code == 0, r.output
    run_dir = tmp_path / "run"
    report = json.loads((run_dir / "ranks" / "rank=0.json").read_text())
    (run_dir / "ranks" / "rank=0.json").write_text(json.dumps({**report, "tables": "not a list of tables"}))
    manifest = recording.finalise(run_dir, 0, False).to_json()
    assert manifest["tables"] is None  # unknown, not "no tables"
    assert [e.split(":")[0] for e in manifest["finalise_errors"]] == ["tables"]
    assert (manifest["status"], manifest["ranks"], manifest["steps"]) == ("completed", [0], {"0": 0})
