"""Checkpoint commit protocol and exact-resume state.

Why: DeepSpeed writes its `latest` tag in place and saves neither RNG states
nor the data position. Here a checkpoint is written whole into
`ckpt/tmp-<tag>/` (DeepSpeed shards + one `rank-XXXXX.pt` per rank holding its
torch/numpy/python RNG states and data position), fsynced,
given a `COMPLETE` marker last, renamed to `ckpt/<tag>/`, and only then is our
own `ckpt/latest` pointer replaced atomically. A crash at any moment leaves
`latest` naming the previous complete checkpoint; stray `tmp-*` dirs are
swept at the next start and never loaded.
"""

from __future__ import annotations

import json
import logging
import random
import re
import shutil
from pathlib import Path
from typing import Any

from tasks.base.errors import InvalidInputError
from tasks.base.fsutil import atomic_write_json, fsync_dir
from tasks.base.layout import RECORDED, SLICED, Layout, recorded_axis
from tasks.config.schema import JobConfig
from tasks.runs.identity import RunIdentity
from tasks.train.commit import LATEST, MARKER, commit
from tasks.train.mirror import Mirror

log = logging.getLogger(__name__)

_TAG = re.compile(r"^step-(\d{6,})$")


def ckpt_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "ckpt"


def run_dir_of(checkpoint_dir: str | Path) -> Path:
    """The run directory a committed checkpoint `<run dir>/ckpt/<tag>` lives in (`ckpt_root`'s inverse), for a
    caller that was handed only the checkpoint (`retrainer evaluate`, `retrainer publish`)."""
    return Path(checkpoint_dir).parent.parent


def is_tag(name: str) -> bool:
    """Whether `name` is a committed checkpoint's directory name (`step-NNNNNN`)."""
    return bool(_TAG.match(name))


def tag_for(step: int) -> str:
    return f"step-{step:06d}"


def read_latest(root: Path) -> str | None:
    """The tag our `latest` pointer names, or None before the first commit."""
    try:
        tag = (root / LATEST).read_text().strip()
    except FileNotFoundError:
        return None
    if not _TAG.match(tag):
        raise InvalidInputError(f"{root / LATEST}: not a checkpoint tag: {tag!r}")
    return tag


def read_marker(path: Path) -> dict[str, Any]:
    """The COMPLETE marker of the checkpoint dir `path`; InvalidInputError when it has none or a malformed one."""
    marker_path = path / MARKER
    if not marker_path.is_file():
        raise InvalidInputError(f"{path}: not a complete checkpoint (no {MARKER} marker)")
    try:
        return json.loads(marker_path.read_text())
    except json.JSONDecodeError as exc:
        raise InvalidInputError(f"{marker_path}: malformed marker: {exc}") from None


def validate_checkpoint_dir(path: str | Path, fingerprint: str, experiment_key: str | None = None) -> dict[str, Any]:
    """Return the COMPLETE marker of a committed checkpoint; refuse incomplete or foreign ones.

    `fingerprint` (JobConfig.fingerprint) refuses another model's checkpoint; `experiment_key`, when
    given, also another run's of the same model (other data or other starting weights)."""
    path = Path(path)
    marker = read_marker(path)
    if marker.get("config_fingerprint") != fingerprint:
        raise InvalidInputError(
            f"{path}: checkpoint from another model (config fingerprint "
            f"{str(marker.get('config_fingerprint'))[:12]}..., expected {fingerprint[:12]}...)"
        )
    if experiment_key is not None and marker.get("experiment_key") != experiment_key:
        raise InvalidInputError(
            f"{path}: checkpoint from another run (experiment {str(marker.get('experiment_key'))[:16]}, "
            f"this run is {experiment_key[:16]})"
        )
    return marker


def find_resume(root: Path, run: RunIdentity) -> tuple[str, dict[str, Any]] | None:
    """(tag, marker) of the checkpoint `latest` names, validated as this run's; None when there is none."""
    tag = read_latest(root)
    if tag is None:
        return None
    return tag, validate_checkpoint_dir(root / tag, run.config_fingerprint, run.experiment_key)


def finished_summary(run_dir: Path, run: RunIdentity, steps: int) -> dict[str, Any] | None:
    """The summary of this run's completed training, if its final checkpoint is committed (same key = same
    result: it is reused instead of training again); None otherwise."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (FileNotFoundError, ValueError):
        return None
    root = ckpt_root(run_dir)
    if summary.get("experiment_key") != run.experiment_key or read_latest(root) != tag_for(steps):
        return None
    validate_checkpoint_dir(root / tag_for(steps), run.config_fingerprint, run.experiment_key)
    return summary


def sweep_incomplete(root: Path) -> None:
    """Delete `tmp-*` leftovers of a crashed commit (rank 0, before training)."""
    if not root.is_dir():
        return
    for tmp in root.glob("tmp-*"):
        log.warning("removing incomplete checkpoint %s", tmp)
        shutil.rmtree(tmp, ignore_errors=True)


def make_marker(cfg: JobConfig, run: RunIdentity, tag: str, step: int, world_size: int) -> dict[str, Any]:
    """The COMPLETE marker: what was trained (the run identity: model, data, starting weights), to which
    step, with which layout."""
    return {
        "tag": tag,
        "step": step,
        "experiment_key": run.experiment_key,
        "config_fingerprint": run.config_fingerprint,
        "run": run.to_dict(),
        "world_size": world_size,
        "layout": cfg.parallel.layout.record(),
    }


def check_layout(marker: dict[str, Any], layout: Layout, where: str) -> None:
    """Refuse, naming what changed, a run whose layout differs from its checkpoint's (`marker`, found at
    `where`) along any axis but dp: only dp may change on resume (its ZeRO partitions are cut anew,
    tasks/train/reshard.py); tensor, pipeline (and expert) slices are not."""
    written = marker.get("layout") or {}
    changed = [f"{k}={recorded_axis(written, k)} -> {getattr(layout, k)}" for k in SLICED
               if recorded_axis(written, k) != getattr(layout, k)]
    if changed:
        kept = " ".join(f"{k}={recorded_axis(written, k)}" for k in SLICED if k in RECORDED or k in written)
        raise InvalidInputError(
            f"{where}: written with parallel {kept}, this run has {layout.describe(SLICED)} "
            f"({', '.join(changed)}): resuming at another tensor or pipeline parallel size is not supported; keep "
            f"{kept} (parallel.dp may change, with micro_batch_size x micro_batches x dp unchanged), or remove the "
            "run's checkpoints to start over")


def refuse_layout_change(cfg: JobConfig, run: RunIdentity, run_dir: Path) -> None:
    """Before any rank starts: refuse a tp/pp change against the checkpoint this run would resume from (its
    own directory's `latest`, else its mirror's). Another run's checkpoint there is the ranks' to refuse."""
    root = ckpt_root(run_dir)
    tag = read_latest(root)
    if tag is not None and (root / tag / MARKER).is_file():
        marker, where = read_marker(root / tag), str(root / tag)
    elif cfg.train.checkpoint_url:
        mirror = Mirror(cfg.train.checkpoint_url, cfg.train.checkpoint_storage_options, run.run_id)
        tag = mirror.latest()
        if tag is None:
            return
        marker, where = mirror.marker(tag), f"{mirror.url}/{tag}"
    else:
        return
    if marker.get("experiment_key") == run.experiment_key:
        check_layout(marker, cfg.parallel.layout, where)


def rng_state() -> dict[str, Any]:
    import numpy as np
    import torch

    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def seed_rank(seed: int, dp_rank: int, stage: int) -> None:
    """Dropout RNG: TP peers share a seed so replicated activations get the same mask."""
    import numpy as np
    import torch

    s = seed + 1009 * dp_rank + 101 * stage
    torch.manual_seed(s)
    np.random.seed(s % 2**32)
    random.seed(s)


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def rank_file(directory: Path, rank: int) -> Path:
    return directory / f"rank-{rank:05d}.pt"


def rank_state_bytes(data_position: dict[str, int], extra: dict[str, Any]) -> bytes:
    """One rank's RNG states + data position as of now, serialized (taken on the training thread, written
    later by the background save: the state of the snapshot moment, not of the write)."""
    import io

    import torch

    buf = io.BytesIO()
    torch.save({"rng": rng_state(), "data_position": data_position, **extra}, buf)
    return buf.getvalue()


def load_rank_state(directory: Path, rank: int) -> dict[str, Any]:
    path = rank_file(directory, rank)
    if not path.is_file():
        raise InvalidInputError(f"{path}: missing per-rank state (was the checkpoint written with this layout?)")
    import torch

    return torch.load(path, weights_only=False)


def finalize(root: Path, tag: str, marker: dict[str, Any], keep_last: int) -> Path:
    """Rank 0, after every rank wrote into tmp-<tag>: marker, commit, prune."""
    atomic_write_json(root / f"tmp-{tag}" / MARKER, marker)
    final = commit(root, tag)
    prune(root, keep_last)
    return final


def prune(root: Path, keep_last: int) -> None:
    """Keep the newest `keep_last` committed checkpoints (never the one `latest` names)."""
    latest = read_latest(root)
    tags = sorted((p.name for p in root.iterdir() if _TAG.match(p.name)), key=lambda t: int(t.split("-")[1]))
    for tag in tags[:-keep_last]:
        if tag != latest:
            shutil.rmtree(root / tag, ignore_errors=True)
    fsync_dir(root)
