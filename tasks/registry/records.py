"""Plain, JSON-able records returned by the registry API."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class ArtifactRef:
    """Where an artifact lives and what it must hash to."""

    digest: str
    url: str
    size: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Lineage:
    """Where a version came from: enough to rebuild or audit it."""

    config_hash: str
    data_manifest_hash: str
    code_revision: str
    checkpoint_tag: str
    serving_bytes: int | None = None


@dataclass(frozen=True)
class VersionRecord:
    """One immutable published version. `created` is False when publish found it already there."""

    model: str
    version: int
    artifact_digest: str
    artifact_url: str
    size_bytes: int
    config_hash: str
    data_manifest_hash: str
    code_revision: str
    checkpoint_tag: str
    metrics: dict[str, Any]
    serving_bytes: int | None
    created_by: str
    created_at: str
    created: bool = field(default=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class SwitchRecord:
    """One alias move (a history row). `changed` is False for a no-op switch to the live version."""

    model: str
    alias: str
    seq: int
    action: str
    from_version: int | None
    to_version: int
    actor: str
    reason: str
    at: str
    changed: bool = field(default=True, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
