"""Small helpers every layer uses with a job config: a config's `module:function` reference resolved, and the
canonical JSON hash that names keys, suites and evaluations."""

from __future__ import annotations

import hashlib
import importlib
import json
from typing import Any

from tasks.base.errors import InvalidInputError


def load_entry_point(ref: str, field: str) -> Any:
    """`module:function` (as config field `field` names it) -> the function; InvalidInputError naming the field and
    the reference when it does not resolve."""
    module_name, _, attr = ref.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise InvalidInputError(f"{field} entry point {ref!r}: {exc}") from None


def sha256_json(obj: Any) -> str:
    """sha256 of canonical JSON (sorted keys, no whitespace)."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()
