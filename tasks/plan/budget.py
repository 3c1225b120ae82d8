"""The preflight budget: memory per GPU and time/communication per step, and the verdict.

Pure arithmetic on a `JobConfig`; no torch, no DeepSpeed. Every formula states its
source in the docstring or the `assumptions` list so a reader can check it by hand.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from tasks.base.dataset_format import PlannedData
from tasks.config.schema import JobConfig, ParallelConfig
from tasks.models import get_family
from tasks.models.shapes import Stage, pipeline_stages
from tasks.plan.evaluation import evaluation_budget, evaluation_layout
from tasks.plan.host import node_peak_bytes, this_machine_memory_bytes
from tasks.plan.layout import ranks_per_node, validate_layout
from tasks.plan.packing import packing_bytes
from tasks.plan.process import process_memory

log = logging.getLogger(__name__)

GIB = 1024**3
Precision = Literal["fp32", "bf16"]

# DeepSpeed defaults (elements): ZeRO reduce/allgather buckets and the ZeRO-0 all-reduce bucket.
DS_BUCKET_ELEMENTS = 500_000_000
COMM_WARN_SHARE = 0.20
BUBBLE_WARN = 0.25


@dataclass(frozen=True)
class Bytes:
    """Bytes per parameter for one precision recipe."""

    weight: int
    grad: int
    activation: int


PRECISION_BYTES: dict[str, Bytes] = {
    "bf16": Bytes(weight=2, grad=2, activation=2),
    "fp32": Bytes(weight=4, grad=4, activation=4),
}


def ranks_on_gpu(cfg: JobConfig, device: str | None = None) -> bool:
    """Whether the ranks compute on GPUs: `device` ("cuda"/"gpu" or "cpu", a caller's override), else the
    config's `cluster.ranks_device`, else this machine (the ranks' own under `local`). Never the planning
    machine where the config says otherwise: an Airflow worker without a GPU plans a Slurm GPU job."""
    if device is None and cfg.cluster.ranks_device is not None:
        device = cfg.cluster.ranks_device[0]
    if device is None:
        import torch  # local: only needed where the config cannot tell

        return torch.cuda.is_available()
    return device in ("cuda", "gpu")


def resolve_precision(cfg: JobConfig, device: str | None = None) -> Precision:
    """`auto` means bf16 on GPU and fp32 on CPU, as the trainer does (`ranks_on_gpu` for `device`)."""
    p = cfg.train.precision
    if p != "auto":
        return p
    return "bf16" if ranks_on_gpu(cfg, device) else "fp32"


@dataclass(frozen=True)
class Memory:
    """Bytes held by the most loaded rank."""

    weights: int
    gradients: int
    optimizer_states: int
    activations: int
    activations_without_recompute: int
    activations_with_recompute: int
    comm_buffers: int
    total: int
    capacity: int
    headroom: int
    # The rank's process beyond its tensors (tasks/plan/process.py), on the stage where its peak is highest.
    process_runtime: int = 0
    zero_step_buffers: int = 0
    checkpoint_snapshot: int = 0
    pipe_outputs: int = 0
    weights_file_pages: int = 0
    data_index: int = 0
    process_peak: int = 0  # host RSS at the rank's peak (on CPU: tensors included; on a GPU: runtime + snapshot)
    process_phase: str = ""  # what peaks: training, saving, training + snapshot, loading
    host_node_peak: int = 0  # host RSS of the busiest node's ranks together (tasks/plan/host.py)
    host_capacity: int | None = None  # cluster.host_memory_gib, else a local run's machine; None: not checked
    host_capacity_of: str = ""  # where host_capacity comes from


@dataclass(frozen=True)
class Step:
    """Per-step work and communication for one rank."""

    tokens_per_step: int
    flops_total: float
    flops_per_gpu: float
    compute_s: float
    dp_grad_payload_bytes: int  # gradient bytes handed to the DP reduction collectives
    dp_param_allgather_payload_bytes: int  # ZeRO: updated parameter shards gathered back
    dp_ring_bytes: int  # bytes each rank sends: ring all-reduce 2(N-1)/N x payload
    tp_payload_bytes: int  # per step, bytes one rank hands to TP all-reduces (busiest stage)
    tp_collective_bytes: int  # per step, ring bytes each rank sends for TP all-reduces
    pp_p2p_bytes: int  # activations + their gradients sent by the busiest stage
    ep_alltoall_bytes: int  # per step, the busiest stage's routed rows sent to other expert-parallel ranks
    dp_comm_s: float
    tp_comm_s: float
    pp_comm_s: float
    ep_comm_s: float
    comm_s: float
    bubble_fraction: float
    bubble_s: float
    step_s: float
    comm_share: float


@dataclass(frozen=True)
class Plan:
    """The preflight verdict and everything it was computed from."""

    config_name: str
    model_family: str
    layout: dict[str, int]
    precision: str
    world_size: int
    params_total: int
    params_active: int  # per token: the total less the experts it is not routed to (a mixture of experts)
    params_per_rank: int
    busiest_rank: str
    stages: list[dict[str, Any]]
    memory: Memory
    step: Step
    fits: bool
    verdict: Literal["fits", "does_not_fit", "fits_with_warnings"]
    overflow: dict[str, Any] | None
    warnings: list[str] = field(default_factory=list)
    assumptions: list[str] = field(default_factory=list)
    evaluation: dict[str, Any] | None = None  # the busiest evaluation rank (tasks/plan/evaluation.py)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        """The plan `to_dict` gave (a run's plan stage hands it on as JSON)."""
        return cls(**{**data, "memory": Memory(**data["memory"]), "step": Step(**data["step"])})


def _dp_groups(trained: int, experts: int, p: ParallelConfig) -> tuple[tuple[int, int], ...]:
    """(parameters, group size) of each data-parallel collective group a rank's `trained` parameters are cut
    over: under expert parallelism the routed experts' (`experts` of them) go over their expert-data-parallel
    group (the dp / ep ranks holding the same experts; DeepSpeed's ZeRO partitions and reduces them there), the
    rest over dp; at ep = 1 all of them over dp (one partition, as ZeRO pads it)."""
    if p.ep == 1:
        return ((trained, p.dp),)
    return (trained - experts, p.dp), (experts, p.dp // p.ep)


def _dp_payload(params: int, b: Bytes, zero: int, micro_batches: int, dp: int) -> tuple[int, int]:
    """(gradient payload, parameter all-gather payload): bytes of the tensors one rank hands to the
    data-parallel collectives per step.

    ZeRO-0/1 reduce the accumulated gradients once per step (DeepSpeed 0.19 ZeRO-1: an all-reduce of
    the full gradients, measured); ZeRO-2/3 reduce every micro-batch as gradients are produced.
    ZeRO-1/2 then all-gather the updated shards (each rank contributes its shard); ZeRO-3 gathers
    parameters in forward and again in backward.
    """
    if dp == 1:
        return 0, 0
    shard = -(-params // dp)
    grads = params * b.grad * (micro_batches if zero >= 2 else 1)
    if zero == 0:
        gather = 0
    elif zero in (1, 2):
        gather = shard * b.weight
    else:
        gather = 2 * micro_batches * shard * b.weight
    return grads, gather


def _dp_traffic(trained: int, experts: int, b: Bytes, p: ParallelConfig) -> tuple[int, int, int]:
    """(gradient payload, all-gather payload, ring bytes each rank sends) of one rank's data-parallel collectives
    per step, for `trained` parameters of which `experts` are routed experts'.

    Ring all-reduce sends 2(N-1)/N x payload per rank; reduce-scatter (N-1)/N x payload; all-gather (N-1) x
    the shard each rank contributes, over each of the rank's groups (`_dp_groups`: the experts' expert-data-parallel
    group, none at dp = ep, and dp for the rest).
    """
    grads_payload = gather_payload = ring = 0
    for params, group in _dp_groups(trained, experts, p):
        grads, gather = _dp_payload(params, b, p.zero_stage, p.micro_batches, group)
        reduce_factor = (2 if p.zero_stage <= 1 else 1) * (group - 1) / group
        grads_payload, gather_payload = grads_payload + grads, gather_payload + gather
        ring += int(reduce_factor * grads + (group - 1) * gather)
    return grads_payload, gather_payload, ring


def _activation_bytes_per_layer(cfg: JobConfig, e: int, tp: int, attention: str = "sdpa") -> int:
    """Activation bytes one block keeps for backward, per micro-batch (Korthikanti et al. 2022, generalised).

    Outside the TP region (replicated): LN1 input, LN2 input, QKV input, MLP input
    (4 x e x s b h) plus two dropout masks (1 byte each, only when dropout > 0).
    Inside (divided by tp): Q, K, V (e x s b (n_heads + 2 kv_heads) hd), softmax
    output (e x a s^2 b), attention-dropout mask and output (a s^2 b (1 + e)),
    out-proj input (e x s b h), fc1 output and GELU output (2 e x s b ffn).
    With e=2, ffn=4h, dropout: 10 sbh + (24 sbh + 5 a s^2 b)/t, the paper's formula. A mixture of experts'
    routed layer keeps, per token and each of its k experts, the gathered input and the weighted output
    (replicated: 2 e x s b k h) and the expert's two hidden outputs (2 e x s b k I, TP slices), plus the fp32
    router logits and probabilities (8 x s b E); the larger of a routed and a dense layer is taken for every
    layer (a stage's bound).
    attention="sdpa" (our model: fused scaled_dot_product_attention) keeps no s^2 tensors,
    only the fp32 log-sum-exp per head and row (4 x a s b). Materialized scores are s x span
    (span = m.attention_span: the sliding window where it is shorter than s); a model with
    `attn_logit_softcapping` materializes them always (explicit attention).
    """
    m, b = cfg.model, cfg.train.micro_batch_size
    s, h, a, span = m.seq_len, m.d_model, m.n_heads, m.attention_span
    sb = s * b
    drop = m.dropout > 0
    outside = 4 * e * sb * h + (2 * sb * h if drop else 0)
    scores = e * a * s * span * b + (a * s * span * b * (1 + e) if drop else 0)
    inside = (
        e * sb * (m.n_heads + 2 * m.kv_heads) * m.head_dim
        # Soft-capped scores (Gemma 2) cannot use the fused kernel: they are materialized whatever is asked.
        + (scores if attention == "materialized" or m.attn_logit_softcapping is not None else 4 * a * sb)
        + e * sb * h
    )
    dense = outside + (inside + 2 * e * sb * m.ffn) // tp
    if m.num_experts is None or m.num_experts_per_tok is None:
        return dense
    k = m.num_experts_per_tok
    routed = outside + 2 * e * sb * k * h + 8 * sb * m.num_experts + (inside + 2 * e * sb * k * m.expert_ffn) // tp
    return max(routed, dense) if any(not m.routed(i) for i in range(m.n_layers)) else routed


def _logits_bytes(cfg: JobConfig, e: int) -> int:
    """One micro-batch's logits, `e` bytes a value."""
    return e * cfg.model.seq_len * cfg.train.micro_batch_size * cfg.model.vocab_size


def _kept_outputs(cfg: JobConfig, stage: Stage, e: int) -> int:
    """What DeepSpeed's pipe buffers keep between steps: the last stage's backward returns before it clears its
    output buffer (deepspeed/runtime/pipe/engine.py `_exec_backward_pass`), and that stage cycles through
    min(2, micro-batches) buffers (schedule.py `TrainSchedule.num_pipe_buffers`), so it holds that many
    micro-batches' logits into the optimizer step and the next step (measured 0.12 GiB on the 300M soak's rank 1)."""
    return min(2, cfg.parallel.micro_batches) * _logits_bytes(cfg, e) if stage.has_head else 0


def _stage_activations(cfg: JobConfig, stage: Stage, e: int, recompute: bool, attention: str = "sdpa",
                       packed: bool = False) -> int:
    """Activation bytes of one stage at its peak (1F1B: min(m, p - stage) micro-batches in flight); `packed`:
    the windows are packed conversations (`packing_bytes`)."""
    m, p = cfg.model, cfg.parallel
    b, s, h = cfg.train.micro_batch_size, m.seq_len, m.d_model
    per_layer = _activation_bytes_per_layer(cfg, e, p.tp, attention)
    in_flight = min(p.micro_batches, p.pp - stage.index) if p.pp > 1 else 1
    # With recomputation keep only each block's input, and rebuild one block at a time in backward.
    kept = e * s * b * h if recompute else per_layer
    stored = in_flight * stage.blocks * kept + (per_layer if recompute else 0)
    if stage.has_embedding:
        stored += in_flight * e * s * b * h
    if stage.has_head:
        # Final LN input/output, logits, and the fp32 softmax inside cross-entropy.
        stored += 2 * e * s * b * h + _logits_bytes(cfg, e) + 4 * s * b * m.vocab_size
    if packed:
        stored += packing_bytes(s, b, in_flight)
    return stored


def _tp_payload(cfg: JobConfig, stage: Stage, b: Bytes) -> int:
    """Bytes one rank hands to TP all-reduces per step: per block and micro-batch, two in forward
    (attention and MLP outputs) and two in backward (their inputs' gradients), each s x b x h;
    two more forward ones when recomputing. A vocab-parallel family adds the embedding's forward
    all-reduce (s x b x h), the LM head input's gradient (s x b x h) and the cross entropy's three
    fp32 values per token (max; sum of exp and target logit)."""
    if cfg.parallel.tp == 1:
        return 0
    m, t = cfg.model, cfg.train
    tokens = m.seq_len * t.micro_batch_size
    per_block = (4 + (2 if t.activation_checkpointing else 0)) * b.activation * tokens * m.d_model
    per_micro = per_block * stage.blocks
    if get_family(m.family).vocab_parallel:
        per_micro += stage.has_embedding * b.activation * tokens * m.d_model
        per_micro += stage.has_head * (b.activation * tokens * m.d_model + 3 * tokens * 4)
    return per_micro * cfg.parallel.micro_batches


def _bandwidth(cfg: JobConfig, span: int) -> float:
    """Bytes/s per GPU for a group spanning `span` consecutive ranks (`Layout.span`: the layout's rank order)."""
    c = cfg.cluster
    per_node, _ = ranks_per_node(c)
    if span <= per_node:
        return c.intra_node_gbytes_per_s * 1e9
    return c.inter_node_bytes_per_s / per_node


def plan(
    cfg: JobConfig,
    *,
    world_size: int | None = None,
    device: str | None = None,
    reserve_gib: float = 0.0,
    comm_warn_share: float = COMM_WARN_SHARE,
    bubble_warn: float = BUBBLE_WARN,
    attention: Literal["sdpa", "materialized"] = "sdpa",
    data: PlannedData = PlannedData(),
) -> Plan:
    """Budget one launch of `cfg` and say whether it can work.

    world_size: GPU count the layout must match (tp x pp x dp); None: the cluster's nodes x ranks per node.
    device: "cuda"/"gpu" or "cpu": what the ranks compute on (None: `ranks_on_gpu`'s rule).
    reserve_gib: memory kept back per GPU (CUDA context, allocator slack).
    attention: "sdpa" (fused kernel, our model) or "materialized" (s x s scores kept for backward).
    data: what the run's datasets are, from their manifests (tasks/data/sources.py `planned_data`): packed
    conversations (their ids and document masks) or plain text, and the bytes a training rank and an
    evaluation rank index their windows with.
    """
    validate_layout(cfg, world_size)
    m, p, t, c = cfg.model, cfg.parallel, cfg.train, cfg.cluster
    packed = data.packed
    precision = resolve_precision(cfg, device)
    b = PRECISION_BYTES[precision]
    counts = get_family(m.family).param_counts(m, p.layout)
    stages = pipeline_stages(m.n_layers, p.pp)
    dp, zero = p.dp, p.zero_stage
    cpu = not ranks_on_gpu(cfg, device)

    adapter = 0
    if t.lora is not None:
        from tasks.models.lora import adapter_params_per_block  # the family's shard rules (torch)

        adapter = adapter_params_per_block(m, t.lora, p.layout)

    # A run that may start from weights (a pretrained directory, a LoRA base, a version or path) reads its stage
    # from a file at start: a peak of its own (tasks/plan/process.py).
    loads_weights = m.pretrained is not None or m.base is not None or t.init_from != "scratch"
    # A save before the last step: the next step trains while its snapshot is written (tasks/plan/process.py).
    saves_mid_run = t.checkpoint_every < t.steps

    def stage_memory(st: Stage) -> dict[str, int]:
        # With train.lora the base is frozen (weights only, in the training dtype) and only the stage's
        # adapters have gradients and optimizer states (ZeRO as configured).
        held = st.params(counts) + st.blocks * adapter
        n = held if t.lora is None else st.blocks * adapter  # trained parameters
        # ZeRO pads partitions to equal size, each over its data-parallel group (`_dp_groups`).
        experts = st.experts(counts) if t.lora is None else 0
        shard = sum(-(-params // group) for params, group in _dp_groups(n, experts, p))
        weights = held * b.weight if zero < 3 else -(-held // dp) * b.weight
        # A LoRA run on base weights saves only what trains (the worker's exclude_frozen_parameters).
        kept = n if cfg.lora_saves_adapters_only else held
        saved_weights = kept * b.weight if zero < 3 else -(-kept // dp) * b.weight
        # ZeRO-0/1 hold full gradients until the reduction (measured: DeepSpeed 0.19 ZeRO-1 all-reduces
        # the full gradients, then keeps its shard); ZeRO-2/3 keep only their shard (plus the bucket).
        grads = n * b.grad if zero < 2 else shard * b.grad
        if zero >= 1 and precision == "bf16":
            grads += shard * 4  # fp32 gradient of the optimizer's partition, built at step time
        # Plain Adam: two fp32 moments (+ fp32 master in mixed precision). ZeRO keeps an fp32
        # partition copy even in fp32 runs, so 12 B per parameter of its shard.
        optim = n * (8 + (4 if precision == "bf16" else 0)) if zero == 0 else shard * 12
        act_no = _stage_activations(cfg, st, b.activation, recompute=False, attention=attention, packed=packed)
        act_re = _stage_activations(cfg, st, b.activation, recompute=True, attention=attention, packed=packed)
        act = act_re if t.activation_checkpointing else act_no
        bucket = min(DS_BUCKET_ELEMENTS, n) * b.grad if dp > 1 else 0
        p2p = 2 * b.activation * m.seq_len * t.micro_batch_size * m.d_model if p.pp > 1 else 0
        tp_buf = b.activation * m.seq_len * t.micro_batch_size * m.d_model if p.tp > 1 else 0
        comm = bucket + p2p + tp_buf
        grad_payload, gather_payload, _ = _dp_traffic(n, experts, b, p)
        tensors = {"params": n, "weights": weights, "gradients": grads, "optimizer_states": optim,
                   "activations": act, "comm_buffers": comm, "reduce_bucket": bucket, "saved_weights": saved_weights,
                   "pipe_outputs": _kept_outputs(cfg, st, b.activation)}
        process = process_memory(tensors, zero, b.grad, dp, cpu, loads_weights, saves_mid_run, data.train_index_bytes)
        return {
            "stage": st.index,
            "blocks": st.blocks,
            "has_embedding": st.has_embedding,
            "has_head": st.has_head,
            "params": held,
            "trained_params": n,
            "trained_expert_params": experts,
            "weights": weights,
            "gradients": grads,
            "optimizer_states": optim,
            "activations": act,
            "activations_without_recompute": act_no,
            "activations_with_recompute": act_re,
            "comm_buffers": comm,
            "total": weights + grads + optim + act + comm,
            "process": process["terms"],
            "process_total": process["peak"],
            "process_phase": process["phase"],
            "dp_grad_payload_bytes": grad_payload,
            "dp_param_allgather_payload_bytes": gather_payload,
            "tp_payload_bytes": _tp_payload(cfg, st, b),
        }

    per_stage = [stage_memory(st) for st in stages]
    busiest = max(per_stage, key=lambda s: (s["total"], -s["stage"]))
    process_stage = max(per_stage, key=lambda s: (s["process_total"], -s["stage"]))
    capacity = int((c.gpu_memory_gib - reserve_gib) * GIB)
    evaluation = evaluation_budget(cfg, capacity, cpu, packed, data.eval_index_bytes)
    per_node = ranks_per_node(c)[0]
    eval_ranks = min(per_node, evaluation_layout(cfg).parallel.layout.world_size)  # each as the busiest one
    host_node = max(node_peak_bytes(p.layout, per_node, [s["process_total"] for s in per_stage]),
                    eval_ranks * evaluation["process_total"])
    if c.host_memory_gib is not None:
        host_capacity, host_capacity_of = int(c.host_memory_gib * GIB), "cluster.host_memory_gib"
    elif c.launcher == "local":  # the ranks run on this machine
        host_capacity, host_capacity_of = this_machine_memory_bytes(), "this machine's memory (the local launcher)"
    else:
        host_capacity, host_capacity_of = None, ""
    mem = Memory(
        weights=busiest["weights"],
        gradients=busiest["gradients"],
        optimizer_states=busiest["optimizer_states"],
        activations=busiest["activations"],
        activations_without_recompute=busiest["activations_without_recompute"],
        activations_with_recompute=busiest["activations_with_recompute"],
        comm_buffers=busiest["comm_buffers"],
        total=busiest["total"],
        capacity=capacity,
        headroom=capacity - busiest["total"],
        process_runtime=process_stage["process"]["runtime"],
        zero_step_buffers=process_stage["process"]["zero_step_buffers"],
        checkpoint_snapshot=process_stage["process"]["checkpoint_snapshot"],
        pipe_outputs=process_stage["process"]["pipe_outputs"],
        weights_file_pages=process_stage["process"]["weights_file_pages"],
        data_index=process_stage["process"]["data_index"],
        process_peak=process_stage["process_total"],
        process_phase=process_stage["process_phase"],
        host_node_peak=host_node,
        host_capacity=host_capacity,
        host_capacity_of=host_capacity_of,
    )

    step = _step(cfg, busiest, b)
    n_total, n_active = get_family(m.family).total_params(m), get_family(m.family).active_params(m)

    # On CPU the capacity is the host's, and the process peak is what it must hold.
    process_fits = not cpu or mem.process_peak <= capacity
    host_fits = host_capacity is None or host_node <= host_capacity
    fits = mem.total <= capacity and evaluation["fits"] and process_fits and host_fits
    overflow = None
    warnings: list[str] = []
    if not host_fits and mem.total <= capacity and evaluation["fits"] and process_fits:
        assert host_capacity is not None
        overflow = {"term": "host_memory", "term_bytes": host_node, "by_bytes": host_node - host_capacity,
                    "total_bytes": host_node, "capacity_bytes": host_capacity, "stage": process_stage["stage"]}
    elif not process_fits and mem.total <= capacity:
        overflow = {"term": "process", "term_bytes": mem.process_peak, "by_bytes": mem.process_peak - capacity,
                    "total_bytes": mem.process_peak, "capacity_bytes": capacity, "stage": process_stage["stage"]}
    elif not evaluation["fits"] and mem.total <= capacity:
        held = evaluation["process_total"] if cpu else evaluation["total"]  # what evaluation_budget compared
        overflow = {"term": "evaluation", "term_bytes": held, "by_bytes": held - capacity,
                    "total_bytes": held, "capacity_bytes": capacity, "stage": evaluation["stage"]}
    elif not fits:
        names = ("weights", "gradients", "optimizer_states", "activations", "comm_buffers")
        terms = {k: getattr(mem, k) for k in names}
        worst = max(terms, key=terms.__getitem__)
        overflow = {
            "term": worst,
            "term_bytes": terms[worst],
            "by_bytes": mem.total - capacity,
            "total_bytes": mem.total,
            "capacity_bytes": capacity,
            "stage": busiest["stage"],
        }
    if step.comm_share > comm_warn_share:
        warnings.append(
            f"communication is {step.comm_share:.0%} of the step (> {comm_warn_share:.0%}): "
            "prefer a layout with less data/tensor parallelism across slow links"
        )
    if step.bubble_fraction > bubble_warn:
        warnings.append(
            f"pipeline bubble is {step.bubble_fraction:.0%} (> {bubble_warn:.0%}): "
            f"raise parallel.micro_batches above {p.micro_batches} or lower pp"
        )
    if not t.activation_checkpointing and mem.total > capacity and mem.activations_with_recompute < mem.activations:
        saved = mem.activations - mem.activations_with_recompute
        if mem.total - saved <= capacity:
            warnings.append("would fit with train.activation_checkpointing: true")
    verdict: Literal["fits", "does_not_fit", "fits_with_warnings"] = (
        "does_not_fit" if not fits else ("fits_with_warnings" if warnings else "fits")
    )
    tp_note = "TP rank 0 (all TP ranks hold the same bytes)" if p.tp > 1 else "the only TP rank"
    plan_ = Plan(
        config_name=cfg.name,
        model_family=m.family,
        layout={**p.layout.record(), "zero_stage": zero, "micro_batches": p.micro_batches,
                "micro_batch_size": t.micro_batch_size},
        precision=precision,
        world_size=p.layout.world_size,
        params_total=n_total,
        params_active=n_active,
        params_per_rank=busiest["params"],
        busiest_rank=f"pipeline stage {busiest['stage']}, {tp_note}, any DP rank",
        stages=per_stage,
        memory=mem,
        step=step,
        fits=fits,
        verdict=verdict,
        overflow=overflow,
        warnings=warnings,
        assumptions=_assumptions(precision, c.assumed_mfu, capacity, attention),
        evaluation=evaluation,
    )
    log.debug("plan %s: %s, %d B of %d B", cfg.name, verdict, mem.total, capacity)
    return plan_


def _alltoall_bytes(cfg: JobConfig, b: Bytes) -> int:
    """Bytes one rank of the stage with the most routed layers sends over its expert-parallel group per step."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    assert m.num_experts_per_tok is not None
    bounds = pipeline_stages(m.n_layers, p.pp)
    routed = max(sum(m.routed(i) for i in range(st.first_block, st.first_block + st.blocks)) for st in bounds)
    rows = t.micro_batch_size * m.seq_len * m.num_experts_per_tok * p.micro_batches
    passes = 6 if t.activation_checkpointing else 4  # dispatch + combine, forward, backward (+ recompute)
    return int(passes * routed * rows * m.d_model * b.activation * (p.ep - 1) / p.ep)


def _step(cfg: JobConfig, busiest: dict[str, int], b: Bytes) -> Step:
    m, p, t, c = cfg.model, cfg.parallel, cfg.train, cfg.cluster
    s, h, mb = m.seq_len, m.d_model, t.micro_batch_size
    tokens = mb * p.micro_batches * p.dp * s
    # The family's training FLOPs per token (forward + backward, each layer's attention span); recomputation
    # (every pipeline layer checkpointed) runs each forward once more: a third of forward + backward.
    per_token = get_family(m.family).flops_per_token(m) * (4 / 3 if t.activation_checkpointing else 1)
    flops = float(per_token * tokens)
    flops_gpu = flops / p.layout.world_size
    compute_s = flops_gpu / (c.peak_tflops * 1e12 * c.assumed_mfu)

    grads_payload, gather_payload, dp_ring = _dp_traffic(busiest["trained_params"], busiest["trained_expert_params"],
                                                         b, p)

    # TP: two all-reduces of (s b h) per block in forward and two in backward (+2 when recomputing).
    tp_payload = busiest["tp_payload_bytes"]
    tp_ring = int(2 * (p.tp - 1) / p.tp * tp_payload)
    # PP: each stage boundary sends the activation forward and its gradient back per micro-batch.
    pp_bytes = 2 * b.activation * s * mb * h * p.micro_batches if p.pp > 1 else 0

    # EP: each routed layer sends a rank's k rows per token to their experts' ranks and takes the outputs back,
    # forward and again in backward (and in the recompute): with balanced routing (ep - 1) / ep of them leave.
    ep_bytes = _alltoall_bytes(cfg, b) if p.ep > 1 else 0

    dp_s = dp_ring / _bandwidth(cfg, p.layout.span("dp"))
    tp_s = tp_ring / _bandwidth(cfg, p.layout.span("tp"))
    pp_s = pp_bytes / _bandwidth(cfg, p.layout.span("pp"))
    ep_s = ep_bytes / _bandwidth(cfg, p.layout.span("ep")) if ep_bytes else 0.0
    comm_s = dp_s + tp_s + pp_s + ep_s
    bubble = (p.pp - 1) / (p.micro_batches + p.pp - 1)
    bubble_s = compute_s * bubble / (1 - bubble)
    step_s = compute_s + bubble_s + comm_s
    return Step(
        tokens_per_step=tokens,
        flops_total=flops,
        flops_per_gpu=flops_gpu,
        compute_s=compute_s,
        dp_grad_payload_bytes=grads_payload,
        dp_param_allgather_payload_bytes=gather_payload,
        dp_ring_bytes=dp_ring,
        tp_payload_bytes=tp_payload,
        tp_collective_bytes=tp_ring,
        pp_p2p_bytes=pp_bytes,
        ep_alltoall_bytes=ep_bytes,
        dp_comm_s=dp_s,
        tp_comm_s=tp_s,
        pp_comm_s=pp_s,
        ep_comm_s=ep_s,
        comm_s=comm_s,
        bubble_fraction=bubble,
        bubble_s=bubble_s,
        step_s=step_s,
        comm_share=comm_s / step_s if step_s else 0.0,
    )


def _assumptions(precision: str, mfu: float, capacity: int, attention: str) -> list[str]:
    return [
        f"precision {precision}: weights/grads {PRECISION_BYTES[precision].weight} B/param; optimizer is "
        "Adam (2 fp32 moments) + fp32 master copy (bf16, or any ZeRO stage: DeepSpeed keeps an fp32 partition)",
        "ZeRO-1 divides optimizer states by dp, ZeRO-2 also gradients, ZeRO-3 also weights; gradients are "
        "counted at their peak (end of backward); bf16 with ZeRO adds the fp32 gradient of the partition",
        "layout order: TP innermost, then DP, then PP (DeepSpeed PipeModelDataParallelTopology)",
        "pipeline stages split blocks like DeepSpeed partition_method='type:TransformerBlock'; "
        "embeddings on stage 0, final LN + head on the last; 1F1B keeps min(m, p - stage) micro-batches in flight",
        "activations: Korthikanti et al. 2022 per-layer terms; attention "
        + ("scores materialised" if attention == "materialized" else "by fused SDPA (no s x s tensors kept)"),
        f"compute at {mfu:.0%} MFU of peak; FLOPs = (6N + 12 L s h) per token (+2N with recomputation)",
        "communication not overlapped with compute (conservative); a group within one node (ranks per node: "
        "nproc_per_node or gpus_per_node) gets intra_node_gbytes_per_s per GPU, otherwise the node's "
        "inter-node bandwidth (GB/s) / ranks per node",
        f"capacity {capacity} B = gpu_memory_gib GiB minus reserve; comm buffers = DeepSpeed bucket "
        f"(min({DS_BUCKET_ELEMENTS} elements, params)) + p2p/TP staging",
        "process (host RSS per rank, tasks/plan/process.py): runtime + the largest of the step (tensors, with "
        "ZeRO-1/2's two gradient-sized partition copies in place of the freed activations), a save (weights, "
        "gradients, optimizer states and their host snapshot; a run that saves before its last step: the next "
        "step with the snapshot on top) and the load of starting weights; on CPU it must fit the capacity",
        "host memory per node (tasks/plan/host.py): the process peaks of a node's ranks added up (ranks placed "
        "node-major), or of its evaluation ranks; checked against cluster.host_memory_gib when that is set, "
        "else for the local launcher against this machine's memory",
    ]
