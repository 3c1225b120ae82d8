"""The task process of the fault suite: runs named lifecycle stages, the way a DAG's tasks call them.

`python -m tests.faults.driver CONFIG STATE_DIR STAGE [STAGE ...] [--metrics FILE]`

Each stage's output is written to `STATE_DIR/<stage>.json` (atomically, like an XCom), and the next
stage reads it from there, so a later process can pick up where a killed one stopped. `plan` freezes the
run's identity (data manifest hash, starting weights) as the DAG's plan task does; a later stage without
a plan (or whose config file was edited into another experiment since) plans first, as a new DAG run
would. Each stage reads the config file itself (a test may point the same run at another registry).
`--metrics` gives publish its metrics from a file instead of an evaluate stage (tests about publish alone).
Errors end the process the way the `retrainer` CLI does: one line on stderr and the error's exit code.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from tasks.base.errors import ConfigError, RetrainerError
from tasks.base.fsutil import atomic_write_json
from tasks.evaluate import Evaluated
from tasks.models.resolve import load_config
from tasks.runs.identity import RunIdentity
from tasks.stages import lifecycle
from tests import hooks

STAGES = ("plan", "warm", "train", "evaluate", "gate", "publish", "rollback")


def run_stage(stage: str, config: Path, state: Path, metrics_file: Path | None) -> dict[str, Any]:
    cfg = load_config(config)

    def prior(name: str) -> dict[str, Any]:
        return json.loads((state / f"{name}.json").read_text())

    if stage == "plan":
        run = lifecycle.stage_identify(cfg)
        return {"run": run.to_dict(), "budget": lifecycle.stage_plan(cfg, run).to_dict()}
    if stage == "rollback":
        return lifecycle.stage_rollback(cfg, actor="fault-suite").to_dict()
    plan_path = state / "plan.json"
    if not plan_path.exists() or prior("plan")["run"]["config_fingerprint"] != cfg.fingerprint():
        atomic_write_json(plan_path, run_stage("plan", config, state, metrics_file))
    run = RunIdentity.from_dict(prior("plan")["run"])
    # Each stage's result is kept as the JSON its XCom has, as between Airflow tasks.
    if stage == "warm":
        return lifecycle.stage_warm(cfg, run).to_xcom()
    warmed = lifecycle.Warmed.from_xcom(prior("warm"))
    if stage == "train":
        return lifecycle.stage_train(cfg, run, warmed, holder=f"fault-suite driver {state.name}").to_xcom()
    if stage == "evaluate":
        return lifecycle.stage_evaluate(cfg, run, lifecycle.Trained.from_xcom(prior("train")), warmed).to_xcom()
    if stage == "gate":
        return lifecycle.stage_gate(cfg, run, Evaluated.from_xcom(prior("evaluate"))).to_xcom()
    if stage == "publish":
        metrics = json.loads(metrics_file.read_text()) if metrics_file else prior("evaluate")
        return lifecycle.stage_publish(cfg, run, lifecycle.Trained.from_xcom(prior("train")),
                                       Evaluated.from_xcom(metrics), actor="fault-suite").to_xcom()
    raise ValueError(stage)


def main(argv: list[str] | None = None) -> int:
    hooks.install()  # the fault suite's hooks (HOOK_* variables), on the driver and its ranks
    parser = argparse.ArgumentParser(prog="tests.faults.driver")
    parser.add_argument("config", type=Path)
    parser.add_argument("state", type=Path)
    parser.add_argument("stages", nargs="+", choices=STAGES)
    parser.add_argument("--metrics", type=Path)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args.state.mkdir(parents=True, exist_ok=True)
    try:
        for stage in args.stages:
            logging.getLogger("fault-driver").info("stage %s starts", stage)
            out = run_stage(stage, args.config, args.state, args.metrics)
            atomic_write_json(args.state / f"{stage}.json", out)
            logging.getLogger("fault-driver").info("stage %s done", stage)
    except ConfigError as exc:
        print(f"retrainer: error: {exc}", file=sys.stderr)
        return 2
    except RetrainerError as exc:
        print(f"retrainer: error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
