"""`tracekit report` on small real runs: the page drawn by headless Chromium (every section's charts,
no console error, a screenshot that is not blank, no network request), run strings shown as text,
every table's numbers in the console's units (never an exponent or a long float), a run never
analysed refused with the command to run, and the reports of a one-rank run, a failed run and a
user script's run without lookups, with what is missing said on the page."""

from __future__ import annotations

import html
import json
import re
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import polars as pl
import pytest
from click.testing import CliRunner

from analyses.analyze import analyze
from analyses.context import Options
from analyses.simulate import Target, project
from reports import sections
from reports.inputs import load
from tests.prerequisites import missing
from tests.recorded import REPO, TINY, record
from tracekit.app.cli import cli
from tracekit.errors import TracekitError
from tracekit.app.optimize import reruns
from tracekit.store import RunWriter
from tracekit.units import show

CHROMIUM = Path("/usr/bin/chromium")
EVIL = "<img src=x onerror=alert(1)>"
SECTIONS = ("overview", "skew", "traffic", "timeline", "cache", "policies", "compare")
CHARTED = ("skew", "traffic", "timeline", "cache", "policies", "compare")


def _trainer(tmp: Path, ranks: int = 2, *changes: str) -> Path:
    options = dict(zip(TINY[::2], TINY[1::2])) | {"--steps": "8"} | dict(zip(changes[::2], changes[1::2]))
    argv = [x for pair in options.items() for x in pair]
    code, run_dir = record(tmp, sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(ranks), str(REPO / "train.py"), *argv, options=("--lookup-every", "1"))
    assert code == 0
    return run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """base: TINY on 2 ranks for 8 steps, analysed; replicated: the same with base's replication policy."""
    base = _trainer(tmp_path_factory.mktemp("base"))
    analyze(base, Options(objective="bytes"))
    plans, notes = reruns(base / "policy.json", checked=True)  # as `tracekit optimize --check-all` re-runs it
    policy = next((p.policy for p in plans if p.name == "replication"), None)
    assert policy is not None, notes
    replicated = _trainer(tmp_path_factory.mktemp("replicated"), 2, "--policy", str(policy))
    return {"base": base, "replicated": replicated}


def report(*runs: Path, output: Path) -> str:
    r = CliRunner().invoke(cli, ["report", *map(str, runs), "-o", str(output)])
    assert r.exit_code == 0, r.output
    assert r.output.startswith(str(output)) and "MB)" in r.output, r.output
    return output.read_text(encoding="utf-8")


# the browser ------------------------------------------------------------------------------------

def chromium() -> Path:
    """/usr/bin/chromium, installed with apt once where it is missing; else the test is skipped."""
    if not CHROMIUM.exists() and shutil.which("apt-get"):
        subprocess.run(["apt-get", "install", "-y", "chromium"], capture_output=True, timeout=600)
    if not CHROMIUM.exists():
        missing("headless Chromium is missing: /usr/bin/chromium not found and `apt-get install -y chromium` "
                    "did not install it (install Debian's chromium package)")
    return CHROMIUM


def browse(page: Path, tmp: Path, *args: str) -> subprocess.CompletedProcess:
    profile = tmp / f"profile{len(list(tmp.glob('profile*')))}"
    argv = [str(chromium()), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0", *args, page.resolve().as_uri()]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Uncaught" not in done.stderr, done.stderr[-3000:]
    return done


def per_section(markup: str, pattern: str) -> dict[str, int]:
    """How often `pattern` occurs inside each <section id=...> of `markup`."""
    out = {}
    for match in re.finditer(r'<section id="([a-z]+)"(.*?)</section>', markup, re.S):
        out[match.group(1)] = len(re.findall(pattern, match.group(2)))
    return out


def png_colours(path: Path) -> int:
    """Distinct colours in (a sample of) an 8-bit RGB/RGBA PNG, decoded with zlib alone."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        header = body if kind == b"IHDR" else header
        idat += body if kind == b"IDAT" else b""
        pos += 12 + length
    width, height, depth, colour = struct.unpack(">IIBB", header[:10])
    assert depth == 8 and colour in (2, 6), (depth, colour)
    channels = 3 if colour == 2 else 4
    raw, stride, prev, seen = zlib.decompress(idat), width * channels, bytearray(width * channels), set()
    for y in range(height):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            left = line[i - channels] if i >= channels else 0
            up, corner = prev[i], prev[i - channels] if i >= channels else 0
            if kind == 1:
                line[i] = (line[i] + left) & 255
            elif kind == 2:
                line[i] = (line[i] + up) & 255
            elif kind == 3:
                line[i] = (line[i] + (left + up) // 2) & 255
            elif kind == 4:
                p = left + up - corner
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
                line[i] = (line[i] + (left if pa <= pb and pa <= pc else up if pb <= pc else corner)) & 255
        prev = line
        if y % 8 == 0:
            seen.update(bytes(line[x:x + 3]) for x in range(0, stride, channels * 4))
    return len(seen)


def no_network(markup: str) -> None:
    """No src/href to another host, no <link>, no <script src>: plotly's inlined source (which
    names URLs in its strings) is left out of the check."""
    outside = re.sub(r"<script\b[^>]*>.*?</script>", "<script></script>", markup, flags=re.S | re.I)
    assert not re.search(r"""\b(src|href)\s*=\s*["']?\s*(https?:)?//""", outside, re.I)
    assert not re.search(r"<link\b", outside, re.I)
    assert not re.search(r"<script\b[^>]*\bsrc\s*=", markup, re.I)


@pytest.mark.slow
def test_chromium_draws_every_section_of_a_two_rank_report(runs, tmp_path: Path) -> None:
    page = tmp_path / "report.html"
    markup = report(runs["base"], runs["replicated"], output=page)
    no_network(markup)
    assert markup.count("Plotly.newPlot") == markup.count('class="plotly-graph-div"')
    declared = per_section(markup, r'class="plotly-graph-div"')
    assert set(declared) == set(SECTIONS), declared
    assert all(declared[s] >= 1 for s in CHARTED), declared
    dom = browse(page, tmp_path, "--dump-dom", "--virtual-time-budget=10000").stdout
    drawn = per_section(dom, r'class="plot-container')
    assert drawn == declared, (drawn, declared)
    assert per_section(dom, r'class="[^"]*js-plotly-plot') == declared
    no_network(dom)
    assert "Verdict" in dom and "communication is" in dom
    # the verdict's table, as drawn: replication's row with its step predicted and, from the run that applied it,
    # measured, with the measured speedup over the baseline
    verdict = re.search(r'<div class="verdict">(.*?)</div>', dom, re.S).group(1)
    row = re.search(r"<tr><td[^>]*>replication[^<]*</td>(.*?)</tr>", verdict, re.S)
    assert row is not None, verdict
    shown = re.findall(r"<td[^>]*>([^<]*)</td>", row.group(1))
    assert shown[0] in ("yes", "no") and shown[1].endswith(" ms") and "×" in shown[2], shown  # predicted
    assert shown[3].endswith(" ms") and re.fullmatch(r"\d+\.\d\d×", shown[4]), shown  # measured, its speedup
    shot = tmp_path / "shot.png"
    browse(page, tmp_path, f"--screenshot={shot}", "--window-size=1280,2000", "--virtual-time-budget=10000")
    assert shot.stat().st_size > 50_000
    assert png_colours(shot) > 20


@pytest.mark.slow
def test_plotly_beside_the_page_is_loaded_from_disk(runs, tmp_path: Path) -> None:
    page = tmp_path / "beside" / "report.html"
    page.parent.mkdir()
    r = CliRunner().invoke(cli, ["report", str(runs["base"]), "-o", str(page), "--plotly-js", "beside"])
    assert r.exit_code == 0, r.output
    markup = page.read_text(encoding="utf-8")
    assert '<script type="text/javascript" src="plotly.min.js"></script>' in markup
    assert (page.parent / "plotly.min.js").stat().st_size > 1_000_000 and len(markup) < 2_000_000
    dom = browse(page, tmp_path, "--dump-dom", "--virtual-time-budget=10000").stdout
    assert per_section(dom, r'class="plot-container') == per_section(markup, r'class="plotly-graph-div"')


@pytest.mark.slow
def test_a_table_and_tag_named_as_markup_show_as_text(runs, tmp_path: Path) -> None:
    run = tmp_path / "evil"
    shutil.copytree(runs["base"], run)
    for part in (run / "analysis").glob("*.parquet"):
        frame = pl.read_parquet(part)
        for column in ("table_name", "tag"):
            if column in frame.columns:
                frame = frame.with_columns(pl.col(column).replace({"t0": EVIL, "output_fwd": EVIL}))
        frame.write_parquet(part)
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["command"] = [*manifest["command"], EVIL]
    (run / "manifest.json").write_text(json.dumps(manifest))
    page = tmp_path / "evil.html"
    markup = report(run, output=page)
    assert EVIL not in markup
    assert "&lt;img src=x onerror=alert(1)&gt;" in markup
    dom = browse(page, tmp_path, "--dump-dom", "--virtual-time-budget=10000").stdout
    assert "<img" not in dom.lower()
    assert "onerror=alert(1)" in dom  # there, as text


@pytest.mark.slow
def test_nvml_samples_are_drawn_thinned_and_dropped_rows_warned(runs, tmp_path: Path) -> None:
    run = tmp_path / "gpu"
    shutil.copytree(runs["base"], run)
    n = 5000
    for rank in (0, 1):
        writer = RunWriter(run, rank)
        writer.append("gpu", {"t_ns": [i * 100_000_000 for i in range(n)], "device": [rank] * n,
                              "util_gpu": [i % 100 for i in range(n)], "util_mem": [10] * n, "mem_used": [2 ** 30] * n,
                              "power_mw": [250_000] * n, "sm_clock_mhz": [1400] * n, "pcie_tx": [0] * n,
                              "pcie_rx": [0] * n})
        writer.close()
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["gpu"] = {"devices": [{"name": "H100"}], "samples": True}
    manifest["dropped_rows"] = {"1": {"accesses": 1234}}  # a run recorded before `lost_rows`: read from these
    manifest.pop("lost_rows", None)
    manifest.pop("lost_lookups", None)
    (run / "manifest.json").write_text(json.dumps(manifest))
    section = sections.timeline(load(run))
    gpu = section.charts[-1].figure
    assert "GPU" in gpu.layout.title.text and len(gpu.data) == 2
    assert all(len(trace.x) <= 2000 and trace.x[-1] == (n - 1) / 10 for trace in gpu.data)
    assert not section.missing
    page = tmp_path / "report.html"
    markup = report(run, output=page)
    assert "the trace lost rows (manifest `lost_rows`: accesses 1,234)" in markup and "no GPU samples" not in markup
    dom = browse(page, tmp_path, "--dump-dom", "--virtual-time-budget=10000").stdout
    assert per_section(dom, r'class="plot-container') == per_section(markup, r'class="plotly-graph-div"')


# numbers in tables --------------------------------------------------------------------------------

EXPONENT = re.compile(r"\d[eE][+-]?\d")
DECIMAL = re.compile(r"\d[\d,]*\.\d+")
BYTES = r"\d[\d,]*(\.\d\d)? (B|kB|MB|GB)"
TIME = r"\d[\d,]*(\.\d+)? (µs|ms|s)"
PERCENT = r"-?\d+\.\d%"
COUNT = r"\d{1,3}(,\d{3})*"


def html_tables(markup: str) -> list[tuple[str, list[dict[str, str]]]]:
    """Every <table> of `markup` with its section's id, as rows of {header: cell text}."""
    out = []
    for section, body in re.findall(r'<section id="([a-z]+)"(.*?)</section>', markup, re.S):
        for part in re.findall(r"<table>(.*?)</table>", body, re.S):
            header, *rows = [[html.unescape(c) for c in re.findall(r"<t[dh][^>]*>(.*?)</t[dh]>", row, re.S)]
                             for row in re.findall(r"<tr>(.*?)</tr>", part, re.S)]
            out.append((section, [dict(zip(header, row)) for row in rows]))
    return out


@pytest.mark.parametrize("name, value, shown", [
    ("predicted.a2a_bytes_per_step", 1003580.0, "1.00 MB"), ("budget_bytes_per_rank", 352, "352 B"),
    ("step_time_s", 0.0295995, "29.6 ms"), ("latency_s", 2.5e-5, "25.0 µs"), ("makespan_s", 12.345, "12.3 s"),
    ("rank_work_s", 0, "0 s"), ("hot_sample_fraction", 2.44141e-06, "0.0%"), ("comm_share", 0.4051, "40.5%"),
    ("saving", 0.0738, "7.4%"), ("keep_ratio", 0.001, "0.1%"), ("unbounded_gain", 0.0573, "5.7%"),
    ("predicted.ratio", 0.121145, "0.12×"), ("speedup", 1.234, "1.23×"), ("lookups", 1536.0, "1,536"),
    ("samples_per_s", 6055.6, "6,056"), ("world_size", 12345, "12,345"), ("zipf_alpha", 1.0234, "1.02"),
    ("gini", 2.44141e-06, "0.00000244"), ("inter_bw", 25e6, "200 Mbit/s"), ("rank_work_s", None, "–"),
    ("step_time_s", float("nan"), "–"), ("sync", "dense_allreduce", "dense_allreduce"),
    ("error_feedback", True, "True"),
])
def test_a_figure_is_shown_in_the_unit_its_name_says(name: str, value, shown: str) -> None:
    assert show(name, value) == shown


@pytest.mark.slow
def test_every_table_shows_numbers_in_units_never_an_exponent_or_a_long_float(runs, tmp_path: Path) -> None:
    run = tmp_path / "projected"
    shutil.copytree(runs["base"], run)
    project(run, Target(2, 1, inter_bw=25e6), run / "policy.json")  # the what-if section's table too
    tables = html_tables(report(run, runs["replicated"], output=tmp_path / "report.html"))
    assert {section for section, _ in tables} == {"overview", "skew", "policies", "simulate", "compare"}
    for section, rows in tables:
        for row in rows:
            for column, cell in row.items():
                assert not EXPONENT.search(cell), (section, column, cell)
                assert all(len(n.replace(",", "").replace(".", "").lstrip("0")) <= 4 for n in DECIMAL.findall(cell)), \
                    (section, column, cell)
    rows = {section: [r for s, part in tables if s == section for r in part] for section, _ in tables}
    assert all(re.fullmatch(COUNT, r["samples/s"]) for r in rows["overview"]), rows["overview"]
    for r in rows["skew"]:
        assert re.fullmatch(COUNT, r["lookups"]) and re.fullmatch(PERCENT, r["top 1%"]), r
    figures = {r["figure"]: r["value"] for r in rows["policies"]}
    assert re.fullmatch(BYTES, figures["predicted.a2a_bytes_per_step"]), figures
    assert re.fullmatch(TIME, figures["predicted.step_time_s"]), figures
    assert re.fullmatch(f"{TIME} – {TIME}", figures["intervals.step_time_s"]), figures
    assert re.fullmatch(PERCENT, figures["predicted.lookup_coverage"]), figures
    for r in rows["simulate"]:
        assert re.fullmatch(BYTES, r["bytes / step"]) and re.fullmatch(TIME, r["step time"]), r
        assert re.fullmatch(PERCENT, r["comm share"]) and re.fullmatch(r"\d+\.\d\d×", r["speedup"]), r
    compared = {(r["section"], r["figure"]): r for r in rows["compare"]}
    exact = compared[("replication", "a2a_bytes_per_step")]
    assert re.fullmatch(BYTES, exact["predicted"]) and exact["measured"] == exact["predicted"], exact
    assert exact["interval"] == "exact" and exact["diff"] == "+0.0%", exact
    step = compared[("replication", "step_time_s")]
    assert re.fullmatch(TIME, step["measured"]) and re.fullmatch(f"{TIME} – {TIME}", step["interval"]), step
    saving = compared[("replication", "saving")]
    assert re.fullmatch(PERCENT, saving["predicted"]) and saving["diff"].endswith(" pts"), saving


@pytest.mark.slow
def test_a_run_never_analysed_is_refused_with_the_command_to_run(runs, tmp_path: Path) -> None:
    run = runs["replicated"]  # recorded, never analysed: the reports above only compare it with base
    with pytest.raises(TracekitError) as refused:
        load(run)
    message = str(refused.value)
    assert "\n" not in message and f"`tracekit analyze {run}`" in message, message
    assert load(run, analysed=False).summary is None  # as a run compared with the base, it is read as it is
    page = tmp_path / "report.html"
    r = CliRunner().invoke(cli, ["report", str(run), "-o", str(page)])
    assert r.exit_code == 2 and message in r.output, r.output
    assert not page.exists() and not (run / "analysis").exists()  # nothing analysed behind the user's back


# runs with parts missing ------------------------------------------------------------------------

FAILS = """
import sys, torch
emb = torch.nn.EmbeddingBag(50, 4)
opt = torch.optim.SGD(emb.parameters(), lr=0.1)
for step in range(3):
    emb(torch.randint(0, 50, (8, 2))).sum().backward()
    opt.step()
sys.exit(1)
"""
NO_LOOKUPS = """
import torch
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
"""


def _script(tmp: Path, text: str, code: int) -> Path:
    script = tmp / "script.py"
    script.write_text(text)
    got, run_dir = record(tmp, sys.executable, str(script))
    assert got == code
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize("case, explained", [
    ("one_rank", ["rank×rank matrix: no all-to-all", "one rank: every lookup is already local", "no GPU samples"]),
    ("failed", ["partial run: status failed, exit code 1", "no comms table"]),
    ("no_lookups", ["no embedding tables", "no accesses table", "no policy.json"]),
])
def test_runs_with_parts_missing_render_and_say_why(case: str, explained: list[str], tmp_path: Path) -> None:
    if case == "one_rank":
        run = _trainer(tmp_path, 1)
    else:
        run = _script(tmp_path, FAILS if case == "failed" else NO_LOOKUPS, 1 if case == "failed" else 0)
    page = tmp_path / "report.html"
    analyze(run)  # a report reads what analyze wrote (a run never analysed is refused)
    markup = report(run, output=page)
    assert (run / "analysis").is_dir()
    for text in explained:
        assert text in markup, text
    no_network(markup)
    dom = browse(page, tmp_path, "--dump-dom", "--virtual-time-budget=10000").stdout
    assert per_section(dom, r'class="plot-container') == per_section(markup, r'class="plotly-graph-div"')
