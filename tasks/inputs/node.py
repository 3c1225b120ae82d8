"""Warm on a training node: the datasets (the primary and any `data.replay` sources) and the starting
weights onto the node's own `data.cache_dir` (and a continued LoRA adapter into the run directory).

Why on the node: the point of warming is that the GPUs read their data from local SSD; a warm on the
Airflow worker fills the wrong machine's disk. Each launcher runs this once per node before the ranks
start (ssh: one per host under the node agent; Slurm: an `srun --ntasks-per-node=1` staging step in the
same allocation; Kubernetes: an init container), with the same verified, incremental, lock-protected
warm as everywhere (tasks/data/warm.py), each dataset checked against the model (its splits hold tokens,
every token id below `model.vocab_size`) before any of it is committed. The spec arrives in the
environment (`RETRAINER_WARM_SPEC`, never argv, never a file: it may hold storage credentials). The
node prints one `RETRAINER-WARM {json}` line (node, files, bytes, seconds, MB/s, the manifest hash it
verified; each replay source's under "replay") and, with `--report-dir`, writes it to
`<dir>/<node>.json`; a node that verified another manifest than the run planned (for any source) refuses,
naming itself, and (with `--status-dir`) says so in the run's status file, so no rank starts on other data.

    RETRAINER_WARM_SPEC='{...}' python -m tasks.inputs.node [--report-dir DIR] [--status-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from tasks.base.errors import RetrainerError
from tasks.base.fsutil import atomic_write_json
from tasks.base.job_status import Status, log_for_relay, now, parse_tagged, print_line, write_status
from tasks.data.report import refuse_unplanned
from tasks.data.sources import DataSource, training_sources
from tasks.runs.identity import StartingWeights

log = logging.getLogger("tasks.inputs.node")

SPEC_VAR = "RETRAINER_WARM_SPEC"
REPORT_PREFIX = "RETRAINER-WARM "
REPORT_DIR = "warm"  # <output_dir>/warm/<node>.json, where the staging step and init container report
# Storage credentials a node's warm may take from the launcher's environment (s3fs/obstore read them).
FORWARD_PREFIXES = ("AWS_",)


def forwarded_env() -> dict[str, str]:
    """The launcher's storage credentials a node's warm gets in its environment (never argv, never a file)."""
    return {k: v for k, v in os.environ.items() if k.startswith(FORWARD_PREFIXES)}


def node_spec(cfg: Any, run: Any, run_dir: Path) -> dict[str, Any]:
    """What one node needs to warm for a run: the datasets it must verify (the primary and each replay source
    of the mixture, with the manifest hash the run planned), the weights its ranks load and, for a LoRA run
    continuing a version's adapter, that adapter (megabytes) and where in `run_dir` they read it."""
    from dataclasses import asdict

    # lazy: the registry's modules load only when nodes warm
    from tasks.inputs.adapter import continues_adapter, start_adapter_dir, weights_to_load
    from tasks.inputs.weights import WeightSources

    d = cfg.data
    primary, *sources = training_sources(cfg)
    replay = [{**asdict(source), "manifest_hash": planned.manifest_hash}
              for source, planned in zip(sources, run.replay, strict=True)]
    return {
        **asdict(primary), "cache_dir": d.cache_dir, "disk_budget_bytes": d.disk_budget_bytes,
        "vocab_size": cfg.model.vocab_size, "seq_len": cfg.model.seq_len, "manifest_hash": run.data_manifest_hash,
        "replay": replay,
        "init": asdict(weights_to_load(cfg, run)),
        "weights": asdict(WeightSources.of(cfg)),
        "adapter": {"version": asdict(run.init), "dest": str(start_adapter_dir(run_dir))}
        if cfg.train.lora is not None and continues_adapter(run.init, run.base) else None,
    }


def node_name() -> str:
    """How this node is named in reports: NODE_NAME (set by the launcher or the downward API), else hostname."""
    return os.environ.get("NODE_NAME") or socket.gethostname()


def warm_node(spec: dict[str, Any]) -> dict[str, Any]:
    """Warm this node for the run; the report, or RetrainerError naming the node."""
    # lazy: launchers import this module for its names; the warm and fetch machinery loads on the node only
    from tasks.data.warm import warm_sources
    from tasks.inputs.adapter import fetch_adapter
    from tasks.inputs.weights import WeightSources, fetch_weights

    node, started = node_name(), time.monotonic()
    sources = [spec, *spec.get("replay", [])]
    results = warm_sources([DataSource.from_dict(s) for s in sources], spec["cache_dir"],
                           vocab_size=spec["vocab_size"], disk_budget_bytes=spec["disk_budget_bytes"],
                           seq_len=spec.get("seq_len"), progress=False)  # absent: a spec from before it
    for source, result in zip(sources, results, strict=True):
        refuse_unplanned(result.manifest_hash, source["manifest_hash"], source["source_url"], f"node {node}")
    weights = fetch_weights(StartingWeights(**spec["init"]), WeightSources(**spec["weights"]))
    if (adapter := spec.get("adapter")) is not None:
        fetch_adapter(StartingWeights(**adapter["version"]), WeightSources(**spec["weights"]), Path(adapter["dest"]))
    r = results[0].report
    return {"node": node, "manifest_hash": results[0].manifest_hash, "dataset_dir": str(results[0].dataset_dir),
            "files": r.files_total, "bytes": r.bytes_total, "files_fetched": r.files_fetched,
            "bytes_fetched": r.bytes_fetched, "seconds": round(time.monotonic() - started, 3),
            "mb_per_s": round(r.mb_per_s, 1), "weights_dir": str(weights) if weights else None,
            "replay": [{"manifest_hash": x.manifest_hash, "dataset_dir": str(x.dataset_dir),
                        "files": x.report.files_total, "bytes": x.report.bytes_total,
                        "bytes_fetched": x.report.bytes_fetched} for x in results[1:]]}


def parse_report(line: str) -> dict[str, Any] | None:
    """The report of a `RETRAINER-WARM` line, else None."""
    return parse_tagged(line, REPORT_PREFIX)


def describe(report: dict[str, Any]) -> str:
    """One progress line for the task log."""
    replay = report.get("replay") or []
    extra = (f"; replay {', '.join(x['manifest_hash'][:12] for x in replay)} "
             f"({sum(x['bytes'] for x in replay) / 1e6:.1f} MB)") if replay else ""
    return (f"warm on node {report['node']}: {report['files']} files, {report['bytes'] / 1e6:.1f} MB "
            f"({report['bytes_fetched'] / 1e6:.1f} MB fetched, {report['mb_per_s']:.1f} MB/s, "
            f"{report['seconds']:.1f}s), manifest {report['manifest_hash'][:12]}{extra}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tasks.inputs.node")
    parser.add_argument("--report-dir", type=Path, help="also write the report to DIR/<node>.json")
    parser.add_argument("--status-dir", type=Path, help="on failure, write the reason to the run's status file")
    args = parser.parse_args(argv)
    log_for_relay(node_name())
    try:
        spec = json.loads(os.environ[SPEC_VAR])
        report = warm_node(spec)
    except (RetrainerError, KeyError, ValueError, OSError) as exc:
        reason = str(exc) if isinstance(exc, RetrainerError) else f"node {node_name()}: warm failed: {exc!r}"
        print_line(REPORT_PREFIX + json.dumps({"node": node_name(), "error": reason}))
        if args.status_dir is not None:
            write_status(args.status_dir, Status(state="failed", step=0, steps=0, at=now(), reason=reason))
        return 1
    if args.report_dir is not None:
        args.report_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(args.report_dir / f"{report['node']}.json", report)
    print_line(REPORT_PREFIX + json.dumps(report))
    log.info("%s", describe(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
