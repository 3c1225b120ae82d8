"""One training rank, started by `tasks.base.spawn`: `python -m tasks.train.worker --config C.json --dataset-dir D`.

D is the primary dataset; a run's replay sources (its identity's `replay`) are the warmed datasets
beside D in the same cache, found by manifest hash.

Why this shape: every rank runs the same loop over a DeepSpeed PipelineEngine
(also for pp=1, so there is one code path); the job arrives as the JSON the
launcher wrote (a `TrainingJob`: no credentials), so CLI overrides survive. A
non-finite loss or gradient norm raises at once, naming the step, and the rank
exits non-zero; no summary is written for such a run. Rank 0 keeps the run's
status file current (tasks/base/job_status.py): that, not the log, is what the
launcher supervises.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist
from torch.utils.checkpoint import checkpoint

from tasks.base.errors import InvalidInputError, TrainingFailedError
from tasks.base.fsutil import atomic_write_json
from tasks.base.job_status import State, Status, log_for_relay, now, write_status
from tasks.config.schema import TrainingJob
from tasks.models import get_family
from tasks.models.common.init import no_default_init
from tasks.models.common.moe import take_expert_loads
from tasks.models.export import FILES_PER_STAGE
from tasks.models.grid import build_grid
from tasks.models.shapes import TRAINING_PARTITION
from tasks.models.weights import load_into
from tasks.runs.identity import RunIdentity
from tasks.train import checkpoint as ck
from tasks.train.checkpointer import Checkpointer
from tasks.train.data import Sampler, TokenWindows, replay_dataset_dir, split_inputs
from tasks.train.export import export_stage, read_reports
from tasks.train.lean_start import eager_adamw, import_muon_uncompiled
from tasks.train.memory_trace import MemoryTrace, peak_rss_bytes
from tasks.train.packing import loss_scale, packed_inputs, token_weighted_loss
from tasks.train.rank import (
    deepspeed_prints_to_debug,
    exit_without_teardown,
    finish,
    join_process_group,
    quiet_start_up,
    report_failure,
)
from tasks.train.telemetry import Telemetry, comms_config, step_metrics
from tasks.train.tracking import Tracker

log = logging.getLogger("tasks.train.worker")


class WarmupCosine:
    """LR multiplier: linear warmup, then cosine decay to 10% at the last step (picklable for checkpoints)."""

    def __init__(self, warmup: int, total: int) -> None:
        self.warmup, self.total = warmup, total

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        span = max(1, self.total - self.warmup)
        progress = min(1.0, (step - self.warmup) / span)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


def use_bf16(cfg: TrainingJob) -> bool:
    p = cfg.train.precision
    if p == "bf16" and not torch.cuda.is_available():
        raise InvalidInputError("train.precision: bf16 needs a GPU; use 'auto' or 'fp32' on CPU")
    return p == "bf16" or (p == "auto" and torch.cuda.is_available())


def deepspeed_config(cfg: TrainingJob) -> dict[str, Any]:
    t, p = cfg.train, cfg.parallel
    return {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": p.micro_batches,
        "train_batch_size": t.micro_batch_size * p.micro_batches * p.dp,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": {"stage": p.zero_stage},
        "zero_allow_untested_optimizer": True,  # a torch AdamW: no fused-Adam JIT build
        "bf16": {"enabled": use_bf16(cfg)},
        "steps_per_print": 10**9,
        "comms_logger": comms_config(),
        "checkpoint": {"tag_validation": "FAIL"},
        # A mixture of experts training its auxiliary loss passes (activations, carrier) between stages
        # (tasks/models/common/moe.py RouterAux); DeepSpeed splits only a lone activation over TP ranks.
        **({"pipeline": {"pipe_partitioned": False, "grad_partitioned": False}}
           if cfg.model.router_aux_loss_coef > 0 else {}),
    }


def make_optimizer(params: Any, cfg: TrainingJob) -> torch.optim.Optimizer:
    return eager_adamw(params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)


def param_groups(module: torch.nn.Module, ep: int) -> list[Any]:
    """What trains, as the optimizer takes it: one group, or under expert parallelism the dense parameters and
    the experts apart (DeepSpeed's ZeRO reduces and partitions each expert group over its own ranks)."""
    trainable = [q for q in module.parameters() if q.requires_grad]
    if ep == 1:
        return trainable
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    return split_params_into_different_moe_groups_for_optimizer({"params": trainable, "name": "dense"})


def make_scheduler(cfg: TrainingJob):
    return lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, WarmupCosine(cfg.train.warmup_steps, cfg.train.steps))


def check_finite(value: float | None, what: str, step: int) -> None:
    if value is not None and not math.isfinite(value):
        raise TrainingFailedError(f"non-finite {what} at step {step} ({value})")


class Trainer:
    """Builds the engine, runs the steps (its `Checkpointer` resumes, saves and commits), writes the summary."""

    def __init__(self, cfg: TrainingJob, dataset_dir: Path, run: RunIdentity, init_path: Path | None = None,
                 export: dict[str, Any] | None = None) -> None:
        import deepspeed

        from tasks.train.pipeline import TrainingPipeline, engine_for

        self.cfg, self.run_identity, self.export = cfg, run, export
        p, m = cfg.parallel, cfg.model
        join_process_group(cfg.cluster)
        self.rank, self.world = tdist.get_rank(), tdist.get_world_size()
        if self.world != p.layout.world_size:
            raise InvalidInputError(f"world size {self.world} != parallel tp x pp x dp = {p.layout.world_size}")
        with deepspeed_prints_to_debug():  # rank 0 prints "Using topology: {...}"
            grid = build_grid(p.layout)
        tp = self.tp = grid.tp
        self.dp_rank, self.stage = grid.coord.dp, grid.coord.pp

        primary = TokenWindows(dataset_dir, "train", m.seq_len, m.vocab_size)
        replay = [TokenWindows(replay_dataset_dir(dataset_dir, r.url, r.manifest_hash), "train", m.seq_len,
                               m.vocab_size) for r in run.replay]
        self.windows = TokenWindows.joined([primary, *replay]) if replay else primary
        self.sampler = Sampler(len(primary), cfg.train.micro_batch_size, p.micro_batches, p.dp, cfg.train.seed,
                               tuple((len(w), r.weight) for w, r in zip(replay, run.replay, strict=True)))
        if replay and self.rank == 0:
            log.info("data: %d windows of the new data (weight %g) + replay %s", len(primary),
                     1 - sum(r.weight for r in run.replay),
                     ", ".join(f"{r.url} ({len(w)} windows, weight {r.weight:g})" for w, r in zip(replay, run.replay,
                                                                                                  strict=True)))
        self.last_step = 0
        # A LoRA run on starting weights checkpoints only what trains (adapters, their optimizer states): its
        # frozen base is those starting weights, pinned by digest in the run identity, loaded on resume too.
        self.base_path = init_path if cfg.train.lora is not None else None
        # Decided before the engine exists: a run's own checkpoint wins; only a fresh run loads starting weights.
        self.checkpoints = Checkpointer(cfg, run, self.sampler, self.dp_rank, self.stage, self.base_path)
        resume_from = self.checkpoints.resume_from

        self.family = get_family(m.family)
        with deepspeed_prints_to_debug(), no_default_init():  # each layer fills its own weights
            module = TrainingPipeline(
                # No seeded draw when the weights are loaded next (a resume, starting weights): at 70B it is
                # minutes of random numbers and a full-size transient tensor per parameter on every rank.
                layers=self.family.pipeline_layers(
                    m, None if resume_from is not None or init_path is not None else cfg.train.seed, tp),
                loss_fn=token_weighted_loss(self.family.make_loss_fn(tp), self.family.make_token_nll_fn(tp)),
                topology=grid.topology,
                partition_method=TRAINING_PARTITION,
                activation_checkpoint_interval=1 if cfg.train.activation_checkpointing else 0,
                # Only the blocks recompute: DeepSpeed's default also wraps the embedding (its integer input has no
                # grad: the reentrant checkpoint then loses its gradient) and the head (a loss that is no scalar).
                checkpointable_layers=[self.family.TransformerBlock.__name__],
                # torch's non-reentrant checkpoint, not DeepSpeed's reentrant one: a stage that passes on a tuple
                # (a mixture of experts' routing carrier beside the activations) gets one backward call per tensor
                # from DeepSpeed's pipeline engine, and a reentrant checkpoint's second call found its inputs freed.
                activation_checkpoint_func=functools.partial(checkpoint, use_reentrant=False),
                coord=grid.coord, ep=p.ep,
            )
        if init_path is not None and (resume_from is None or self.base_path is not None):
            # Before deepspeed.initialize: ZeRO copies the weights into its fp32 partitions there.
            loaded = load_into(module, init_path, m, tp)
            if self.rank == 0:
                log.info("starting weights: %s (%d tensors per rank from %s)", run.init.note, loaded, init_path)
        if (lora := cfg.train.lora) is not None:  # after the base weights, before the optimizer sees requires_grad
            from tasks.models.lora import apply_lora

            wrapped = apply_lora(module, m, lora, tp, cfg.train.seed)
            if self.rank == 0:
                log.info("LoRA: rank %d adapters on %d linears of this stage, base frozen", lora.rank, wrapped)
            if resume_from is None:
                from tasks.inputs.adapter import load_start_adapter

                load_start_adapter(module, cfg, run, tp)
        import_muon_uncompiled()
        params = param_groups(module, p.ep)
        with deepspeed_prints_to_debug(), engine_for(p.ep):
            self.engine, _, _, _ = deepspeed.initialize(
                model=module,
                model_parameters=params,
                optimizer=make_optimizer(params, cfg),
                lr_scheduler=make_scheduler(cfg),
                config=deepspeed_config(cfg),
            )
        self.device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        self.checkpoints.attach(self.engine, on_cpu=self.device.type == "cpu")
        self.memory = MemoryTrace()  # this rank's RSS after each step (after its save): the summary's rss_trace
        ck.seed_rank(cfg.train.seed, self.dp_rank, self.stage)
        if self.rank == 0:
            log.info("engine ready: %d ranks (%s)", self.world, p.layout.describe())

    def batches(self, step0: int) -> tuple[list[tuple[Any, Any]], dict[str, Any] | None]:
        """This rank's micro-batches: (inputs, labels); a chat dataset's are packed, their labels carrying the
        loss scale of the global batch (`tasks.train.packing`), and come with the step's packing telemetry."""
        micro = self.sampler.rank_micro_batches(step0, self.dp_rank)
        if not self.windows.packed:
            return [tuple(t.to(self.device) for t in split_inputs(self.windows.get(idx))) for idx in micro], None
        step = self.sampler.global_indices(step0)
        trained = self.windows.trained_tokens(step)
        scale = loss_scale(len(micro), self.cfg.parallel.dp, trained).to(self.device)
        out = []
        for idx in micro:
            inputs, labels = packed_inputs(self.windows.get_packed(idx))
            out.append((tuple(t.to(self.device) for t in inputs), (labels.to(self.device), scale)))
        real = self.windows.real_tokens(step)
        return out, {"trained_tokens": trained, "packed_efficiency": real / (len(step) * (self.cfg.model.seq_len + 1))}

    def run(self, tracking: dict[str, Any] | None = None) -> dict[str, Any]:
        """Train to the last step; `tracking`: where rank 0 also sends each step's numbers (tasks/train/tracking.py)."""
        cfg = self.cfg
        out = Path(cfg.train.output_dir)
        root = self.checkpoints.root
        start, losses = self.checkpoints.resume()
        m = cfg.model
        tokens = self.sampler.global_batch * m.seq_len
        peak = cfg.cluster.peak_tflops * 1e12 * self.world if torch.cuda.is_available() else None
        telemetry = Telemetry(
            out / "telemetry.jsonl", enabled=self.rank == 0, fresh=start == 0, tokens_per_step=tokens,
            flops_per_token=self.family.flops_per_token(m), peak_flops_total=peak,
            steps=cfg.train.steps, first_step=start + 1,
        )
        tracker = Tracker(tracking, out, enabled=self.rank == 0)
        self.report("training", start, losses[-1] if losses else None)
        final_dir = None
        try:
            for step0 in range(start, cfg.train.steps):
                step = step0 + 1
                data, packing = self.batches(step0)
                lr = self.engine.get_lr()[0]  # this step's (the scheduler moves on inside train_batch)
                t0 = telemetry.start()
                loss_t = self.engine.train_batch(data_iter=iter(data))
                loss = float(loss_t.detach().float().item())
                check_finite(loss, "loss", step)
                norm = self.engine.get_global_grad_norm()
                check_finite(None if norm is None else float(norm), "grad norm", step)
                extra = {**(packing or {}), **self.expert_loads()}
                if self.device.type == "cpu":
                    extra["snapshot_wait_s"] = self.checkpoints.take_snapshot_wait()
                row = telemetry.record(step, loss, t0, extra)
                self.checkpoints.saver.check()
                losses.append(loss)
                stall = None
                if step % cfg.train.checkpoint_every == 0 or step == cfg.train.steps:
                    final_dir, stall = self.checkpoints.save(step, losses)
                tracker.log(step, step_metrics(row, lr, norm, stall))
                self.memory.record(step)
                self.report("training", step, loss)
        except TrainingFailedError:
            tracker.close(failed=True)
            self.checkpoints.saver.drain()
            raise
        self.checkpoints.saver.wait()  # the final checkpoint is committed before the rank reports success
        telemetry.close()
        tracker.close()
        if final_dir is None:  # resumed at the last step: nothing left to run
            final_dir = root / ck.tag_for(cfg.train.steps)
        exported = self.export_final(out, final_dir.name) if self.export is not None else None
        return self.summary(out, final_dir, start, losses, exported)

    def expert_loads(self) -> dict[str, Any]:
        """A mixture of experts' routing this step, for rank 0's telemetry: `expert_load` {block index: {min, max,
        mean}} of each MoE layer's picks per expert, summed over the data-parallel replicas (the TP peers of a
        replica route the same tokens: counted once), every stage's layers; {} for a dense model."""
        if not self.family.spec.routed:
            return {}
        loads = take_expert_loads(self.engine.module)  # every rank reads its counts, so every rank's restart
        gathered: list[Any] = [None] * self.world if self.rank == 0 else []
        tdist.gather_object(loads if self.tp.rank == 0 else {}, gathered if self.rank == 0 else None, dst=0)
        if self.rank != 0:
            return {}
        layers: dict[int, list[int]] = {}
        for part in gathered:
            for index, counts in part.items():
                layers[index] = [a + b for a, b in zip(layers.get(index, [0] * len(counts)), counts, strict=True)]
        return {"expert_load": {str(i): {"min": min(c), "max": max(c), "mean": sum(c) / len(c)}
                                for i, c in sorted(layers.items())}}

    def export_final(self, out: Path, tag: str) -> dict[str, Any]:
        """Write the final weights' Hugging Face files into the store's staging area (`FILES_PER_STAGE` per stage;
        once per checkpoint: a retry whose ranks' disks still hold every file's report reuses them)."""
        assert self.export is not None
        def every_ranks(mine: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
            """Every rank's reports by file (the run dir may be each node's own disk)."""
            gathered: list[Any] = [None] * self.world
            tdist.all_gather_object(gathered, mine)
            return {r["file"]["path"]: r for reports in gathered for r in reports}

        shards = every_ranks(read_reports(out, tag))
        if len(shards) != self.cfg.parallel.pp * FILES_PER_STAGE:  # decided together: all export, or none
            shards = every_ranks(export_stage(self.engine.module, self.cfg.model, self.tp, spec=self.export,
                                              output_dir=out, tag=tag))
        return {"tag": tag, "dtype": self.export["dtype"], "shards": [shards[path] for path in sorted(shards)]}

    def summary(self, out: Path, final_dir: Path, start: int, losses: list[float],
                exported: dict[str, Any] | None = None) -> dict[str, Any]:
        p = self.cfg.parallel
        # Each rank's host high-water mark (the planner's process term) and its RSS over the steps (a plateau, or
        # a climb: issue 38).
        memory: list[Any] = [None] * self.world
        tdist.all_gather_object(memory, (peak_rss_bytes(), self.memory.points()))
        summary = {
            "experiment_key": self.run_identity.experiment_key,
            "run": self.run_identity.to_dict(),
            "started_from": self.run_identity.init.note,
            "steps": self.cfg.train.steps,
            "trained_steps": self.cfg.train.steps - start,
            "first_loss": losses[0] if losses else None,
            "final_loss": losses[-1] if losses else None,
            "losses": losses,
            "checkpoint_dir": str(final_dir),
            "checkpoint_tag": final_dir.name,
            "resumed_from_step": start or None,
            "telemetry_path": str(out / "telemetry.jsonl"),
            "world_size": self.world,
            "layout": p.layout.record(),
            "export": exported,
            "checkpoint_saves": self.checkpoints.saves,
            "resharded": self.checkpoints.resharded,
            "peak_rss_bytes": [peak for peak, _ in memory],
            "rss_trace": [trace for _, trace in memory],
        }
        if self.rank == 0:
            atomic_write_json(out / "summary.json", summary)
        self.report("finished", self.cfg.train.steps, summary["final_loss"])
        return summary

    def report(self, state: State, step: int, loss: float | None) -> None:
        """Rank 0 keeps the status file current (the launcher's view of the run)."""
        self.last_step = step
        if self.rank == 0:
            write_status(self.cfg.train.output_dir,
                         Status(state=state, step=step, steps=self.cfg.train.steps, loss=loss, at=now()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tasks.train.worker")
    parser.add_argument("--config", required=True, help="JSON worker config written by the launcher")
    parser.add_argument("--dataset-dir", required=True)
    args = parser.parse_args(argv)
    rank = os.environ.get("RANK", "0")
    log_for_relay(f"rank {rank}")
    quiet_start_up()
    spec = json.loads(Path(args.config).read_text())
    cfg = TrainingJob.model_validate(spec["job"])
    init_path = Path(spec["init_path"]) if spec.get("init_path") else None
    trainer = None
    try:
        trainer = Trainer(cfg, Path(args.dataset_dir), RunIdentity.from_dict(spec["run"]), init_path,
                          spec.get("export"))
        trainer.run(spec.get("tracking"))
    except (TrainingFailedError, InvalidInputError) as exc:
        log.error("training failed: %s", exc)
        return report_failure(cfg.train.output_dir, exc, step=trainer.last_step if trainer else 0,
                              steps=cfg.train.steps)
    return finish()


if __name__ == "__main__":
    exit_without_teardown(main)
