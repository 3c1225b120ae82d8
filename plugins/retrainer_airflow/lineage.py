"""A publish's lineage handed to Airflow's lineage collector (tasks/stages/lineage.py says what it holds).

Airflow's collector is a no-op unless a lineage reader is installed: with the OpenLineage provider configured
(`AIRFLOW__OPENLINEAGE__TRANSPORT`, README: Lineage), the publish task's COMPLETE event carries these datasets as
its inputs and outputs, so a lineage backend draws data snapshot -> retrain_<model>.publish -> model version.
"""

from __future__ import annotations

from airflow.sdk import ObjectStoragePath
from airflow.sdk.lineage import get_hook_lineage_collector

from tasks.stages.lineage import PublishLineage


def report_lineage(lineage: PublishLineage) -> None:
    """Record the inputs and outputs on this task's collector (each under its storage path as the context)."""
    collector = get_hook_lineage_collector()
    for dataset in lineage.inputs:
        collector.add_input_asset(ObjectStoragePath(dataset.uri), uri=dataset.uri, asset_extra=dict(dataset.facts))
    for dataset in lineage.outputs:
        collector.add_output_asset(ObjectStoragePath(dataset.uri), uri=dataset.uri, asset_extra=dict(dataset.facts))
