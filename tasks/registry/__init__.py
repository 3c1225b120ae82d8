"""Model registry: immutable versions, content-addressed artifacts, audited alias pointers.

Public API: `upgrade(db_url)` (the only schema change; `Registry` checks the revision and raises
SchemaVersionError on a database that is not at it), `Registry`, `ArtifactStore` (single files and
content-addressed trees, whose manifest format is `tasks.registry.tree`), the record types and the errors.
`alias_asset_uri(model, alias)` names the Airflow Asset (`model://<name>/<alias>`, issue 8) a DAG
emits when an alias moves.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from tasks.registry.errors import (
    ConflictError,
    CorruptArtifactError,
    ForceRequiredError,
    InvalidNameError,
    NotFoundError,
    NothingToRollBackError,
    PromotionRequiredError,
    RolledBackError,
    SchemaVersionError,
)
from tasks.registry.records import ArtifactRef, Lineage, SwitchRecord, VersionRecord

if TYPE_CHECKING:
    from tasks.registry.core import ANY, Registry
    from tasks.registry.migrate import upgrade
    from tasks.registry.store import ArtifactStore

# sqlalchemy, alembic and fsspec are imported on first use: worker processes that only switch pointers stay
# light, and training ranks that write into the store (`tasks.registry.store`) never load the database layer.
_LAZY = {"ANY": "tasks.registry.core", "Registry": "tasks.registry.core", "upgrade": "tasks.registry.migrate",
         "ArtifactStore": "tasks.registry.store"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def alias_asset_uri(model: str, alias: str) -> str:
    """URI of the Asset for one model+alias pointer (names percent-encoded, so any name is safe)."""
    return f"model://{quote(model, safe='')}/{quote(alias, safe='')}"


__all__ = [
    "ANY",
    "ArtifactRef",
    "ArtifactStore",
    "ConflictError",
    "CorruptArtifactError",
    "ForceRequiredError",
    "InvalidNameError",
    "Lineage",
    "NotFoundError",
    "NothingToRollBackError",
    "PromotionRequiredError",
    "Registry",
    "RolledBackError",
    "SchemaVersionError",
    "SwitchRecord",
    "VersionRecord",
    "alias_asset_uri",
    "upgrade",
]
