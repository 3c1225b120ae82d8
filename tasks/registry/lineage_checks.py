"""What a version may record, checked before anything is written: metrics and a job config as finite JSON (no
credential left in the config), replay sources as weighted URLs. Its own module because the publish stage checks
metrics with the same rule before it exports anything."""

from __future__ import annotations

import json
import math
from typing import Any

from tasks.base.credentials import unredacted_credentials
from tasks.base.errors import InvalidInputError
from tasks.registry.names import check_name, check_text


def check_metrics(metrics: Any, where: str = "metrics") -> dict[str, Any]:
    """A JSON object of finite values, normalised through JSON (what the database will store); `where` names
    the field in errors (metrics, lineage.config)."""
    if not isinstance(metrics, dict):
        raise InvalidInputError(f"{where}: must be a JSON object, got {type(metrics).__name__}")

    def finite(x: Any, path: str) -> None:
        if isinstance(x, float) and not math.isfinite(x):
            raise InvalidInputError(f"{where}.{path}: non-finite value {x!r} cannot be published")
        if isinstance(x, dict):
            for k, v in x.items():
                finite(v, f"{path}.{k}" if path else str(k))
        elif isinstance(x, list):
            for i, v in enumerate(x):
                finite(v, f"{path}[{i}]")

    finite(metrics, "")
    try:
        text = json.dumps(metrics, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(f"{where}: not JSON-serializable: {exc}") from None
    if "\\u0000" in text:
        raise InvalidInputError(f"{where}: contains a NUL character")
    return json.loads(text)


def check_config(config: Any) -> dict[str, Any] | None:
    """A version's recorded job config: a JSON object whose credentials were redacted (never a secret in a
    record: an option named like a credential that still holds a value is refused, naming it)."""
    if config is None:
        return None
    config = check_metrics(config, "lineage.config")
    if leaks := unredacted_credentials(config):
        raise InvalidInputError(f"lineage.config: {', '.join(leaks)} would record a credential; redact it first")
    return config


def check_replay(replay: Any) -> list[dict[str, Any]]:
    """A version's replay sources: a list of {url, manifest_hash, weight in (0, 1)}, weights summing below 1."""
    if not isinstance(replay, list):
        raise InvalidInputError(f"lineage.data_replay: must be a list, got {type(replay).__name__}")
    out = []
    for i, entry in enumerate(replay):
        where = f"lineage.data_replay[{i}]"
        if not isinstance(entry, dict) or set(entry) != {"url", "manifest_hash", "weight"}:
            raise InvalidInputError(f"{where}: must be an object with url, manifest_hash and weight")
        weight = entry["weight"]
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 < weight < 1:
            raise InvalidInputError(f"{where}.weight: must be a number in (0, 1), got {weight!r}")
        out.append({"url": check_text(entry["url"], f"{where}.url", max_len=4096),
                    "manifest_hash": check_name(entry["manifest_hash"], f"{where}.manifest_hash"),
                    "weight": float(weight)})
    if sum(e["weight"] for e in out) >= 1:
        raise InvalidInputError("lineage.data_replay: the weights must sum below 1 (the primary data has the rest)")
    return out
