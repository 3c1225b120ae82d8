"""What a published version was made from, as the datasets a lineage service draws: the data snapshot (and any
replayed ones) and the starting weights in, the version's artifact out.

Why here: the facts are the run's frozen identity and the publish's result; the Airflow side
(plugins/retrainer_airflow/lineage.py) only hands them to Airflow's lineage collector, which the OpenLineage
provider turns into the publish task's inputs and outputs when a transport is configured (README: Lineage).
A dataset is named by its storage URL (a plain path as `file://`), as the provider names s3 and file datasets;
the digests that pin what was read ride along as its facts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tasks.base.credentials import redact
from tasks.runs.identity import RunIdentity, StartingWeights
from tasks.stages.publish import PublishResult

Fact = str | int | float


@dataclass(frozen=True)
class LineageDataset:
    """One dataset of a lineage event: its storage URI and what identifies the exact content read or written."""

    uri: str
    facts: dict[str, Fact]


@dataclass(frozen=True)
class PublishLineage:
    inputs: tuple[LineageDataset, ...]
    outputs: tuple[LineageDataset, ...]


def storage_uri(location: str) -> str:
    """A storage location as a dataset URI: a URL as it is (any password redacted), a path as `file://`."""
    if "://" in location:
        return str(redact(location))
    return Path(location).absolute().as_uri()


def _weights(weights: StartingWeights | None, role: str) -> list[LineageDataset]:
    if weights is None or weights.scratch or not weights.url:
        return []
    facts: dict[str, Fact] = {"role": role, "sha256": str(weights.digest)}
    if weights.version is not None:
        facts["version"] = weights.version
    return [LineageDataset(storage_uri(weights.url), facts)]


def publish_lineage(run: RunIdentity, result: PublishResult) -> PublishLineage:
    """The published version's lineage: its training data (manifest digest), replayed snapshots, its starting
    weights (and a LoRA run's frozen base) in; the version's artifact (model, version, digest) out."""
    inputs = [LineageDataset(storage_uri(run.data_url), {"role": "training data",
                                                        "manifest_sha256": run.data_manifest_hash})]
    inputs += [LineageDataset(storage_uri(r.url), {"role": "replayed data", "manifest_sha256": r.manifest_hash,
                                                   "weight": r.weight}) for r in run.replay]
    inputs += _weights(run.init, "starting weights")
    if run.base is not None and run.base != run.init:
        inputs += _weights(run.base, "LoRA base")
    out: dict[str, Fact] = {"model": result.model, "version": result.version, "sha256": result.digest}
    if result.switched:
        out["alias"] = result.alias
    return PublishLineage(tuple(inputs), (LineageDataset(storage_uri(result.artifact_url), out),))
