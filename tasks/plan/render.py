"""A plan as people read it: the budget table (`render`) and the ranked layouts (`render_search`)."""

from __future__ import annotations

from typing import Any

from tasks.base.layout import describe_record
from tasks.plan.budget import Plan


def gib(n: float) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1."""
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} us"


def shortfall(r: Plan) -> str:
    """Why a plan does not fit, in one line (the CLI, the table and the plan task's error say the same)."""
    o = r.overflow or {}
    if o.get("term") == "host_memory":
        return (f"{gib(o['by_bytes'])} over {r.memory.host_capacity_of} ({gib(o['capacity_bytes'])}) on a node: "
                f"its ranks' host memory together {gib(o['total_bytes'])}")
    if not o:
        return "does not fit"
    return f"{gib(o['by_bytes'])} over on stage {o['stage']}; largest term {o['term']} ({gib(o['term_bytes'])})"


def render(r: Plan, serving: dict[str, Any] | None = None) -> str:
    """A short human table."""
    lay = r.layout
    m, s = r.memory, r.step
    lines = [
        f"plan {r.config_name}: {r.verdict.upper()}  ({describe_record(lay)} "
        f"zero={lay['zero_stage']} micro_batches={lay['micro_batches']} mbs={lay['micro_batch_size']}, "
        f"{r.precision}, {r.world_size} GPU)",
        f"params: {r.params_total:,} total (model family {r.model_family}"
        + (f"; {r.params_active:,} active per token" if r.params_active != r.params_total else "")
        + f"), {r.params_per_rank:,} on the busiest rank ({r.busiest_rank})",
        "memory per GPU:",
    ]
    for name in ("weights", "gradients", "optimizer_states", "activations", "comm_buffers"):
        lines.append(f"  {name:<18} {gib(getattr(m, name)):>14}")
    lines.append(f"  {'total':<18} {gib(m.total):>14}  of {gib(m.capacity)} ({m.total / m.capacity:.1%})")
    lines.append(f"  (activations without / with recompute: {gib(m.activations_without_recompute)} / "
                 f"{gib(m.activations_with_recompute)})")
    lines.append(f"process per rank (host RSS): runtime {gib(m.process_runtime)}, ZeRO step buffers "
                 f"{gib(m.zero_step_buffers)}, checkpoint snapshot {gib(m.checkpoint_snapshot)}, pipe outputs "
                 f"{gib(m.pipe_outputs)}, "
                 f"weights file pages {gib(m.weights_file_pages)}, data index {gib(m.data_index)}; "
                 f"peak {gib(m.process_peak)} ({m.process_phase})")
    lines.append(f"host memory per node (its ranks' process peaks together): {gib(m.host_node_peak)}"
                 + (f" of {gib(m.host_capacity)} ({m.host_capacity_of})" if m.host_capacity is not None
                    else " (cluster.host_memory_gib unset: not checked)"))
    lines += [
        "per step:",
        f"  FLOPs {s.flops_total:.3e} ({s.flops_per_gpu:.3e}/GPU), compute {_ms(s.compute_s)}",
        f"  DP grads {gib(s.dp_grad_payload_bytes)} payload, {gib(s.dp_ring_bytes)} on the wire, "
        f"{_ms(s.dp_comm_s)}",
        f"  TP {gib(s.tp_collective_bytes)} {_ms(s.tp_comm_s)}; PP p2p {gib(s.pp_p2p_bytes)} {_ms(s.pp_comm_s)}"
        + (f"; EP all-to-all {gib(s.ep_alltoall_bytes)} {_ms(s.ep_comm_s)}" if s.ep_alltoall_bytes else ""),
        f"  bubble {s.bubble_fraction:.1%}, communication share {s.comm_share:.1%}, step ~{_ms(s.step_s)}",
    ]
    if r.evaluation:
        ev, el = r.evaluation, r.evaluation["layout"]
        lines.append(f"evaluation ranks ({describe_record(el)}, {ev['dtype']}): weights "
                     f"{gib(ev['weights'])} + activations {gib(ev['activations'])} + logits {gib(ev['logits'])} "
                     f"= {gib(ev['total'])} on stage {ev['stage']}; process per rank (host RSS): runtime "
                     f"{gib(ev['runtime'])}, data index {gib(ev['data_index'])}, peak {gib(ev['process_total'])}")
    if serving:
        lines.append(f"serving ({serving['dtype']}): weights {gib(serving['weights_bytes'])} + KV "
                     f"{serving['kv_cache_bytes_per_token']} B/token x {serving['concurrency']} x "
                     f"{serving['context']} = {gib(serving['serving_bytes'])}")
    if r.overflow:
        lines.append(f"DOES NOT FIT: {shortfall(r)}")
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
                    f"{lay['micro_batch_size']:>4} {lay['micro_batches']:>4} {gib(r.memory.total):>12} "
                    f"{_ms(r.step.step_s):>10} {r.step.comm_share:>6.1%} {r.step.bubble_fraction:>7.1%}  "
                    f"{r.verdict}")
    return "\n".join(rows)
