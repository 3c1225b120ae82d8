"""Dataset warming: object store -> verified local SSD copy (see core.warm).

Names resolve on first use (PEP 562): `retrainer warm-url` on a warm cache must not pay
for modules it does not run (the fetcher and its retry library).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DatasetEvictedError": "tasks.warm.cache",
    "DiskBudgetError": "tasks.warm.cache",
    "WarmReport": "tasks.warm.report",
    "WarmResult": "tasks.warm.report",
    "dataset_in_use": "tasks.warm.cache",
    "remote_manifest_hash": "tasks.warm.core",
    "warm": "tasks.warm.core",
    "warm_for_config": "tasks.warm.core",
    "warm_mixture": "tasks.warm.core",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tasks.warm' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
