"""Dataset warming: object store -> verified local SSD copy (see core.warm)."""

from tasks.warm.cache import DatasetEvictedError, DiskBudgetError, dataset_in_use
from tasks.warm.core import warm, warm_for_config
from tasks.warm.fetch import ChecksumMismatchError, WarmFetchError
from tasks.warm.report import WarmReport, WarmResult

__all__ = [
    "ChecksumMismatchError",
    "DatasetEvictedError",
    "DiskBudgetError",
    "WarmFetchError",
    "WarmReport",
    "WarmResult",
    "dataset_in_use",
    "warm",
    "warm_for_config",
]
