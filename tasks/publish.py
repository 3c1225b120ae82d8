"""Publish stage: upload a finished checkpoint, record an immutable version, move the alias.

The order is the protocol: 1) content-addressed upload, 2) insert the version
(idempotent on the artifact digest), 3) switch the alias with a compare-and-swap
on the version that was live when publish started. A crash between 2 and 3 leaves
an unpointed version (harmless; a re-run picks it up), never a dangling pointer.
"""

from __future__ import annotations

import getpass
import json
import logging
import os
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tasks.config import JobConfig
from tasks.errors import InvalidInputError
from tasks.registry import ArtifactStore, Lineage, Registry, alias_asset_uri, upgrade
from tasks.registry.core import check_metrics

log = logging.getLogger(__name__)

ARTIFACT_NAME = "consolidated.pt"
COMPLETE_MARKER = "COMPLETE"
FAULT_ENV = "RETRAINER_FAULT"  # test-only fault injection point
FAULT_RELEASE_ENV = "RETRAINER_FAULT_RELEASE"  # optional: a file whose appearance releases the fault


@dataclass(frozen=True)
class PublishResult:
    model: str
    alias: str
    version: int
    previous_version: int | None
    artifact_url: str
    digest: str
    created: bool
    switched: bool
    asset_uri: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def default_actor() -> str:
    try:
        return os.environ.get("RETRAINER_ACTOR") or getpass.getuser()
    except (KeyError, OSError):
        return "unknown"


def code_revision() -> str:
    """RETRAINER_CODE_REVISION, else the git HEAD of this checkout, else 'unknown'."""
    if rev := os.environ.get("RETRAINER_CODE_REVISION"):
        return rev
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, capture_output=True,
            text=True, timeout=10, check=True,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def read_complete_marker(checkpoint_dir: Path) -> dict[str, Any]:
    """The checkpoint's completion marker; refuse a directory without a valid one."""
    marker = checkpoint_dir / COMPLETE_MARKER
    if not checkpoint_dir.is_dir():
        raise InvalidInputError(f"{checkpoint_dir}: checkpoint directory does not exist")
    if not marker.is_file():
        raise InvalidInputError(f"{checkpoint_dir}: no {COMPLETE_MARKER} marker; the checkpoint is incomplete")
    try:
        data = json.loads(marker.read_text())
    except (OSError, ValueError) as exc:
        raise InvalidInputError(f"{marker}: unreadable completion marker: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidInputError(f"{marker}: completion marker must be a JSON object")
    return data


def _fault(point: str) -> None:
    """Test hook: block at `point` (forever, or until the release file exists) so a test can act there."""
    if os.environ.get(FAULT_ENV) != point:
        return
    release = os.environ.get(FAULT_RELEASE_ENV)
    log.warning("fault injection: blocking at %s", point)
    while not (release and os.path.exists(release)):
        time.sleep(0.05)


def publish(
    cfg: JobConfig,
    checkpoint_dir: Path,
    metrics: dict[str, Any],
    *,
    data_manifest_hash: str,
    serving_bytes: int | None = None,
    actor: str | None = None,
    reason: str = "publish",
    registry_url: str | None = None,
) -> PublishResult:
    """Publish `checkpoint_dir/consolidated.pt` as the next version and point `cfg.publish.alias` at it."""
    checkpoint_dir = Path(checkpoint_dir)
    actor = actor or default_actor()
    marker = read_complete_marker(checkpoint_dir)
    key = cfg.experiment_key()
    if marker.get("experiment_key") != key:
        raise InvalidInputError(
            f"{checkpoint_dir}: checkpoint from another model/experiment "
            f"(marker experiment_key {str(marker.get('experiment_key'))[:16]}..., config {key[:16]}...)"
        )
    metrics = check_metrics(metrics)
    artifact = checkpoint_dir / ARTIFACT_NAME
    if not artifact.is_file():
        raise InvalidInputError(f"{artifact}: consolidated weights missing from the checkpoint")

    pub = cfg.publish
    url = registry_url or pub.registry_url
    upgrade(url)
    with Registry(url) as reg:
        live = reg.live_version(pub.model_name, pub.alias)
        previous = live.version if live else None
        ref = ArtifactStore(pub.store_url, pub.storage_options).put(artifact)
        lineage = Lineage(
            config_hash=key, data_manifest_hash=data_manifest_hash, code_revision=code_revision(),
            checkpoint_tag=checkpoint_dir.name, serving_bytes=serving_bytes,
        )
        record = reg.publish_version(pub.model_name, ref, lineage, metrics, created_by=actor)
        _fault("after_version_insert")
        switched = False
        if previous != record.version:
            reg.switch_alias(pub.model_name, pub.alias, record.version, expect=previous, actor=actor,
                             reason=reason, action="publish")
            switched = True
    return PublishResult(
        model=pub.model_name, alias=pub.alias, version=record.version, previous_version=previous,
        artifact_url=ref.url, digest=ref.digest, created=record.created, switched=switched,
        asset_uri=alias_asset_uri(pub.model_name, pub.alias),
    )
