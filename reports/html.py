"""Page assembly: escaping, plotly inlined once, one `<section>` per part of the report.

Every string that comes from a run (command line, table names, tags, notes) goes through `esc`
before it reaches the page or a plotly title/label/legend, so a table named
`<img src=x onerror=alert(1)>` shows as text. Figures are drawn from JSON with plotly.js inlined
once in `<head>`: the file opens from disk with no network.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Any, Collection, Sequence

MAX_POINTS = 2000
"""At most this many points per trace; longer series are thinned evenly (`thin`)."""

CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:0 auto;max-width:1180px;padding:0 24px 48px;
color:#1f2933;background:#fff;line-height:1.45}
h1{font-size:1.6em;margin:24px 0 4px}h2{border-bottom:1px solid #d0d7de;padding-bottom:4px;margin-top:40px}
.verdict{background:#f3f6fa;border-left:4px solid #2f6fb3;padding:10px 16px;margin:12px 0 20px}
.verdict li{margin:2px 0}.muted{color:#5f6b7a}.warn{color:#9a3b00}
.caption{color:#5f6b7a;font-size:.92em;margin:0 0 18px}.chart{margin:8px 0 0}
table{border-collapse:collapse;font-size:.88em;margin:8px 0 16px}td,th{border:1px solid #d0d7de;padding:3px 8px;text-align:right}
th{background:#f6f8fa}td.l,th.l{text-align:left}code{font-size:.9em;word-break:break-all}
nav a{margin-right:12px}td{font-variant-numeric:tabular-nums}
"""


def esc(value: Any) -> str:
    """`value` as text that cannot become markup."""
    return html.escape(str(value), quote=True)


@dataclass
class Chart:
    """One figure with the sentence saying what to look for."""

    figure: Any  # plotly.graph_objects.Figure
    caption: str


@dataclass
class PageSection:
    """One part of the report: prose (already escaped HTML), charts, and what is missing and why."""

    id: str
    title: str
    intro: list[str] = field(default_factory=list)  # HTML fragments, escaped by whoever built them
    charts: list[Chart] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # plain text: why a part is absent


def thin(values: Sequence, limit: int = MAX_POINTS) -> list:
    """Every k-th value so that at most `limit` remain (the last one kept)."""
    values = list(values)
    if len(values) <= limit:
        return values
    step = -(-len(values) // limit)
    kept = values[::step]
    if kept[-1] is not values[-1]:
        kept[-1] = values[-1]
    return kept


def figure(*, title: str, x: str, y: str, height: int = 380, **layout: Any):
    """An empty plotly figure with an escaped title and axis labels (units in the labels)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    fig.update_layout(title=esc(title), xaxis_title=esc(x), yaxis_title=esc(y), height=height,
                      template="plotly_white", margin=dict(l=70, r=30, t=60, b=60), **layout)
    return fig


def table(header: Sequence[str], rows: Sequence[Sequence[Any]], left: int | Collection[int] = 1) -> str:
    """An HTML table; every cell escaped; text columns left-aligned (the first `left` ones, or those
    numbered in `left`), the others (numbers) right-aligned."""
    text = range(left) if isinstance(left, int) else left

    def cells(tag: str, values: Sequence[Any]) -> str:
        return "".join(f'<{tag}{" class=l" if i in text else ""}>{esc(v)}</{tag}>' for i, v in enumerate(values))

    body = "".join(f"<tr>{cells('td', r)}</tr>" for r in rows)
    return f"<table><tr>{cells('th', header)}</tr>{body}</table>"


PLOTLY_FILE = "plotly.min.js"
"""plotly.js's file name beside a report written with `plotly_js="beside"`."""


def render(title: str, verdict: list[str], sections: list[PageSection], plotly_js: str = "inline",
           verdict_table: str = "") -> str:
    """The whole page: plotly.js once in <head> ("inline"), or a <script src> of PLOTLY_FILE beside
    the page ("beside": the caller writes it there), then the verdict (its table, markup built with
    `table`, then its sentences, escaped here) and each section."""
    import plotly.io as pio
    from plotly.offline import get_plotlyjs

    config = {"displaylogo": False, "responsive": True}
    script = (f'<script type="text/javascript">{get_plotlyjs()}</script>' if plotly_js == "inline"
              else f'<script type="text/javascript" src="{PLOTLY_FILE}"></script>')
    parts = [f"<!DOCTYPE html><html lang=en><head><meta charset=utf-8><title>{esc(title)}</title>",
             f"<style>{CSS}</style>{script}</head><body>",
             f"<h1>{esc(title)}</h1>", "<nav>" + "".join(f'<a href="#{s.id}">{esc(s.title)}</a>' for s in sections)
             + "</nav>", f'<div class="verdict"><strong>Verdict</strong>{verdict_table}<ul>'
             + "".join(f"<li>{esc(v)}</li>" for v in verdict) + "</ul></div>"]
    for s in sections:
        parts.append(f'<section id="{esc(s.id)}"><h2>{esc(s.title)}</h2>')
        parts.extend(s.intro)
        parts.extend(f'<p class="muted">Not shown: {esc(m)}</p>' for m in s.missing)
        for chart in s.charts:
            div = pio.to_html(chart.figure, full_html=False, include_plotlyjs=False, config=config)
            parts.append(f'<div class="chart">{div}</div><p class="caption">{esc(chart.caption)}</p>')
        parts.append("</section>")
    parts.append("</body></html>")
    return "\n".join(parts)
