"""Run identity: the experiment key of a training run, and the weights it starts from.

What a run produces is decided by three things: the config fields that define training
(`JobConfig.fingerprint`), the exact data (the manifest hash) and the exact starting
weights (their digest). Their hash is the experiment key. Same key = same result: a
finished checkpoint of that key is reused and the experiment lock keeps two apart. New
data or new starting weights = a new key, hence a new run directory and a real training
run. The identity is resolved once per run (the plan stage, when the run starts: `live`
means the alias's version at that moment) and handed to every later stage.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tasks.base.dataset_format import MANIFEST_KEY, manifest_hash
from tasks.base.errors import InvalidInputError
from tasks.base.fsutil import atomic_write_json
from tasks.config.schema import JobConfig
from tasks.config.util import sha256_json

RUN_MARKER = "run.json"
EXPORT_DIR = "export"  # <run dir>/export/: the ranks' shard reports per tag, and publish's own export copies
EVAL_DIR = "eval"  # <run dir>/eval/<id>/: an evaluation's rank job (its worker config, status, summary)


@dataclass(frozen=True)
class StartingWeights:
    """Where a run's weights come from. `digest` None = scratch (seeded random init)."""

    requested: str  # train.init_from as configured
    version: int | None = None  # the registry version these weights are (live / version:N)
    digest: str | None = None  # sha256 identity of the weights
    url: str | None = None  # where they are fetched from
    note: str = "scratch"  # one line for logs and summaries
    trained_on: str | None = None  # the data manifest hash that version was trained on (registry versions)
    kind: str = "file"  # "file" (weights file), "tree" (a directory, e.g. a registry tree), "pretrained"

    @property
    def scratch(self) -> bool:
        return self.digest is None

    @property
    def origin(self) -> str:
        """Where training started, as a version records it (`started_from`): scratch, the pretrained directory,
        the registry version, or the weights path. Why not `note`: that line carries digests and the alias for
        logs; this one is what a person asks of a version ("from what?")."""
        if self.version is not None:
            return f"version {self.version}"
        if self.scratch:
            return "scratch"
        if self.kind == "pretrained":
            return f"pretrained {self.url}"
        return f"weights {'directory' if self.kind == 'tree' else 'file'} {self.url}"


@dataclass(frozen=True)
class ReplayData:
    """One replay source of a run's mixture (`data.replay`): where, which exact data, and its weight."""

    url: str
    manifest_hash: str
    weight: float


@dataclass(frozen=True)
class RunIdentity:
    """Everything that decides what one training run produces, and its key.

    `data_*` is the primary (new) data; `replay` the earlier snapshots mixed in, in config order."""

    experiment_key: str
    config_fingerprint: str
    data_manifest_hash: str
    data_url: str
    init: StartingWeights
    replay: tuple[ReplayData, ...] = ()
    base: StartingWeights | None = None  # a LoRA run's frozen base (tasks/inputs/adapter.py); None: none or seeded

    @property
    def run_id(self) -> str:
        return self.experiment_key[:16]

    def run_dir(self, cfg: JobConfig) -> Path:
        """The run's own directory: checkpoints, telemetry, summary (keyed, so a new run never resumes another)."""
        return Path(cfg.train.output_dir) / self.run_id

    def to_dict(self) -> dict[str, Any]:
        """JSON-shaped (the replay sources as a list), equal to what a JSON round trip gives back."""
        return {**asdict(self), "replay": [asdict(r) for r in self.replay]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunIdentity:
        replay = tuple(ReplayData(**r) for r in data.get("replay", ()))
        base = StartingWeights(**data["base"]) if data.get("base") else None
        return cls(**{**data, "init": StartingWeights(**data["init"]), "replay": replay, "base": base})


def nothing_new(run: RunIdentity) -> str | None:
    """Why a `live` run has nothing to do (the live version was trained on exactly this data), else None.

    Without it, a schedule firing with no new data would fine-tune production on the data it has
    already seen, every time, under a new key each time (the live version changes)."""
    init = run.init
    if init.requested != "live" or init.trained_on is None or init.trained_on != run.data_manifest_hash:
        return None
    return (f"no new data: {init.note} was trained on this data already (manifest {run.data_manifest_hash[:12]} "
            f"at {run.data_url}); nothing to train")


def experiment_key(config_fingerprint: str, data_manifest_hash: str, init_digest: str | None,
                   replay: tuple[ReplayData, ...] = (), base_digest: str | None = None) -> str:
    """The replay sources enter as (manifest hash, weight) in order (the order seeds their streams), and only
    when there are any: a run without replay keeps the key it always had. Their URLs are where, not what.
    A LoRA run's base enters by digest (its adapter settings are in the config fingerprint)."""
    key: dict[str, Any] = {"config": config_fingerprint, "data": data_manifest_hash, "init": init_digest or "scratch"}
    if replay:
        key["replay"] = [[r.manifest_hash, r.weight] for r in replay]
    if base_digest is not None:
        key["base"] = base_digest
    return sha256_json(key)


def identity(cfg: JobConfig, data_manifest_hash: str, init: StartingWeights,
             replay_hashes: list[str] | None = None, base: StartingWeights | None = None) -> RunIdentity:
    """`replay_hashes`: the manifest hash of each `data.replay` source, in config order."""
    replay = tuple(ReplayData(url=r.source_url, manifest_hash=h, weight=r.weight)
                   for r, h in zip(cfg.data.replay, replay_hashes or [], strict=True))
    fingerprint = cfg.fingerprint()
    return RunIdentity(
        experiment_key=experiment_key(fingerprint, data_manifest_hash, init.digest, replay,
                                      None if base is None else base.digest),
        config_fingerprint=fingerprint, data_manifest_hash=data_manifest_hash, data_url=cfg.data.source_url,
        init=init, replay=replay, base=base,
    )


def scratch(cfg: JobConfig) -> StartingWeights:
    return StartingWeights(requested=cfg.train.init_from, note=f"scratch (seeded init, seed {cfg.train.seed})")


def for_dataset(cfg: JobConfig, dataset_dir: str | Path, replay_dirs: list[Path] | None = None,
                init: StartingWeights | None = None, base: StartingWeights | None = None) -> RunIdentity:
    """The identity of a run on already-warmed datasets (`retrainer train`, launcher tests): `replay_dirs` are
    the warmed `data.replay` sources, in config order; `init` (default: scratch) and `base` what it starts
    from, as `tasks.inputs.start.resolve_start` resolved them."""
    if len(replay_dirs or []) != len(cfg.data.replay):
        raise InvalidInputError(f"data.replay lists {len(cfg.data.replay)} sources: a run on one dataset directory "
                                "cannot train on the mixture (warm it from the config instead)")
    hashes = [manifest_hash((Path(d) / MANIFEST_KEY).read_bytes()) for d in replay_dirs or []]
    return identity(cfg, manifest_hash((Path(dataset_dir) / MANIFEST_KEY).read_bytes()), init or scratch(cfg),
                    hashes, base)


def claim_run_dir(run_dir: Path, run: RunIdentity) -> None:
    """Mark `run_dir` as this key's; refuse a directory that belongs to another key (never reuse it)."""
    marker = run_dir / RUN_MARKER
    try:
        owner = json.loads(marker.read_text()).get("experiment_key")
    except FileNotFoundError:
        atomic_write_json(marker, run.to_dict())
        return
    except (OSError, ValueError) as exc:
        raise InvalidInputError(f"{marker}: unreadable run marker: {exc}") from None
    if owner != run.experiment_key:
        raise InvalidInputError(
            f"{run_dir}: run directory belongs to experiment {owner}, not to this run's {run.experiment_key}; "
            "refusing to reuse it"
        )
