"""A run that stopped part-way at another global batch: found before a new run starts over from step 0.

Why: the experiment key follows the global batch, not the layout (tasks/config/key.py, rule 4), so a run
that lost nodes resumes at a smaller `parallel.dp` only if `parallel.micro_batches` makes up the difference.
A config that lowers dp alone trains a new experiment from step 0 beside the stopped one: days of GPU time
lost without a word. The plan stage asks this module first and refuses (unless forced), naming the setting
that resumes the stopped run.
"""

from __future__ import annotations

import logging
from pathlib import Path

import fsspec

from tasks.config.schema import JobConfig
from tasks.runs.identity import RunIdentity, identity
from tasks.train.checkpoint import ckpt_root, read_latest
from tasks.train.mirror import Mirror

log = logging.getLogger(__name__)

# Global batches (in micro-batches of `train.micro_batch_size`) looked for besides this config's: up to this
# many times it, and at least up to MIN_SEARCHED (a 64-node job that lost all but one node is still found).
SEARCH_FACTOR = 8
MIN_SEARCHED = 64


def _step(tag: str | None) -> int | None:
    return None if tag is None else int(tag.split("-", 1)[1])


def _latest_step(cfg: JobConfig, run_id: str, local: bool, mirrored: bool) -> int | None:
    """The newest committed step of run `run_id`: on this machine's run directory, else in the mirror."""
    if local and (step := _step(read_latest(ckpt_root(Path(cfg.train.output_dir) / run_id)))) is not None:
        return step
    if mirrored and cfg.train.checkpoint_url:
        return _step(Mirror(cfg.train.checkpoint_url, cfg.train.checkpoint_storage_options, run_id).latest())
    return None


def _mirrored_run_ids(cfg: JobConfig) -> set[str]:
    """The run ids with a folder in the checkpoint mirror (one listing), none without a mirror. A mirror this
    machine cannot list (its credentials may be the nodes' alone) is only the local directories' loss: said,
    never a failed plan."""
    if not cfg.train.checkpoint_url:
        return set()
    try:
        fs, root = fsspec.core.url_to_fs(cfg.train.checkpoint_url, **cfg.train.checkpoint_storage_options)
        return {path.rstrip("/").rsplit("/", 1)[-1] for path in fs.ls(root, detail=False)}
    except FileNotFoundError:
        return set()
    except Exception as exc:  # any store's error: credentials, network, permissions
        log.warning("plan: cannot list the checkpoint mirror %s (%s): only this machine's run directories were "
                    "searched for a stopped run at another global batch", cfg.train.checkpoint_url, exc)
        return set()


def stopped_at_another_batch(cfg: JobConfig, run: RunIdentity) -> str | None:
    """Why `run` should not start from step 0, naming the fix: a run of the same config, data and starting
    weights at another global batch stopped before `train.steps`. None when `run` has a checkpoint of its own
    (it resumes), or no such run is found (finished ones are other experiments, not lost work)."""
    out = Path(cfg.train.output_dir)
    local = {p.name for p in out.iterdir() if p.is_dir()} if out.is_dir() else set()
    mirrored = _mirrored_run_ids(cfg)
    known = local | mirrored
    if run.run_id in known and _latest_step(cfg, run.run_id, run.run_id in local,
                                                      run.run_id in mirrored) is not None:
        return None
    p = cfg.parallel
    mine = p.dp * p.micro_batches
    replay = [r.manifest_hash for r in run.replay]
    for total in range(1, max(SEARCH_FACTOR * mine, MIN_SEARCHED) + 1):
        if total == mine:
            continue
        other = cfg.model_copy(update={"parallel": p.model_copy(update={"dp": 1, "micro_batches": total})})
        run_id = identity(other, run.data_manifest_hash, run.init, replay, run.base).run_id
        if run_id not in known:
            continue
        step = _latest_step(cfg, run_id, run_id in local, run_id in mirrored)
        if step is None or step >= cfg.train.steps:
            continue
        fix = (f"set parallel.micro_batches: {total // p.dp} (dp {p.dp} x {total // p.dp} = {total})"
               if total % p.dp == 0 else
               f"choose a parallel.dp that divides {total} and parallel.micro_batches = {total} / dp")
        return (f"parallel: run {run_id} of {cfg.name} (the same config, data and starting weights) stopped at step "
                f"{step} of {cfg.train.steps} with a global batch of {total} micro-batches of "
                f"{cfg.train.micro_batch_size} windows; this config's is {mine} (parallel.dp {p.dp} x "
                f"parallel.micro_batches {p.micro_batches}): another experiment, which would start again from "
                f"step 0. To resume that run at this size, {fix}; to start the new run anyway, force it")
    return None
