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
import json
import logging
import math
import os
import random
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as tdist

from tasks.base.comm_ops import load_shm_op
from tasks.base.errors import InvalidInputError, TrainingFailedError
from tasks.base.fsutil import atomic_write_bytes, atomic_write_json
from tasks.base.job_status import State, Status, log_for_relay, now, write_status
from tasks.base.model_files import CHECKPOINT_BASE_FILE
from tasks.config import TrainingJob
from tasks.models import get_family
from tasks.models.common import no_default_init
from tasks.models.export import FILES_PER_STAGE
from tasks.models.grid import build_grid
from tasks.models.shapes import TRAINING_PARTITION
from tasks.models.weights import load_into
from tasks.runs.identity import RunIdentity
from tasks.train import async_save, reshard
from tasks.train import checkpoint as ck
from tasks.train.data import Sampler, TokenWindows, replay_dataset_dir, split_inputs
from tasks.train.export import export_stage, read_reports
from tasks.train.lean_start import eager_adamw, import_muon_uncompiled
from tasks.train.memory_trace import MemoryTrace, peak_rss_bytes
from tasks.train.mirror import Mirror, assign_uploads
from tasks.train.rank import (
    deepspeed_prints_to_debug,
    exit_without_teardown,
    finish,
    quiet_start_up,
    report_failure,
)
from tasks.train.telemetry import Telemetry, comms_config

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
    }


def make_optimizer(params: Any, cfg: TrainingJob) -> torch.optim.Optimizer:
    return eager_adamw(params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)


def make_scheduler(cfg: TrainingJob):
    return lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, WarmupCosine(cfg.train.warmup_steps, cfg.train.steps))


def seed_rank(seed: int, dp_rank: int, stage: int) -> None:
    """Dropout RNG: TP peers share a seed so replicated activations get the same mask."""
    s = seed + 1009 * dp_rank + 101 * stage
    torch.manual_seed(s)
    np.random.seed(s % 2**32)
    random.seed(s)


def check_finite(value: float | None, what: str, step: int) -> None:
    if value is not None and not math.isfinite(value):
        raise TrainingFailedError(f"non-finite {what} at step {step} ({value})")


class Trainer:
    """Builds the engine, resumes, runs the steps, commits checkpoints, writes the summary."""

    def __init__(self, cfg: TrainingJob, dataset_dir: Path, run: RunIdentity, init_path: Path | None = None,
                 export: dict[str, Any] | None = None) -> None:
        import deepspeed

        from tasks.train.pipeline import TrainingPipeline

        self.cfg, self.run_identity, self.export = cfg, run, export
        p, m = cfg.parallel, cfg.model
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():  # before the first NCCL collective
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        load_shm_op()  # before init_distributed loads it: never waits on a dead loader's lock
        with deepspeed_prints_to_debug():
            deepspeed.init_distributed(dist_backend=backend, timeout=timedelta(seconds=cfg.cluster.hang_timeout_s))
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
        # Decided before the engine exists: a run's own checkpoint wins; only a fresh run loads starting weights.
        self.root = ck.ckpt_root(cfg.train.output_dir)
        self.last_step = 0
        self.leader = int(os.environ.get("LOCAL_RANK", "0")) == 0  # this node's first rank
        self.mirror = None
        if cfg.train.checkpoint_url:
            self.mirror = Mirror(cfg.train.checkpoint_url, cfg.train.checkpoint_storage_options, run.run_id)
        self.resume_from = self._resume_point()

        self.family = get_family(m.family)
        with deepspeed_prints_to_debug(), no_default_init():  # each layer fills its own weights
            module = TrainingPipeline(
                # No seeded draw when the weights are loaded next (a resume, starting weights): at 70B it is
                # minutes of random numbers and a full-size transient tensor per parameter on every rank.
                layers=self.family.pipeline_layers(
                    m, None if self.resume_from is not None or init_path is not None else cfg.train.seed, tp),
                loss_fn=self.family.make_loss_fn(tp),
                topology=grid.topology,
                partition_method=TRAINING_PARTITION,
                activation_checkpoint_interval=1 if cfg.train.activation_checkpointing else 0,
            )
        # A LoRA run on starting weights checkpoints only what trains (adapters, their optimizer states): its
        # frozen base is those starting weights, pinned by digest in the run identity, loaded on resume too.
        self.base_path = init_path if cfg.train.lora is not None else None
        if init_path is not None and (self.resume_from is None or self.base_path is not None):
            # Before deepspeed.initialize: ZeRO copies the weights into its fp32 partitions there.
            loaded = load_into(module, init_path, m, tp)
            if self.rank == 0:
                log.info("starting weights: %s (%d tensors per rank from %s)", run.init.note, loaded, init_path)
        if (lora := cfg.train.lora) is not None:  # after the base weights, before the optimizer sees requires_grad
            from tasks.models.lora import apply_lora

            wrapped = apply_lora(module, m, lora, tp, cfg.train.seed)
            if self.rank == 0:
                log.info("LoRA: rank %d adapters on %d linears of this stage, base frozen", lora.rank, wrapped)
            if self.resume_from is None:
                from tasks.inputs.adapter import load_start_adapter

                load_start_adapter(module, cfg, run, tp)
        import_muon_uncompiled()
        with deepspeed_prints_to_debug():
            self.engine, _, _, _ = deepspeed.initialize(
                model=module,
                model_parameters=[q for q in module.parameters() if q.requires_grad],
                optimizer=make_optimizer([q for q in module.parameters() if q.requires_grad], cfg),
                lr_scheduler=make_scheduler(cfg),
                config=deepspeed_config(cfg),
            )
        self.snapshot = async_save.SnapshotEngine()
        self.engine.checkpoint_engine = self.snapshot  # saves snapshot to host memory; a thread writes them
        self.saver = async_save.BackgroundSaver()
        self.ckpt_group = tdist.new_group(backend="gloo", timeout=timedelta(seconds=cfg.cluster.hang_timeout_s))
        self.saves: list[dict[str, Any]] = []  # rank 0: per committed save, its seconds and training's stall
        self.memory = MemoryTrace()  # this rank's RSS after each step (after its save): the summary's rss_trace
        seed_rank(cfg.train.seed, self.dp_rank, self.stage)
        self.device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        if self.rank == 0:
            log.info("engine ready: %d ranks (%s)", self.world, p.layout.describe())

    # ---- checkpoints -------------------------------------------------------------------------

    def save(self, root: Path, step: int, losses: list[float]) -> Path:
        """Snapshot this rank's checkpoint to host memory and hand the write + commit to the background
        thread (tasks/train/async_save.py); training is blocked only for the snapshot (and for a previous
        save still in flight)."""
        started = time.perf_counter()
        waited = self.saver.wait()
        tag = ck.tag_for(step)
        tmp = root / f"tmp-{tag}"
        try:  # writes only DeepSpeed's small recovery scripts; the state goes to host memory
            self.engine.save_checkpoint(str(root), tag=tmp.name, save_latest=False,
                                        exclude_frozen_parameters=self.base_path is not None)
        except OSError as exc:
            raise TrainingFailedError(f"checkpoint {tag} failed on rank {self.rank}: {exc}") from exc
        files = self.snapshot.take()
        state = ck.rank_state_bytes(self.sampler.position(step), {"losses": list(losses) if self.rank == 0 else []})
        stall = time.perf_counter() - started
        if self.rank == 0:
            log.info("checkpoint %s snapshotted: training blocked %.2fs (%.2fs of it waiting for the previous save)",
                     tag, stall, waited)
        self.saver.submit(lambda: self._write_and_commit(root, tag, step, files, state, started, stall))
        return root / tag

    def _agree(self, error: str | None, what: str) -> None:
        """Every rank's background thread learns whether any rank failed `what` (no rank waits forever)."""
        errors: list[Any] = [None] * self.world
        tdist.all_gather_object(errors, error, group=self.ckpt_group)
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if failed:
            raise TrainingFailedError(f"checkpoint {what} failed on rank {failed[0][0]}: {failed[0][1]}")

    def _write_and_commit(self, root: Path, tag: str, step: int, files: list[tuple[str, Any]], state: bytes,
                          started: float, stall: float) -> None:
        """Background thread: write this rank's files, then commit (marker, rename, `latest`) and mirror."""
        error = None
        try:
            for path, data in files:
                async_save.write_file(path, data)
            atomic_write_bytes(ck.rank_file(root / f"tmp-{tag}", self.rank), state)
            if self.base_path is not None and (self.rank == 0 or (self.node_local and self.leader)):
                atomic_write_json(root / f"tmp-{tag}" / CHECKPOINT_BASE_FILE, {"path": str(self.base_path.resolve())})
        except Exception as exc:  # reported to every rank by _agree, raised on the training thread
            error = f"writing {root / f'tmp-{tag}'}: {type(exc).__name__}: {exc}"
        self._agree(error, f"{tag} write")
        final = root / tag
        error = None
        if self.rank == 0 or (self.node_local and self.leader):  # node-local: every node commits its own part
            try:
                marker = ck.make_marker(self.cfg, self.run_identity, tag, step, self.world)
                ck.finalize(root, tag, marker, self.cfg.train.keep_last)
            except Exception as exc:
                error = f"committing {final}: {type(exc).__name__}: {exc}"
        self._agree(error, f"{tag} commit")
        if self.mirror is not None:
            self._mirror(final, tag)
        if self.rank == 0:
            seconds = time.perf_counter() - started
            size = sum(f.stat().st_size for f in final.iterdir() if f.is_file())
            log.info("checkpoint committed: %s (%d bytes, %.2fs save, training blocked %.2fs)", final, size, seconds,
                     stall)
            row = {"tag": tag, "step": step, "bytes": size, "seconds": round(seconds, 4), "stall_s": round(stall, 4)}
            self.saves.append(row)
            with open(root.parent / "checkpoints.jsonl", "a") as fh:
                fh.write(json.dumps(row) + "\n")

    def _mirror(self, final: Path, tag: str) -> None:
        """Upload the committed checkpoint: each node's files once, then rank 0's marker and `latest`."""
        assert self.mirror is not None
        names = sorted(p.name for p in final.iterdir() if p.is_file()) if self.leader else []
        listings: list[Any] = [None] * self.world
        tdist.all_gather_object(listings, names, group=self.ckpt_group)
        error = None
        try:
            self.mirror.upload(final, tag, assign_uploads(listings)[self.rank])
        except Exception as exc:
            error = f"uploading to {self.mirror.url}: {type(exc).__name__}: {exc}"
        self._agree(error, f"{tag} mirror upload")
        error = None
        if self.rank == 0:
            try:
                self.mirror.commit(final, tag, self.cfg.train.keep_last)
            except Exception as exc:
                error = f"committing in {self.mirror.url}: {type(exc).__name__}: {exc}"
        self._agree(error, f"{tag} mirror commit")

    def _resume_point(self) -> tuple[str, dict[str, Any]] | None:
        """(tag, marker) of the checkpoint this run resumes from, the same on every rank, after sweeping a
        crashed commit's leftovers: this run's `latest`, else (node-local disks, or a disk that lost the run)
        the mirror's, whose marker every node first takes (its files come in `resume`). A tp/pp change
        against it is refused here, before the engine is built; dp may change (tasks/train/reshard.py)."""
        if self.leader:
            self.root.mkdir(parents=True, exist_ok=True)
        tdist.barrier()
        self.node_local = self._node_local()
        if self.rank == 0 or (self.node_local and self.leader):
            ck.sweep_incomplete(self.root)
        tdist.barrier()
        if self.node_local and self.mirror is None:
            raise InvalidInputError(
                f"{self.root}: the checkpoint directory is not shared by all nodes (each has its own); set "
                "train.checkpoint_url so checkpoints are mirrored and a retry on other nodes can resume")
        found = None if self.node_local else ck.find_resume(self.root, self.run_identity)
        if found is None and self.mirror is not None:
            found = self._mirrored_resume_point()
        if found is not None:
            ck.check_layout(found[1], self.cfg.parallel.layout, str(self.root / found[0]))
        return found

    def _mirrored_resume_point(self) -> tuple[str, dict[str, Any]] | None:
        """The mirror's latest tag (rank 0 asks), its marker taken into each checkpoint root that lacks it."""
        assert self.mirror is not None
        latest: list[Any] = [self.mirror.latest() if self.rank == 0 else None]
        tdist.broadcast_object_list(latest, src=0)
        if latest[0] is not None and (self.leader if self.node_local else self.rank == 0):
            self.mirror.fetch_marker(latest[0], self.root)
        tdist.barrier()
        if latest[0] is None:
            return None
        return latest[0], ck.validate_checkpoint_dir(self.root / latest[0], self.run_identity.config_fingerprint,
                                                     self.run_identity.experiment_key)

    def _node_local(self) -> bool:
        """Whether the checkpoint root is each node's own disk rather than one directory every rank sees:
        rank 0 leaves a probe there and every rank looks for it."""
        nonce: list[Any] = [uuid.uuid4().hex if self.rank == 0 else None]
        tdist.broadcast_object_list(nonce, src=0)
        probe = self.root / f".probe-{nonce[0]}"
        if self.rank == 0:
            probe.touch()
        tdist.barrier()
        seen: list[Any] = [None] * self.world
        tdist.all_gather_object(seen, probe.exists())
        tdist.barrier()
        if self.rank == 0:
            probe.unlink()
        if not all(seen) and self.rank == 0:
            log.info("checkpoints are node-local (%d of %d ranks see rank 0's directory)", sum(seen), self.world)
        return not all(seen)

    def resume(self) -> tuple[int, list[float]]:
        """Load the resume point: as written, or at another dp (its ZeRO partitions cut anew, each rank reading
        only the old ones overlapping its share; the same global batch, so the same samples follow)."""
        self.resharded: dict[str, int] | None = None
        if self.resume_from is None:
            return 0, []
        tag, marker = self.resume_from
        root, dp = self.root, self.cfg.parallel.dp
        step, old_dp = int(marker["step"]), int(marker["layout"]["dp"])
        resharded, zero = old_dp != dp, self.engine.zero_optimization()
        if resharded and not zero and use_bf16(self.cfg):
            raise InvalidInputError(f"{root / tag}: written at parallel.dp={old_dp}; resuming at dp={dp} needs "
                                    "parallel.zero_stage 1 or 2 under bf16 (its optimizer is partitioned by dp)")
        if self.mirror is not None:
            self._fetch_rank_files(tag, old_dp)
        load_path, _ = self.engine.load_checkpoint(
            str(root), tag=tag, load_optimizer_states=not (resharded and zero), load_lr_scheduler_states=True,
            load_module_strict=self.base_path is None,  # adapter-only: the base is already in place
        )
        if load_path is None:
            raise InvalidInputError(f"{root / tag}: DeepSpeed could not load the checkpoint")
        read = reshard.load_zero_partitions(self.engine, root, tag, old_dp) if resharded and zero else 0
        state = ck.load_rank_state(root / tag, self.rank) if not resharded or self.rank == 0 else None
        if resharded:  # the old ranks' RNG streams have no owner now: dropout masks follow the new layout
            seed_rank(self.cfg.train.seed + step, self.dp_rank, self.stage)
        else:
            ck.set_rng_state(state["rng"])
        if state is not None and state["data_position"]["step"] != step:
            raise InvalidInputError(f"{root / tag}: data position {state['data_position']} does not match step {step}")
        if resharded:
            self.resharded = {"from_dp": old_dp, "to_dp": dp, "at_step": step}
            if self.rank == 0:
                log.info("resharded %s from dp=%d to dp=%d (global batch %d, %d micro-batches per rank; rank 0 "
                         "read %d old ZeRO partitions)", root / tag, old_dp, dp, self.sampler.global_batch,
                         self.cfg.parallel.micro_batches, read)
        if self.rank == 0:
            log.info("resumed from %s (step %d)", root / tag, step)
        return step, list(state.get("losses", [])) if state is not None else []

    def _fetch_rank_files(self, tag: str, old_dp: int) -> None:
        """Download from the mirror the files this run's ranks load that their checkpoint root lacks: each node
        its own ranks' share (a replaced node: only that), each file once per root."""
        assert self.mirror is not None
        available: list[Any] = [self.mirror.names(tag) if self.rank == 0 else None]
        tdist.broadcast_object_list(available, src=0)
        mine = reshard.rank_files(self.engine, self.root, tag, available[0], old_dp, self.rank)
        listings: list[Any] = [None] * self.world
        tdist.all_gather_object(listings, mine)
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", self.world))

        def root_of(rank: int) -> int:  # ranks sharing one checkpoint root
            return rank // per_node if self.node_local else 0

        sharing = [names if root_of(r) == root_of(self.rank) else [] for r, names in enumerate(listings)]
        error, fetched = None, 0
        try:
            fetched = self.mirror.fetch_files(tag, self.root / tag, assign_uploads(sharing)[self.rank])
        except Exception as exc:  # every rank learns it: none waits forever for a rank that failed
            error = f"fetching {tag} from the mirror {self.mirror.url}: {type(exc).__name__}: {exc}"
        results: list[Any] = [None] * self.world
        tdist.all_gather_object(results, (error, fetched))
        failed = [(r, e) for r, (e, _) in enumerate(results) if e is not None]
        if failed:
            raise TrainingFailedError(f"rank {failed[0][0]}: {failed[0][1]}")
        counts = [n for _, n in results]
        if self.rank == 0 and sum(counts):
            log.info("checkpoint %s: %d files fetched from the mirror (per rank: %s)", tag, sum(counts), counts)

    # ---- the loop ----------------------------------------------------------------------------

    def batches(self, step0: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for idx in self.sampler.rank_micro_batches(step0, self.dp_rank):
            x, y = split_inputs(self.windows.get(idx))
            out.append((x.to(self.device), y.to(self.device)))
        return out

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        out = Path(cfg.train.output_dir)
        root = self.root
        start, losses = self.resume()
        m = cfg.model
        tokens = self.sampler.global_batch * m.seq_len
        peak = cfg.cluster.peak_tflops * 1e12 * self.world if torch.cuda.is_available() else None
        telemetry = Telemetry(
            out / "telemetry.jsonl", enabled=self.rank == 0, fresh=start == 0, tokens_per_step=tokens,
            flops_per_token=self.family.flops_per_token(m), peak_flops_total=peak,
            steps=cfg.train.steps, first_step=start + 1,
        )
        self.report("training", start, losses[-1] if losses else None)
        final_dir = None
        try:
            for step0 in range(start, cfg.train.steps):
                step = step0 + 1
                data = self.batches(step0)
                t0 = telemetry.start()
                loss_t = self.engine.train_batch(data_iter=iter(data))
                loss = float(loss_t.detach().float().item())
                check_finite(loss, "loss", step)
                norm = self.engine.get_global_grad_norm()
                check_finite(None if norm is None else float(norm), "grad norm", step)
                telemetry.record(step, loss, t0)
                self.saver.check()
                losses.append(loss)
                if step % cfg.train.checkpoint_every == 0 or step == cfg.train.steps:
                    final_dir = self.save(root, step, losses)
                self.memory.record(step)
                self.report("training", step, loss)
        except TrainingFailedError:
            self.saver.drain()
            raise
        self.saver.wait()  # the final checkpoint is committed before the rank reports success
        telemetry.close()
        if final_dir is None:  # resumed at the last step: nothing left to run
            final_dir = root / ck.tag_for(cfg.train.steps)
        exported = self.export_final(out, final_dir.name) if self.export is not None else None
        return self.summary(out, final_dir, start, losses, exported)

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
            "checkpoint_saves": self.saves,
            "resharded": self.resharded,
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
        trainer.run()
    except (TrainingFailedError, InvalidInputError) as exc:
        log.error("training failed: %s", exc)
        return report_failure(cfg.train.output_dir, exc, step=trainer.last_step if trainer else 0,
                              steps=cfg.train.steps)
    return finish()


if __name__ == "__main__":
    exit_without_teardown(main)
