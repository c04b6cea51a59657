"""The `tracekit` command line: a thin click layer over the library (DESIGN.md §1).

Heavy modules (torch, duckdb, polars, plotly) are imported inside commands, so
`tracekit --help` stays instant.
"""

from __future__ import annotations

import click

from tracekit import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="tracekit")
def cli() -> None:
    """Trace-driven profiling and analysis of distributed recommendation-model training."""


def main() -> None:
    cli()
