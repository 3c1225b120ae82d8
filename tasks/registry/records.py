"""Plain, JSON-able records returned by the registry API."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

# 'file': one object whose bytes hash to the digest; 'tree': a directory whose manifest hashes to it
# (tasks/registry/tree.py). A version records which (migration 0004), so readers know how to fetch it.
# Its training mixture's replay sources are `data_replay` (migration 0005).
ArtifactKind = Literal["file", "tree"]


@dataclass(frozen=True)
class ArtifactRef:
    """Where an artifact lives and what it must hash to (`size`: a tree's is the sum of its files)."""

    digest: str
    url: str
    size: int
    kind: ArtifactKind = "file"

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
    parent_version: int | None = None  # the version the run started from (None: scratch or outside weights)
    init_digest: str | None = None  # digest of the starting weights (None: scratch)
    data_url: str | None = None  # where the training data was read from (a snapshot prefix)
    # Earlier snapshots mixed into training (`data.replay`): {url, manifest_hash, weight} each, in order;
    # the primary data above had the rest of the weight. Empty: trained on the primary data alone.
    data_replay: list[dict[str, Any]] = field(default_factory=list)


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
    parent_version: int | None = None
    init_digest: str | None = None
    data_url: str | None = None
    artifact_kind: ArtifactKind = "file"
    data_replay: list[dict[str, Any]] = field(default_factory=list)
    created: bool = field(default=False, compare=False)  # this call inserted it (publish's answer, not a fact)

    def to_dict(self) -> dict[str, Any]:
        """The version as stored (without `created`, which describes a call, not the version)."""
        out = asdict(self)
        out.pop("created")
        return out


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
