"""Plain, JSON-able records returned by the registry API."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

# 'file': one object whose bytes hash to the digest; 'tree': a directory whose manifest hashes to it
# (tasks/registry/tree.py). A version records which (migration 0004), so readers know how to fetch it.
# Its training mixture's replay sources are `data_replay` (migration 0005); the resolved job config it was
# trained with and the weights training started from are `config` and `started_from` (migration 0006).
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
    # The run's resolved job config, credentials redacted (tasks/base/credentials.py: redact); None: not recorded.
    config: dict[str, Any] | None = None
    # Where training started, one line: "scratch", "pretrained <dir>", "version <N>", "weights directory <path>".
    started_from: str | None = None
    # A LoRA adapter's frozen base (migration 0008): its registry version (None: not one) and weights digest.
    base_version: int | None = None
    base_digest: str | None = None


def origin(started_from: str | None, parent_version: int | None, init_digest: str | None) -> str:
    """Where a version's training started, for people: as recorded, or (versions published before revision
    0006 recorded no `started_from`) what its lineage says: a parent version, outside weights, or scratch."""
    if started_from:
        return started_from
    if parent_version is not None:
        return f"version {parent_version}"
    return "scratch" if init_digest is None else f"weights {init_digest[:12]} (not a registry version)"


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
    config: dict[str, Any] | None = None  # None: published before revision 0006, which did not record it
    started_from: str | None = None
    base_version: int | None = None  # the base a LoRA adapter needs (migration 0008); None: not an adapter
    base_digest: str | None = None
    created: bool = field(default=False, compare=False)  # this call inserted it (publish's answer, not a fact)

    @property
    def origin(self) -> str:
        return origin(self.started_from, self.parent_version, self.init_digest)

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
