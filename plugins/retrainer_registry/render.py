"""Server-side HTML for the registry page: tables and inline SVG loss curves, no JS build, no external assets.

Every value from the database goes through `esc` (model names, actors and reasons are
user-controlled text); every value put in a URL is quoted first. The look follows the Airflow
UI the page is embedded in (its fonts and its brand/gray palette), light or dark like it.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

# Airflow 3's theme (airflow/ui: Inter with the system font stack; its brand and gray oklch scales).
STYLE = """
:root{color-scheme:light;--bg:#fff;--fg:oklch(0.18 0.03 251);--muted:oklch(0.45 0.055 251);
--border:oklch(0.915 0.01 253);--head:oklch(0.985 0.004 253);--link:oklch(0.469 0.084 257.657);
--live:oklch(0.962 0.012 249.460);--msg:oklch(0.982 0.013 83.915);--pass:oklch(0.52 0.14 150);
--fail:oklch(0.577 0.245 27.325);--grid:oklch(0.915 0.01 253);
--c0:oklch(0.55 0.15 257);--c1:oklch(0.65 0.17 45);--c2:oklch(0.6 0.14 150);--c3:oklch(0.58 0.2 330);
--c4:oklch(0.62 0.12 200);--c5:oklch(0.55 0.03 252)}
:root.dark{color-scheme:dark;--bg:oklch(0.11 0.025 251);--fg:oklch(0.955 0.006 253);
--muted:oklch(0.75 0.025 252);--border:oklch(0.28 0.035 251);--head:oklch(0.18 0.03 251);
--link:oklch(0.705 0.066 256.378);--live:oklch(0.259 0.062 265.566);--msg:oklch(0.3 0.06 80);
--pass:oklch(0.75 0.15 150);--fail:oklch(0.704 0.191 22.216);--grid:oklch(0.28 0.035 251);
--c0:oklch(0.72 0.12 257);--c1:oklch(0.75 0.15 60);--c2:oklch(0.75 0.14 150);--c3:oklch(0.72 0.17 330);
--c4:oklch(0.78 0.1 200);--c5:oklch(0.7 0.03 252)}
body{font-family:Inter,-apple-system,BlinkMacSystemFont,"Segoe UI",Helvetica,Arial,sans-serif;
margin:1.5rem;color:var(--fg);background:var(--bg);font-size:.875rem;line-height:1.45}
a{color:var(--link);text-decoration:none}a:hover{text-decoration:underline}
h1{font-size:1.5rem;font-weight:600;margin:.4rem 0 1rem}h2{font-size:1.1rem;font-weight:600;margin:1.8rem 0 .5rem}
table{border-collapse:collapse;margin:.5rem 0;border:1px solid var(--border);border-radius:6px}
td,th{border-bottom:1px solid var(--border);padding:.4rem .7rem;text-align:left;vertical-align:top}
th{background:var(--head);font-weight:600;font-size:.8rem;color:var(--muted)}
td.num{text-align:right;font-variant-numeric:tabular-nums}
tr.live td{background:var(--live)}.badge{display:inline-block;font-size:.72rem;padding:0 .4rem;
border-radius:9999px;border:1px solid var(--border);margin:.1rem .2rem 0 0;white-space:nowrap}
.muted{color:var(--muted)}.msg{padding:.6rem .8rem;background:var(--msg);border-radius:6px}
.pass{color:var(--pass);font-weight:600}.fail{color:var(--fail);font-weight:600}
code{font-family:SFMono-Regular,Menlo,Monaco,Consolas,"Liberation Mono","Courier New",monospace;font-size:.8rem}
form{display:inline}input{font:inherit;background:var(--bg);color:var(--fg);border:1px solid var(--border);
border-radius:4px;padding:.1rem .3rem}button{font:inherit;cursor:pointer;color:var(--bg);background:var(--link);
border:0;border-radius:4px;padding:.2rem .6rem}
.side{display:flex;gap:1.5rem;flex-wrap:wrap}
svg.chart{background:var(--head);border:1px solid var(--border);border-radius:6px}
svg.chart text{fill:var(--muted);font-size:10px}svg.chart .axis{stroke:var(--muted)}
svg.chart .grid{stroke:var(--grid)}
.legend{list-style:none;padding:0;margin:.3rem 0;display:flex;flex-wrap:wrap;gap:1rem}
.sw{display:inline-block;width:1.2rem;height:.25rem;vertical-align:middle;margin-right:.35rem}
"""
COLOURS = 6  # --c0 .. --c5
for _i in range(COLOURS):
    STYLE += f".s{_i}{{stroke:var(--c{_i})}}.sw.s{_i}{{background:var(--c{_i})}}\n"

# Embedded in the Airflow UI (same origin), take its light/dark choice; standalone, the system's.
THEME_SCRIPT = """<script>(function(){var d=document.documentElement,m='light';
try{var p=window.parent.document.documentElement.classList;if(p.contains('dark'))m='dark';
else if(!p.contains('light')&&matchMedia('(prefers-color-scheme: dark)').matches)m='dark'}
catch(e){if(matchMedia('(prefers-color-scheme: dark)').matches)m='dark'}d.classList.add(m)})();</script>"""


def esc(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def page(title: str, body: str, refresh_s: int | None = None, refresh_url: str | None = None) -> str:
    """A whole page; with `refresh_s`, it reloads itself that often (from `refresh_url` when given: a URL
    without a #fragment, since going to one with a fragment is an in-page jump, not a reload)."""
    target = f";url={refresh_url}" if refresh_url else ""
    refresh = f"<meta http-equiv='refresh' content='{esc(f'{int(refresh_s)}{target}')}'>" if refresh_s else ""
    return (f"<!doctype html><html><head><meta charset='utf-8'>{refresh}<title>{esc(title)}</title>"
            f"{THEME_SCRIPT}<style>{STYLE}</style></head><body>{body}</body></html>")


def section(ident: str, heading: str, body: str) -> str:
    """A titled part of a page; `ident` names it for links and tests (a constant, not data)."""
    return f"<section id='{ident}'><h2>{heading}</h2>{body}</section>"


def collapsible(summary_html: str, body_html: str) -> str:
    """A closed-by-default part of a section (long, rarely read: a version's whole config)."""
    return f"<details><summary>{summary_html}</summary>{body_html}</details>"


def json_block(value: Any) -> str:
    """A JSON value as an indented, escaped code block."""
    return f"<pre><code>{esc(json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False))}</code></pre>"


class Num(str):
    """A cell holding a number: `table` aligns it right (a plain str cell is left-aligned)."""


def table(headers: Sequence[str], rows: Iterable[Sequence[str]], row_class: Sequence[str] | None = None) -> str:
    """`headers` are plain text (escaped here); cells are HTML already."""
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = []
    for i, row in enumerate(rows):
        cls = f" class='{row_class[i]}'" if row_class and row_class[i] else ""
        body.append(f"<tr{cls}>" + "".join(
            f"<td class='num'>{cell}</td>" if isinstance(cell, Num) else f"<td>{cell}</td>" for cell in row
        ) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def number(value: Any) -> float | None:
    """A recorded value as a number, or None when it is none (missing, text, a flag, not finite)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def num(value: Any) -> Num:
    """A number as people compare them (4 significant digits, integers whole); '—' when there is none."""
    value = number(value)
    if value is None:
        return Num("—")
    if float(value).is_integer() and abs(value) < 1e15:
        return Num(f"{int(value):,}")
    return Num(f"{value:.4g}")


def delta(new: float | None, old: float | None) -> Num:
    """new − old with its relative change, e.g. '−0.21 (−6.3%)'."""
    if new is None or old is None:
        return Num("—")
    diff = new - old
    rel = f" ({diff / abs(old):+.1%})" if old else ""
    return Num(f"{diff:+.4g}{rel}".replace("-", "−"))


def when(iso: str | None) -> str:
    """A registry timestamp (always UTC) to the second, the full value in its tooltip."""
    if not iso:
        return "—"
    return f"<span title='{esc(iso)}'>{esc(str(iso)[:19].replace('T', ' '))} UTC</span>"


def model_href(model: str) -> str:
    return f"models/{quote(model, safe='')}"


def dag_run_href(airflow_root: str, dag_id: str, run_id: str) -> str:
    """The Airflow UI's page of one DAG run (its route /dags/:dagId/runs/:runId under the UI's base)."""
    return f"{airflow_root}/dags/{quote(dag_id, safe='')}/runs/{quote(run_id, safe='')}"


def top_link(href: str, text_html: str) -> str:
    """A link that leaves the embedded page for the Airflow UI itself (the whole window, not the frame)."""
    return f"<a href='{esc(href)}' target='_top'>{text_html}</a>"


@dataclass(frozen=True)
class Curve:
    """One training loss curve: `label` plain text, `steps` the training step of its last point (None:
    one point per step)."""

    label: str
    losses: Sequence[float]
    steps: int | None = None


def curves_svg(curves: Sequence[Curve], label: str, width: int = 720, height: int = 260) -> str:
    """Loss curves on shared axes (x: training step, y: loss), one colour each, with a legend below."""
    left, right, top, bottom = 56, 16, 14, 34
    plotted = []
    for c in curves:
        pts = [(i, float(x)) for i, x in enumerate(c.losses) if math.isfinite(float(x))]
        if len(pts) >= 2:
            per = (c.steps or len(c.losses)) / len(c.losses)  # a curve thinned at publish spans all its steps
            plotted.append((c, [((i + 1) * per, y) for i, y in pts]))
    if not plotted:
        return "<p class='muted'>no training loss curve recorded</p>"
    lo = min(y for _, pts in plotted for _, y in pts)
    hi = max(y for _, pts in plotted for _, y in pts)
    span, last = (hi - lo) or 1.0, max(x for _, pts in plotted for x, _ in pts)
    w, h = width - left - right, height - top - bottom

    def xy(x: float, y: float) -> str:
        return f"{left + w * x / last:.1f},{top + h - h * (y - lo) / span:.1f}"

    parts = [f"<svg class='chart' xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
             f"role='img' aria-label='{esc(label)}'>"]
    for k in range(5):  # horizontal grid with the loss at each line
        y = lo + span * k / 4
        py = top + h - h * k / 4
        parts.append(f"<line class='grid' x1='{left}' y1='{py:.1f}' x2='{left + w}' y2='{py:.1f}'/>"
                     f"<text x='{left - 6}' y='{py + 3:.1f}' text-anchor='end'>{y:.3f}</text>")
    parts.append(f"<line class='axis' x1='{left}' y1='{top + h}' x2='{left + w}' y2='{top + h}'/>"
                 f"<line class='axis' x1='{left}' y1='{top}' x2='{left}' y2='{top + h}'/>"
                 f"<text x='{left}' y='{height - 12}'>0</text>"
                 f"<text x='{left + w}' y='{height - 12}' text-anchor='end'>step {last:,.0f}</text>"
                 f"<text x='{left + w / 2:.0f}' y='{height - 12}' text-anchor='middle'>training step</text>")
    legend = []
    for n, (c, pts) in enumerate(plotted):
        colour = f"s{n % COLOURS}"
        summary = f"{c.label}: loss {pts[0][1]:.4g} → {pts[-1][1]:.4g} over {pts[-1][0]:,.0f} steps"
        parts.append(f"<polyline class='{colour}' fill='none' stroke-width='2' "
                     f"points='{' '.join(xy(x, y) for x, y in pts)}'><title>{esc(summary)}</title></polyline>")
        legend.append(f"<li><span class='sw {colour}'></span>{esc(summary)}</li>")
    parts.append("</svg>")
    return "".join(parts) + f"<ul class='legend'>{''.join(legend)}</ul>"
