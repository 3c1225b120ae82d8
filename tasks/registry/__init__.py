"""Model registry: immutable versions, content-addressed artifacts, audited alias pointers.

Public API: `upgrade(db_url)`, `Registry`, `ArtifactStore`, the record types and
the errors. `alias_asset_uri(model, alias)` names the Airflow Asset a DAG emits
when an alias moves.
"""

from __future__ import annotations

from urllib.parse import quote

from tasks.registry.core import ANY, Registry
from tasks.registry.errors import (
    ConflictError,
    CorruptArtifactError,
    InvalidNameError,
    NotFoundError,
    NothingToRollBackError,
)
from tasks.registry.migrate import upgrade
from tasks.registry.records import Lineage, SwitchRecord, VersionRecord
from tasks.registry.store import ArtifactRef, ArtifactStore


def alias_asset_uri(model: str, alias: str) -> str:
    """URI of the Asset for one model+alias pointer (names percent-encoded, so any name is safe)."""
    return f"retrainer://registry/{quote(model, safe='')}/{quote(alias, safe='')}"


__all__ = [
    "ANY",
    "ArtifactRef",
    "ArtifactStore",
    "ConflictError",
    "CorruptArtifactError",
    "InvalidNameError",
    "Lineage",
    "NotFoundError",
    "NothingToRollBackError",
    "Registry",
    "SwitchRecord",
    "VersionRecord",
    "alias_asset_uri",
    "upgrade",
]
