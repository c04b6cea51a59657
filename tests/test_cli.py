"""The `tracekit` command line: instant to start, help and version."""

from __future__ import annotations

import subprocess
import sys

from click.testing import CliRunner

from tracekit import __version__
from tracekit.app.cli import cli


def test_importing_the_cli_loads_no_heavy_module() -> None:
    code = ("import sys, tracekit.app.cli; "
            "print(sorted(m for m in ('torch', 'duckdb', 'polars', 'plotly') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_help_and_version() -> None:
    runner = CliRunner()
    r = runner.invoke(cli, ["--help"])
    assert r.exit_code == 0, r.output
    assert "Trace-driven profiling" in r.output
    r = runner.invoke(cli, ["--version"])
    assert r.exit_code == 0 and __version__ in r.output, r.output
