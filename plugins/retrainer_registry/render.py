"""Server-side HTML for the registry page: plain tables and an inline SVG loss curve, no JS build.

Every value from the database goes through `esc` (model names, actors and reasons are
user-controlled text).
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Iterable, Sequence
from typing import Any
from urllib.parse import quote

STYLE = """
body{font-family:system-ui,sans-serif;margin:1.5rem;color:#1a202c;background:#fff}
h1{font-size:1.4rem}h2{font-size:1.15rem;margin-top:1.6rem}
table{border-collapse:collapse;margin:.5rem 0}td,th{border:1px solid #cbd5e0;padding:.3rem .6rem;
text-align:left;font-size:.9rem;vertical-align:top}th{background:#edf2f7}
.live{background:#c6f6d5;font-weight:600}.muted{color:#718096}.msg{padding:.5rem;background:#fefcbf}
code{font-size:.85rem}form{display:inline}button{cursor:pointer}
"""


def esc(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def page(title: str, body: str) -> str:
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{esc(title)}</title>"
            f"<style>{STYLE}</style></head><body>{body}</body></html>")


def table(headers: Sequence[str], rows: Iterable[Sequence[str]], row_class: Sequence[str] | None = None) -> str:
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = []
    for i, row in enumerate(rows):
        cls = f" class='{row_class[i]}'" if row_class and row_class[i] else ""
        body.append(f"<tr{cls}>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def model_href(model: str) -> str:
    return f"models/{quote(model, safe='')}"


def loss_svg(losses: Sequence[float], width: int = 640, height: int = 240, pad: int = 36) -> str:
    """An inline SVG polyline of the loss per step, with min/max labels on the y axis."""
    points = [(i, float(x)) for i, x in enumerate(losses) if math.isfinite(float(x))]
    if len(points) < 2:
        return "<p class='muted'>no training loss curve recorded for this version</p>"
    lo, hi = min(y for _, y in points), max(y for _, y in points)
    span = (hi - lo) or 1.0
    last = points[-1][0] or 1
    coords = " ".join(
        f"{pad + (width - 2 * pad) * i / last:.1f},{height - pad - (height - 2 * pad) * (y - lo) / span:.1f}"
        for i, y in points
    )
    return (
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' role='img' "
        f"aria-label='training loss curve'>"
        f"<rect x='0' y='0' width='{width}' height='{height}' fill='#f7fafc' stroke='#cbd5e0'/>"
        f"<line x1='{pad}' y1='{height - pad}' x2='{width - pad}' y2='{height - pad}' stroke='#4a5568'/>"
        f"<line x1='{pad}' y1='{pad}' x2='{pad}' y2='{height - pad}' stroke='#4a5568'/>"
        f"<polyline fill='none' stroke='#2b6cb0' stroke-width='2' points='{coords}'/>"
        f"<text x='2' y='{pad}' font-size='10'>{hi:.3f}</text>"
        f"<text x='2' y='{height - pad}' font-size='10'>{lo:.3f}</text>"
        f"<text x='{width - pad}' y='{height - 8}' font-size='10' text-anchor='end'>step {last + 1}</text>"
        f"</svg>"
    )


def metrics_cell(metrics: dict[str, Any]) -> str:
    """Every suite's metrics, then each gate rule's result (passed or not, in words); other scalars inline,
    lists (curves) summarized by length."""
    parts = [f"{esc(k)}: {v:.4g}" for k, v in sorted((metrics.get("metrics") or {}).items())]
    for key in sorted(metrics):
        value = metrics[key]
        if key in ("metrics", "gate", "suites"):
            continue
        if key == "live" and isinstance(value, dict):
            parts.append(f"live when evaluated: v{esc(value.get('version'))}")
        elif isinstance(value, list):
            parts.append(f"{esc(key)}: [{len(value)} values]")
        elif isinstance(value, float):
            parts.append(f"{esc(key)}: {value:.4g}")
        else:
            parts.append(f"{esc(key)}: {esc(json.dumps(value) if isinstance(value, dict) else value)}")
    for rule in metrics.get("gate") or []:
        mark = "pass" if rule.get("passed") else "FAIL"
        parts.append(f"gate {mark}: {esc(rule.get('note', rule.get('metric')))}")
    return "<br>".join(parts)
