"""HTML rendering of analysis results (see DESIGN.md §2).

    path = write_report(["runs/base", "runs/hybrid"], "report.html")

One self-contained file: the verdict, then overview, skew, traffic, timeline, cache, policies, a
TorchRec run's plan (recorded against derived), the projection of `tracekit simulate` where one was
made and, with two or more runs, compare (analyses.compare.compare's summary).
The first run's figures are what `tracekit analyze` wrote (reports.inputs), never computed here; the
tables show each number in the unit its name says (tracekit.units.show).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence


def write_report(runs: Sequence[str | os.PathLike], output: str | os.PathLike, plotly_js: str = "inline") -> Path:
    """Render the report of `runs` (the first is the base, which `tracekit analyze` must have analysed:
    else TracekitError) into `output`; returns its path. With `plotly_js="beside"` plotly.js is
    written once beside it (plotly.min.js) instead of inlined."""
    from reports import predictions, sections, verdict
    from reports.html import render
    from reports.inputs import load

    inputs = [load(r, analysed=i == 0) for i, r in enumerate(runs)]  # the others are compared only
    summary = None
    if len(inputs) > 1:
        from analyses.compare import compare

        summary = compare(inputs[0].path, [r.path for r in inputs[1:]]).summary
    base = inputs[0]
    parts = [verdict.overview(inputs), sections.skew(base), sections.traffic(base), sections.timeline(base),
             sections.cache(base), predictions.policies(base)]
    for extra in (predictions.torchrec(base), sections.simulate(base)):
        if extra is not None:
            parts.append(extra)
    if summary is not None:
        parts.append(predictions.compare(summary))
    title = f"tracekit report: {base.name}" + (f" and {len(inputs) - 1} more" if len(inputs) > 1 else "")
    page = render(title, verdict.verdict(inputs, summary), parts, plotly_js, verdict.verdict_table(base, summary))
    output = Path(output)
    if plotly_js == "beside":
        from plotly.offline import get_plotlyjs

        from reports.html import PLOTLY_FILE

        (output.parent / PLOTLY_FILE).write_text(get_plotlyjs(), encoding="utf-8")
    output.write_text(page, encoding="utf-8")
    return output
