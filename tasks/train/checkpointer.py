"""A run's checkpoints beside its training loop: where it resumes from, the save that blocks training only for a
host-memory snapshot, the atomic commit (tasks/train/checkpoint.py), the mirror to object storage
(tasks/train/mirror.py) and the exact resume (at the same or another dp: tasks/train/reshard.py).

Why its own object: the resume point is decided before the engine exists (it picks seeded or loaded weights),
the saves need the engine, and every rank's checkpoint collectives run on one gloo group the background
thread owns; `Trainer` only calls `save` and `resume` and waits on `saver`.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as tdist

from tasks.base.errors import InvalidInputError, TrainingFailedError
from tasks.base.fsutil import atomic_write_bytes, atomic_write_json
from tasks.base.model_files import CHECKPOINT_BASE_FILE
from tasks.config.schema import TrainingJob
from tasks.runs.identity import RunIdentity
from tasks.train import async_save, reshard
from tasks.train import checkpoint as ck
from tasks.train.data import Sampler
from tasks.train.mirror import Mirror, assign_uploads

log = logging.getLogger(__name__)


class Checkpointer:
    """This rank's part in the run's checkpoints: resume point, async save + commit, mirror, resume."""

    def __init__(self, cfg: TrainingJob, run: RunIdentity, sampler: Sampler, dp_rank: int, stage: int,
                 base_path: Path | None) -> None:
        """Decides the resume point (collective: every rank constructs it at the same point)."""
        self.cfg, self.run_identity, self.sampler = cfg, run, sampler
        self.dp_rank, self.stage, self.base_path = dp_rank, stage, base_path
        self.rank, self.world = tdist.get_rank(), tdist.get_world_size()
        self.root = ck.ckpt_root(cfg.train.output_dir)
        self.leader = int(os.environ.get("LOCAL_RANK", "0")) == 0  # this node's first rank
        self.mirror = None
        if cfg.train.checkpoint_url:
            self.mirror = Mirror(cfg.train.checkpoint_url, cfg.train.checkpoint_storage_options, run.run_id)
        self.resume_from = self._resume_point()

    def attach(self, engine: Any, on_cpu: bool) -> None:
        """Take the built engine (a `TrainingEngine`): its saves go to host memory, a background thread writes and
        commits them. A CPU rank waits for the write before a step's gradients are reduced (`wait_for_snapshot`),
        so its snapshot may leave the optimizer's tensors where they live (tasks/train/async_save.py)."""
        self.engine = engine
        self.snapshot = async_save.SnapshotEngine(keep_host_tensors=on_cpu)
        self.engine.checkpoint_engine = self.snapshot  # saves snapshot to host memory; a thread writes them
        if on_cpu:  # the step's buffers and the snapshot share the host memory, and the step changes its tensors
            self.engine.before_gradient_reduce = self.wait_for_snapshot
        self.saver = async_save.BackgroundSaver()
        self.ckpt_group = tdist.new_group(backend="gloo", timeout=timedelta(seconds=self.cfg.cluster.hang_timeout_s))
        self.saves: list[dict[str, Any]] = []  # rank 0: per committed save, its seconds and training's stall
        self.snapshot_written = threading.Event()  # no snapshot held: the save in flight has written its files
        self.snapshot_written.set()
        self.snapshot_wait_s = 0.0  # seconds training waited in `wait_for_snapshot` since `take_snapshot_wait`

    def save(self, step: int, losses: list[float]) -> tuple[Path, float]:
        """Snapshot this rank's checkpoint to host memory and hand the write + commit to the background
        thread (tasks/train/async_save.py); training is blocked only for the snapshot (and for a previous
        save still in flight). The checkpoint's directory, and the seconds training was blocked."""
        root = self.root
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
        self.snapshot_written.clear()
        self.saver.submit(lambda: self._write_and_commit(root, tag, step, files, state, started, stall))
        return root / tag, stall

    def wait_for_snapshot(self) -> None:
        """Block until the save in flight has written its snapshot's files (their host copies gone; its commit
        and upload go on). A CPU rank calls it before a step's gradients are reduced: ZeRO's step buffers would
        share the host memory with the snapshot, `retrainer plan` counts the snapshot beside a forward and
        backward pass only (tasks/plan/process.py), and the optimizer step changes tensors the write reads."""
        started = time.perf_counter()
        self.snapshot_written.wait()
        self.snapshot_wait_s += time.perf_counter() - started

    def take_snapshot_wait(self) -> float:
        """The seconds `wait_for_snapshot` blocked since the last call (a step's telemetry)."""
        waited, self.snapshot_wait_s = self.snapshot_wait_s, 0.0
        return waited

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
            async_save.write_files(files)
            atomic_write_bytes(ck.rank_file(root / f"tmp-{tag}", self.rank), state)
            if self.base_path is not None and (self.rank == 0 or (self.node_local and self.leader)):
                atomic_write_json(root / f"tmp-{tag}" / CHECKPOINT_BASE_FILE, {"path": str(self.base_path.resolve())})
        except Exception as exc:  # reported to every rank by _agree, raised on the training thread
            error = f"writing {root / f'tmp-{tag}'}: {type(exc).__name__}: {exc}"
        finally:  # the snapshot's host copies are gone (write_files empties them, also on failure)
            self.snapshot_written.set()
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
        if resharded and not zero and self.engine.bfloat16_enabled():
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
        ep = self.cfg.parallel.ep
        read = reshard.load_zero_partitions(self.engine, root, tag, old_dp, ep) if resharded and zero else 0
        state = ck.load_rank_state(root / tag, self.rank) if not resharded or self.rank == 0 else None
        if resharded:  # the old ranks' RNG streams have no owner now: dropout masks follow the new layout
            ck.seed_rank(self.cfg.train.seed + step, self.dp_rank, self.stage)
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
        mine = reshard.rank_files(self.engine, self.root, tag, available[0], old_dp, self.rank, self.cfg.parallel.ep)
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
