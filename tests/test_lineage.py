"""The publish's lineage (tasks/stages/lineage.py) for every kind of run a team has: what goes in, what comes out,
and no credential in a dataset name. The standalone test reads the same datasets from OpenLineage's events."""

from __future__ import annotations

from pathlib import Path

from tasks.base.credentials import REDACTED
from tasks.runs.identity import ReplayData, RunIdentity, StartingWeights
from tasks.stages.lineage import publish_lineage, storage_uri
from tasks.stages.publish import PublishResult


def published(version: int, switched: bool = True) -> PublishResult:
    return PublishResult(model="m", alias="production", version=version, previous_version=version - 1,
                         artifact_url=f"s3://models/trees/d{version}", digest=f"d{version}", created=True,
                         switched=switched, asset_uri="model://m/production", parent_version=version - 1,
                         started_from=f"version {version - 1}")


def test_a_lora_run_on_replayed_data_names_every_input_and_its_version_out(tmp_path: Path) -> None:
    base = StartingWeights(requested="/models/base", digest="b" * 64, url="/models/base", kind="pretrained")
    adapter = StartingWeights(requested="live", version=3, digest="a" * 64, url="s3://models/trees/d3")
    run = RunIdentity(experiment_key="k" * 64, config_fingerprint="f", data_manifest_hash="n" * 64,
                      data_url="s3://data/week-49", init=adapter, base=base,
                      replay=(ReplayData("s3://data/week-48", "o" * 64, 0.25),))
    lineage = publish_lineage(run, published(4))
    assert [(d.uri, d.facts.get("role")) for d in lineage.inputs] == [
        ("s3://data/week-49", "training data"), ("s3://data/week-48", "replayed data"),
        ("s3://models/trees/d3", "starting weights"), ("file:///models/base", "LoRA base")]
    assert lineage.inputs[0].facts["manifest_sha256"] == "n" * 64 and lineage.inputs[2].facts["version"] == 3
    [out] = lineage.outputs
    assert out.uri == "s3://models/trees/d4" and out.facts == {"model": "m", "version": 4, "sha256": "d4",
                                                               "alias": "production"}


def test_a_scratch_run_has_only_its_data_in_and_an_unswitched_version_names_no_alias(tmp_path: Path) -> None:
    run = RunIdentity(experiment_key="k" * 64, config_fingerprint="f", data_manifest_hash="n" * 64,
                      data_url=str(tmp_path / "data"), init=StartingWeights(requested="scratch"))
    lineage = publish_lineage(run, published(1, switched=False))
    assert [d.uri for d in lineage.inputs] == [(tmp_path / "data").as_uri()]
    assert "alias" not in lineage.outputs[0].facts


def test_a_password_in_a_url_never_names_a_dataset() -> None:
    assert storage_uri("https://user:hunter2@host/data") == f"https://user:{REDACTED}@host/data"
    assert "hunter2" not in storage_uri("s3://bucket/data?X-Amz-Signature=hunter2")
