"""A run in flight across an upgrade: the XComs its earlier tasks wrote (as untyped dicts, before the stage
results were typed) read back into the typed results, and write back the same JSON."""

from __future__ import annotations

import json
from pathlib import Path

from tasks.evaluate import Evaluated
from tasks.launch import Outcome
from tasks.models.resolve import load_config
from tasks.plan import Plan, plan
from tasks.stages.gate import GateDecision
from tasks.stages.housekeeping import Item, Pruned
from tasks.stages.lifecycle import Trained, Warmed
from tasks.stages.publish import PublishResult

# The XComs as the dict-passing stages wrote them (keys and shapes of main before issue 25).
WARM = {"dataset_dir": "/cache/datasets/abc", "manifest_hash": "m" * 64, "report": {"fetched": 3},
        "replay": [{"url": "s3://old", "manifest_hash": "r" * 64, "dataset_dir": "/cache/datasets/r"}]}
TRAIN = {"experiment_key": "k" * 64, "run": {"run_id": "r1"}, "started_from": "scratch", "steps": 4,
         "trained_steps": 4, "first_loss": 4.5, "final_loss": 3.25, "losses": [4.5, 4.0, 3.5, 3.25],
         "checkpoint_dir": "/runs/r1/checkpoints/step-000004", "checkpoint_tag": "step-000004",
         "resumed_from_step": None, "telemetry_path": "/runs/r1/telemetry.jsonl", "world_size": 2,
         "layout": {"tp": 1, "pp": 1, "dp": 2}, "export": {"staging": "s3://store/staging/x", "shards": []},
         "checkpoint_saves": 2, "resharded": False, "outcome": "trained"}
EVALUATE = {"metrics": {"heldout.loss": 3.3, "heldout.perplexity": 27.1, "heldout.tokens": 512.0},
            "live": {"version": 1, "metrics": {"heldout.loss": 3.4}, "cached": True}, "suite_hash": "s" * 64,
            "suites": [{"name": "heldout", "split": "heldout"}], "loss": 3.3, "perplexity": 27.1, "tokens": 512,
            "batches": 8, "batch_size": 8, "checkpoint_dir": "/runs/r1/checkpoints/step-000004",
            "checkpoint_tag": "step-000004", "step": 4, "experiment_key": "k" * 64}
DECISION = {"publish": True, "reason": "heldout.loss 3.3 <= live 3.4", "new_loss": 3.3, "live_loss": 3.4,
            "live_version": 1, "candidate_version": None,
            "rules": [{"rule": "evaluate.gate.rules[0]", "passed": True, "note": "ok"}]}
PUBLISHED = {"model": "tiny-llama", "alias": "production", "version": 2, "previous_version": 1,
             "artifact_url": "file:///store/d", "digest": "d" * 64, "created": True, "switched": True,
             "asset_uri": "retrainer://tiny-llama/production", "parent_version": 1, "started_from": "version 1"}


def test_xcoms_written_before_the_typed_results_read_back_unchanged() -> None:
    for kind, xcom in ((Warmed, WARM), (Trained, TRAIN), (Evaluated, EVALUATE), (GateDecision, DECISION),
                       (PublishResult, PUBLISHED)):
        result = kind.from_xcom(json.loads(json.dumps(xcom)))
        assert json.loads(json.dumps(result.to_xcom())) == xcom, kind.__name__

    trained, evaluated = Trained.from_xcom(TRAIN), Evaluated.from_xcom(EVALUATE)
    assert trained.checkpoint_dir == Path(TRAIN["checkpoint_dir"]) and trained.export == TRAIN["export"]
    assert evaluated.live is not None and evaluated.live.cached and evaluated.live.version == 1
    assert GateDecision.from_xcom(DECISION).rules[0]["passed"] is True


# The trigger's event as `follow` wrote it before its outcome was typed: cancelled as hung; ended by a rank's failure.
HUNG = {"hung": "no progress for 30 s after step 3", "rc": 1, "failure": None, "last_step": 3, "rank_failure": None,
        "preempted": False}
FAILED = {"rc": 1, "failure": None, "last_step": 2, "preempted": False,
          "rank_failure": {"rank": 1, "at": 1.5, "host": "gpu-07", "type": "IndexError", "message": "out of range",
                           "where": "tasks/models/gpt/model.py:57", "traceback": "Traceback ...", "exit_code": 1}}
# Housekeeping's XCom as the dict-returning stage wrote it: a prune, and a prune that failed.
PRUNED = {"pruned": [{"kind": "checkpoint", "url": "/runs/r1/ckpt/step-000002", "bytes": 1024,
                      "reason": "an intermediate checkpoint (tiny-llama v2 came from step-000004)"}], "bytes": 1024}
PRUNE_FAILED = {"pruned": [], "bytes": 0, "error": "permission denied"}


def test_the_trigger_event_the_housekeeping_and_the_plan_keep_their_json() -> None:
    for event in (HUNG, FAILED):
        assert json.loads(json.dumps(Outcome.from_dict(json.loads(json.dumps(event))).to_dict())) == event
    assert Outcome.from_dict(FAILED).rank_failure is not None and Outcome.from_dict(HUNG).hung == HUNG["hung"]
    assert Pruned((Item(**PRUNED["pruned"][0]),)).to_xcom() == PRUNED
    assert Pruned(error="permission denied").to_xcom() == PRUNE_FAILED
    assert Pruned().to_xcom() == {"pruned": [], "bytes": 0}
    # The plan stage's budget: read back by every later stage (Planned.from_xcom), written back the same.
    budget = json.loads(json.dumps(plan(load_config(Path(__file__).parents[2] / "configs" / "tiny-llama.yaml"),
                                        device="cpu").to_dict()))
    assert Plan.from_dict(budget).to_dict() == budget
