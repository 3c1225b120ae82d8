"""`retrainer demo`: the whole lifecycle on the embedded default, twice, then a rollback.

Makes the dataset if the object store has none, runs plan -> warm -> train ->
evaluate -> gate -> publish with half the configured steps (version 1) and then
with all of them (version 2, through the gate), rolls the alias back to
version 1, and prints the registry's history and where the published model is.
"""

from __future__ import annotations

import argparse
import logging

import sqlalchemy as sa

from tasks.lifecycle import DEFAULT_CONFIG, registry_for, resolve_config, run_lifecycle, stage_rollback

log = logging.getLogger(__name__)


def _ensure_dataset(cfg) -> None:
    import fsspec

    from tasks.data import make_data

    fs, root = fsspec.core.url_to_fs(cfg.data.source_url, **cfg.data.storage_options)
    if fs.exists(f"{root.rstrip('/')}/{cfg.data.manifest}"):
        log.info("demo: dataset already in the object store at %s", cfg.data.source_url)
        return
    make_data(cfg.data.source_url, name=cfg.name, seed=cfg.train.seed, storage_options=cfg.data.storage_options)


def _cmd_demo(args: argparse.Namespace) -> int:
    cfg = resolve_config(args.config)
    _ensure_dataset(cfg)
    outcomes = []
    for steps in (max(1, cfg.train.steps // 2), cfg.train.steps):
        print(f"== lifecycle run: {steps} steps (plan -> warm -> train -> evaluate -> gate -> publish)", flush=True)
        out = run_lifecycle(cfg.with_overrides({"train.steps": steps}))
        outcomes.append(out)
        gate = out["gate"]
        print(f"   held-out loss {out['evaluate']['loss']:.4f}; gate: {gate['reason']}", flush=True)
        if "publish" in out:
            pub = out["publish"]
            print(f"   published {pub['model']} v{pub['version']} -> {pub['alias']}: {pub['artifact_url']}",
                  flush=True)
    print("== rollback (the pointer-switch task)", flush=True)
    back = stage_rollback(cfg, reason="demo rollback")
    print(f"   {back['alias']}: v{back['from_version']} -> v{back['to_version']}", flush=True)

    registry = registry_for(cfg)
    print("== alias history (append-only)")
    for row in registry.history(cfg.publish.model_name, cfg.publish.alias):
        row = row.to_dict()
        print(f"   {row['at']}  {row['from_version']} -> {row['to_version']}  by {row['actor']}: {row['reason']}")
    live = registry.live_version(cfg.publish.model_name, cfg.publish.alias)
    assert live is not None
    print(f"live model: {cfg.publish.model_name} v{live.version} ({cfg.publish.alias}) "
          f"at {live.artifact_url} (sha256 {live.artifact_digest[:16]}...)")
    print(f"registry: {sa.make_url(cfg.publish.registry_url).render_as_string(hide_password=True)}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run the whole lifecycle twice on the embedded default, then roll back")
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="job config (default: configs/tiny-gpt.yaml)")
    p.set_defaults(handler=_cmd_demo)
