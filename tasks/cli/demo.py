"""`retrainer demo`: two weeks of scheduled retraining on the embedded default, a rollback, and a re-run.

What a platform team does with one config, in order: week 1's data lands at the
config's `data.source_url` and a run publishes version 1 (no live model yet: from
scratch); week 2's data replaces it at the same URL and the same config trains
version 2 *from version 1* (`train.init_from: live`); an operator rolls production
back to version 1; the scheduled run fires again on week 2's data and the gate
refuses to put the rolled-back version 2 back. Then the alias history and where the
live model is.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from tasks import REPO_ROOT

if TYPE_CHECKING:
    from tasks.config.schema import JobConfig


def _new_week_of_data(cfg: JobConfig, week: int) -> None:
    from tasks.data.synthetic import make_data

    make_data(cfg.data.source_url, name=cfg.name, seed=cfg.train.seed + week, storage_options=cfg.data.storage_options)


def _cmd_demo(args: argparse.Namespace) -> int:
    import sqlalchemy as sa

    from tasks.cli.demo_week import run_week
    from tasks.config.endpoints import registry_for
    from tasks.models.resolve import load_config
    from tasks.registry import upgrade
    from tasks.stages.lifecycle import stage_rollback

    if args.chat:
        from tasks.cli.demo_chat import chat_demo

        return chat_demo(args.config)
    cfg = load_config(args.config or REPO_ROOT / "configs" / "tiny-llama.yaml")
    upgrade(cfg.publish.registry_url)  # the demo sets up its embedded registry itself
    _new_week_of_data(cfg, 1)
    run_week(cfg, f"week 1: new data at {cfg.data.source_url}, scheduled run (init_from: {cfg.train.init_from})")
    _new_week_of_data(cfg, 2)
    run_week(cfg, "week 2: new data at the same URL, the same config")

    print("== rollback (the pointer-switch task): production misbehaves", flush=True)
    back = stage_rollback(cfg, reason="demo rollback")
    print(f"   {back.alias}: v{back.from_version} -> v{back.to_version}", flush=True)

    run_week(cfg, "week 2 again: the schedule fires on the same data after the rollback")

    registry = registry_for(cfg)
    print("== alias history (append-only)")
    for row in registry.history(cfg.publish.model_name, cfg.publish.alias):
        row = row.to_dict()
        print(f"   {row['at']}  {row['from_version']} -> {row['to_version']}  by {row['actor']}: {row['reason']}")
    print("== versions")
    for version in registry.list_versions(cfg.publish.model_name):
        print(f"   v{version.version} from {version.origin}: held-out loss {version.metrics['loss']:.4f}, "
              f"data manifest {version.data_manifest_hash[:12]}")
    live = registry.live_version(cfg.publish.model_name, cfg.publish.alias)
    assert live is not None
    print(f"live model: {cfg.publish.model_name} v{live.version} ({cfg.publish.alias}) "
          f"at {live.artifact_url} (sha256 {live.artifact_digest[:16]}...)")
    print(f"registry: {sa.make_url(cfg.publish.registry_url).render_as_string(hide_password=True)}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="two weeks of retraining on the embedded default, a rollback, a re-run")
    p.add_argument("--config", help="job config (default: configs/tiny-llama.yaml; with --chat "
                                    "configs/tiny-chat/job.yaml)")
    p.add_argument("--chat", action="store_true", help="a chat model retrained on conversations (assistant turns "
                                                        "only), gated on a generation check, then served")
    p.set_defaults(handler=_cmd_demo)
