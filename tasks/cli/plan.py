"""`retrainer plan CONFIG`: the budget (tasks/plan/), exit 0 fits / 3 does not fit / 2 invalid input, once the data
the config names has been checked against the model where this machine's cache holds it already.

Why the check is here: it reads the warm's record of a cached dataset (its largest token ids,
tasks/data/warm_state.py), a layer above the planner. A dataset cached for a model with a larger vocabulary is
refused, naming the dataset, its largest id and `model.vocab_size`, before anything is warmed or any rank starts;
data not cached yet (or not readable now) is the warm's to check. `python -m tasks.cli.plan CONFIG ...` is the
budget alone (`main`).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import TYPE_CHECKING, Any

from tasks.base.dataset_format import PlannedData
from tasks.base.errors import ConfigError, InvalidInputError, RetrainerError

if TYPE_CHECKING:
    from tasks.config.schema import JobConfig

log = logging.getLogger(__name__)

EXIT_FITS, EXIT_INVALID, EXIT_DOES_NOT_FIT = 0, 2, 3


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plan", help="preflight: memory/communication budget, refuse doomed launches, rank layouts",
        description="Budget a launch per GPU and per step. Exit 0 fits, 3 does not fit, 2 invalid input.",
    )
    p.add_argument("config", help="job config YAML")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--gpus", type=int, help="GPU count the layout must match (tp x pp x dp), instead of the "
                   "cluster's nodes x ranks per node")
    p.add_argument("--search", type=int, metavar="GPUS", help="rank feasible (tp, pp, dp, micro-batch) layouts")
    p.add_argument("--top", type=int, default=10, help="with --search: how many layouts to show")
    p.add_argument("--tp", type=int)
    p.add_argument("--pp", type=int)
    p.add_argument("--dp", type=int)
    p.add_argument("--zero", type=int, help="ZeRO stage override")
    p.add_argument("--micro-batch", type=int, help="train.micro_batch_size override")
    p.add_argument("--micro-batches", type=int, help="parallel.micro_batches override")
    p.add_argument("--device", choices=["cpu", "gpu"], help="what the ranks compute on (default: cluster.device, "
                   "else the GPUs the engine asks for, else this machine)")
    p.add_argument("--attention", choices=["sdpa", "materialized"], default="sdpa",
                   help="activation model: fused SDPA (our model) or materialised s x s scores")
    p.add_argument("--reserve-gib", type=float, default=0.0, help="memory kept back per GPU")
    p.add_argument("--serve-concurrency", type=int, help="serving.concurrency override")
    p.add_argument("--serve-context", type=int, help="serving.context_len override")
    p.add_argument("--serve-dtype", help="serving.dtype override")
    p.set_defaults(handler=_handle)


def _handle(args: argparse.Namespace) -> int:
    from tasks.data.sources import planned_data, refuse_cached, suite_sources, training_sources
    from tasks.data.warm import remote_manifest_hash

    cfg = configured(args)
    planned = []
    for source in [*training_sources(cfg), *suite_sources(cfg)]:
        try:
            planned.append((source, remote_manifest_hash(source.source_url, source.manifest,
                                                         source.storage_options)))
        except RetrainerError as exc:  # nothing there (yet) to have been cached; the warm says what is wrong
            log.debug("plan: %s not checked against the cache: %s", source.field, exc)
    refuse_cached(cfg, planned)
    try:  # planned as the plan stage plans it: packed conversations, and the windows every rank indexes
        data = planned_data(cfg)
    except RetrainerError as exc:
        log.debug("plan: the training data not read (%s); planned as plain text, its index not counted", exc)
        data = PlannedData()
    return report(args, cfg, data)


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    pairs = {
        "parallel.tp": args.tp, "parallel.pp": args.pp, "parallel.dp": args.dp,
        "parallel.zero_stage": args.zero, "train.micro_batch_size": args.micro_batch,
        "parallel.micro_batches": args.micro_batches, "serving.concurrency": args.serve_concurrency,
        "serving.context_len": args.serve_context, "serving.dtype": args.serve_dtype,
    }
    return {k: v for k, v in pairs.items() if v is not None}


def configured(args: argparse.Namespace) -> JobConfig:
    """The job config the arguments name, with their overrides."""
    from tasks.models.resolve import load_config

    if args.reserve_gib < 0:
        raise InvalidInputError(f"--reserve-gib must be >= 0, got {args.reserve_gib}")
    cfg = load_config(args.config)
    overrides = _overrides(args)
    return cfg.with_overrides(overrides) if overrides else cfg


def report(args: argparse.Namespace, cfg: JobConfig, data: PlannedData = PlannedData()) -> int:
    """Print the budget (or the ranked layouts) of a run on `data`; the exit code says whether it fits."""
    from tasks.plan.budget import plan
    from tasks.plan.render import render, render_search, shortfall
    from tasks.plan.search import search
    from tasks.plan.serving import serving_estimate

    serving = serving_estimate(cfg)
    if args.search is not None:
        ranked = search(cfg, args.search, device=args.device, reserve_gib=args.reserve_gib,
                        attention=args.attention, data=data)
        if args.json:
            print(json.dumps({"gpus": args.search, "plans": [r.to_dict() for r in ranked[: args.top]],
                              "feasible": len(ranked), "serving": serving}, indent=2))
        else:
            print(render_search(ranked[: args.top], args.search, len(ranked)))
        return EXIT_FITS if ranked else EXIT_DOES_NOT_FIT
    result = plan(cfg, world_size=args.gpus, device=args.device, reserve_gib=args.reserve_gib,
                  attention=args.attention, data=data)
    if args.json:
        print(json.dumps({**result.to_dict(), "serving": serving}, indent=2))
    else:
        print(render(result, serving))
    if not result.fits:
        print(f"retrainer: plan does not fit: {shortfall(result)}", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    return EXIT_FITS


def main(argv: list[str] | None = None) -> int:
    """`python -m tasks.cli.plan CONFIG ...`: the budget alone (no cache check), with the same exit codes as
    `retrainer`."""
    parser = argparse.ArgumentParser(prog="retrainer")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", *(sys.argv[1:] if argv is None else argv)])
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    try:
        return report(args, configured(args))
    except ConfigError as exc:
        print(f"retrainer: error: {exc}", file=sys.stderr)
        return EXIT_INVALID
    except RetrainerError as exc:
        print(f"retrainer: error: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
