"""`retrainer plan CONFIG`: print the budget, exit 0 fits / 3 does not fit / 2 invalid input.

`retrainer plan` first refuses cached data the model cannot read (tasks/cli/plan.py: the warm's record sits
above this layer); `python -m tasks.plan` is the budget alone.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from tasks.base.errors import InvalidInputError, RetrainerError
from tasks.base.layout import describe_record
from tasks.config import ConfigError, JobConfig
from tasks.models.resolve import load_config
from tasks.plan.budget import Plan, plan
from tasks.plan.search import search
from tasks.plan.serving import serving_estimate

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
    p.add_argument("--device", choices=["cpu", "gpu"], help="resolves precision auto (default: detect)")
    p.add_argument("--attention", choices=["sdpa", "materialized"], default="sdpa",
                   help="activation model: fused SDPA (our model) or materialised s x s scores")
    p.add_argument("--reserve-gib", type=float, default=0.0, help="memory kept back per GPU")
    p.add_argument("--serve-concurrency", type=int, help="serving.concurrency override")
    p.add_argument("--serve-context", type=int, help="serving.context_len override")
    p.add_argument("--serve-dtype", help="serving.dtype override")
    p.set_defaults(handler=run)


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
    if args.reserve_gib < 0:
        raise InvalidInputError(f"--reserve-gib must be >= 0, got {args.reserve_gib}")
    cfg = load_config(args.config)
    overrides = _overrides(args)
    return cfg.with_overrides(overrides) if overrides else cfg


def run(args: argparse.Namespace) -> int:
    return report(args, configured(args))


def report(args: argparse.Namespace, cfg: JobConfig) -> int:
    """Print the budget (or the ranked layouts); the exit code says whether it fits."""
    serving = serving_estimate(cfg)
    if args.search is not None:
        ranked = search(cfg, args.search, device=args.device, reserve_gib=args.reserve_gib,
                        attention=args.attention)
        if args.json:
            print(json.dumps({"gpus": args.search, "plans": [r.to_dict() for r in ranked[: args.top]],
                              "feasible": len(ranked), "serving": serving}, indent=2))
        else:
            print(render_search(ranked[: args.top], args.search, len(ranked)))
        return EXIT_FITS if ranked else EXIT_DOES_NOT_FIT
    result = plan(cfg, world_size=args.gpus, device=args.device, reserve_gib=args.reserve_gib,
                  attention=args.attention)
    if args.json:
        print(json.dumps({**result.to_dict(), "serving": serving}, indent=2))
    else:
        print(render(result, serving))
    if not result.fits:
        o = result.overflow or {}
        print(f"retrainer: plan does not fit: {_gib(o.get('by_bytes', 0))} over capacity; "
              f"largest term {o.get('term')}", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    return EXIT_FITS


def _gib(n: float) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1."""
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} us"


def render(r: Plan, serving: dict[str, Any] | None = None) -> str:
    """A short human table."""
    lay = r.layout
    m, s = r.memory, r.step
    lines = [
        f"plan {r.config_name}: {r.verdict.upper()}  ({describe_record(lay)} "
        f"zero={lay['zero_stage']} micro_batches={lay['micro_batches']} mbs={lay['micro_batch_size']}, "
        f"{r.precision}, {r.world_size} GPU)",
        f"params: {r.params_total:,} total (model family {r.model_family}), {r.params_per_rank:,} on the busiest "
        f"rank ({r.busiest_rank})",
        "memory per GPU:",
    ]
    for name in ("weights", "gradients", "optimizer_states", "activations", "comm_buffers"):
        lines.append(f"  {name:<18} {_gib(getattr(m, name)):>14}")
    lines.append(f"  {'total':<18} {_gib(m.total):>14}  of {_gib(m.capacity)} ({m.total / m.capacity:.1%})")
    lines.append(f"  (activations without / with recompute: {_gib(m.activations_without_recompute)} / "
                 f"{_gib(m.activations_with_recompute)})")
    lines.append(f"process per rank (host RSS): runtime {_gib(m.process_runtime)}, ZeRO step buffers "
                 f"{_gib(m.zero_step_buffers)}, checkpoint snapshot {_gib(m.checkpoint_snapshot)}, "
                 f"weights file pages {_gib(m.weights_file_pages)}; "
                 f"peak {_gib(m.process_peak)} ({m.process_phase})")
    lines += [
        "per step:",
        f"  FLOPs {s.flops_total:.3e} ({s.flops_per_gpu:.3e}/GPU), compute {_ms(s.compute_s)}",
        f"  DP grads {_gib(s.dp_grad_payload_bytes)} payload, {_gib(s.dp_ring_bytes)} on the wire, "
        f"{_ms(s.dp_comm_s)}",
        f"  TP {_gib(s.tp_collective_bytes)} {_ms(s.tp_comm_s)}; PP p2p {_gib(s.pp_p2p_bytes)} {_ms(s.pp_comm_s)}",
        f"  bubble {s.bubble_fraction:.1%}, communication share {s.comm_share:.1%}, step ~{_ms(s.step_s)}",
    ]
    if r.evaluation:
        ev, el = r.evaluation, r.evaluation["layout"]
        lines.append(f"evaluation ranks ({describe_record(el)}, {ev['dtype']}): weights "
                     f"{_gib(ev['weights'])} + activations {_gib(ev['activations'])} + logits {_gib(ev['logits'])} "
                     f"= {_gib(ev['total'])} on stage {ev['stage']}; process per rank (host RSS): runtime "
                     f"{_gib(ev['runtime'])}, peak {_gib(ev['process_total'])}")
    if serving:
        lines.append(f"serving ({serving['dtype']}): weights {_gib(serving['weights_bytes'])} + KV "
                     f"{serving['kv_cache_bytes_per_token']} B/token x {serving['concurrency']} x "
                     f"{serving['context']} = {_gib(serving['serving_bytes'])}")
    if r.overflow:
        o = r.overflow
        lines.append(f"DOES NOT FIT: {_gib(o['by_bytes'])} over on stage {o['stage']}; largest term {o['term']} "
                     f"({_gib(o['term_bytes'])})")
    lines += [f"warning: {w}" for w in r.warnings]
    return "\n".join(lines)


def render_search(ranked: list[Plan], gpus: int, feasible: int) -> str:
    if not ranked:
        return f"no layout of {gpus} GPUs fits"
    head = f"{feasible} feasible layouts for {gpus} GPUs (best first)"
    rows = [head, f"{'tp':>3} {'pp':>3} {'dp':>3} {'zero':>4} {'mbs':>4} {'m':>4} {'mem/GPU':>12} "
                  f"{'step':>10} {'comm':>6} {'bubble':>7}  verdict"]
    for r in ranked:
        lay = r.layout
        rows.append(f"{lay['tp']:>3} {lay['pp']:>3} {lay['dp']:>3} {lay['zero_stage']:>4} "
                    f"{lay['micro_batch_size']:>4} {lay['micro_batches']:>4} {_gib(r.memory.total):>12} "
                    f"{_ms(r.step.step_s):>10} {r.step.comm_share:>6.1%} {r.step.bubble_fraction:>7.1%}  "
                    f"{r.verdict}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    """`python -m tasks.plan CONFIG ...`: the budget alone, with the same exit codes as `retrainer`."""
    parser = argparse.ArgumentParser(prog="retrainer")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", *(sys.argv[1:] if argv is None else argv)])
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    try:
        return int(args.handler(args) or 0)
    except ConfigError as exc:
        print(f"retrainer: error: {exc}", file=sys.stderr)
        return EXIT_INVALID
    except RetrainerError as exc:
        print(f"retrainer: error: {exc}", file=sys.stderr)
        return exc.exit_code
