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
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.config import JobConfig, sha256_json
from tasks.errors import InvalidInputError
from tasks.fsutil import atomic_write_json, sha256_file

if TYPE_CHECKING:
    from tasks.registry import Registry

log = logging.getLogger(__name__)

RUN_MARKER = "run.json"
EXPORT_DIR = "export"  # <run dir>/export/: the ranks' shard reports per tag, and publish's own export copies


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
    base: StartingWeights | None = None  # a LoRA run's frozen base (tasks/lora_runs.py); None: none or seeded

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


def resolve_starting_weights(cfg: JobConfig, registry: Registry) -> StartingWeights:
    """Turn `train.init_from` into concrete weights: a registry version (live / version:N), a path, or scratch."""
    requested = cfg.train.init_from
    model, alias = cfg.publish.model_name, cfg.publish.alias
    if requested == "scratch":
        return scratch(cfg)
    if requested == "pretrained":
        return pretrained(cfg, requested)
    if requested == "live":
        live = registry.live_version(model, alias)
        if live is None and cfg.model.pretrained is not None:
            log.info("train.init_from live: %s/%s has no live version yet: starting from model.pretrained",
                     model, alias)
            return pretrained(cfg, requested)
        if live is None:
            log.info("train.init_from live: %s/%s has no live version yet: starting from scratch", model, alias)
            return StartingWeights(requested=requested,
                                   note=f"scratch: no live version of {model}/{alias} yet")
        return StartingWeights(requested=requested, version=live.version, digest=live.artifact_digest,
                               url=live.artifact_url, note=f"{model} v{live.version} (live on {alias})",
                               trained_on=live.data_manifest_hash, kind=live.artifact_kind)
    if requested.startswith("version:"):
        from tasks.registry import NotFoundError

        number = int(requested.split(":", 1)[1])
        try:
            record = registry.get_version(model, number)
        except NotFoundError as exc:
            raise InvalidInputError(f"train.init_from {requested}: {exc}") from None
        return StartingWeights(requested=requested, version=number, digest=record.artifact_digest,
                               url=record.artifact_url, note=f"{model} v{number}",
                               trained_on=record.data_manifest_hash, kind=record.artifact_kind)
    path = Path(requested).expanduser()
    if path.is_dir():
        digest = local_tree_digest(path)
        return StartingWeights(requested=requested, digest=digest, url=str(path.resolve()), kind="tree",
                               note=f"weights directory {path} (tree {digest[:12]})")
    if not path.is_file():
        raise InvalidInputError(f"train.init_from: {requested}: no such weights file or directory")
    digest = sha256_file(path)
    return StartingWeights(requested=requested, digest=digest, url=str(path.resolve()),
                           note=f"weights file {path} (sha256 {digest[:12]})")


def pretrained(cfg: JobConfig, requested: str) -> StartingWeights:
    """The weights of `model.pretrained`, identified by its listing (names, sizes, ETags) as it is now."""
    from tasks.models.pretrained import listing_digest

    url = cfg.model.pretrained
    assert url is not None
    digest = listing_digest(url, cfg.model.pretrained_storage_options)
    return StartingWeights(requested=requested, digest=digest, url=url, kind="pretrained",
                           note=f"pretrained {url} (listing {digest[:12]})")


def local_tree_digest(path: Path) -> str:
    """The tree digest of a local directory (the registry's: a manifest of path, size, sha256)."""
    from tasks.registry.store import local_tree_manifest

    return local_tree_manifest(path).digest


def for_dataset(cfg: JobConfig, dataset_dir: str | Path, replay_dirs: list[Path] | None = None) -> RunIdentity:
    """The identity of a scratch run on already-warmed datasets (`retrainer train`, launcher tests):
    `replay_dirs` are the warmed `data.replay` sources, in config order."""
    from tasks.dataset_format import MANIFEST_KEY, manifest_hash

    if len(replay_dirs or []) != len(cfg.data.replay):
        raise InvalidInputError(f"data.replay lists {len(cfg.data.replay)} sources: a run on one dataset directory "
                                "cannot train on the mixture (warm it from the config instead)")
    hashes = [manifest_hash((Path(d) / MANIFEST_KEY).read_bytes()) for d in replay_dirs or []]
    return identity(cfg, manifest_hash((Path(dataset_dir) / MANIFEST_KEY).read_bytes()), scratch(cfg), hashes)


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


def resolve_identity(cfg: JobConfig, registry: Registry) -> RunIdentity:
    """The identity of a run starting now: the data at `data.source_url` as it is, `train.init_from` resolved."""
    from tasks.warm import remote_manifest_hash

    data_hash = remote_manifest_hash(cfg.data.source_url, cfg.data.manifest, cfg.data.storage_options)
    replay = [remote_manifest_hash(r.source_url, r.manifest, r.storage_options) for r in cfg.data.replay]
    if cfg.train.lora is not None:
        from tasks.lora_runs import adapter_start, resolve_base

        base = resolve_base(cfg, registry)
        return identity(cfg, data_hash, adapter_start(cfg, registry, base), replay, base)
    return identity(cfg, data_hash, resolve_starting_weights(cfg, registry), replay)


def fetch_starting_weights(cfg: JobConfig, init: StartingWeights) -> Path | None:
    """Local, verified starting weights whose shapes match the model (None for scratch), in this machine's
    `data.cache_dir` (see `fetch_weights`)."""
    return fetch_weights(init, WeightSources.of(cfg))


@dataclass(frozen=True)
class WeightSources:
    """What fetching starting weights needs of a job, and no more (a training node gets exactly this)."""

    cache_dir: str
    model: dict[str, Any]
    store_url: str
    store_options: dict[str, Any]

    @classmethod
    def of(cls, cfg: JobConfig) -> WeightSources:
        return cls(cache_dir=cfg.data.cache_dir, model=cfg.model.model_dump(mode="json"),
                   store_url=cfg.publish.store_url, store_options=cfg.publish.storage_options)


def weights_path(init: StartingWeights, cache_dir: str) -> Path | None:
    """Where `fetch_weights` puts (or finds) the starting weights under `cache_dir`, without fetching: the
    same path on every node whose cache is at the same place."""
    if init.scratch:
        return None
    assert init.digest is not None and init.url is not None
    if init.kind == "pretrained":
        from tasks.models.pretrained import model_dir

        return model_dir(cache_dir, init.digest)
    if init.version is None:
        return Path(init.url)
    return Path(cache_dir) / "weights" / (init.digest if init.kind == "tree" else f"{init.digest}.pt")


def fetch_model_files(init: StartingWeights, src: WeightSources, dest: Path) -> Path | None:
    """The config.json, generation_config.json and tokenizer files of the model a run started from, fetched
    alone into `dest` (never its weights: an export and a user metric need only these of it); None when it has
    none (scratch, a weights file)."""
    from tasks.models.export import GENERATION_CONFIG, TOKENIZER_FILES
    from tasks.models.weights import HF_CONFIG

    names = (HF_CONFIG, GENERATION_CONFIG, *TOKENIZER_FILES)
    if init.scratch or init.kind == "file":
        return None
    assert init.digest is not None and init.url is not None
    if init.kind == "pretrained":
        import fsspec

        fs, root = fsspec.core.url_to_fs(init.url, **src.model.get("pretrained_storage_options", {}))
        dest.mkdir(parents=True, exist_ok=True)
        for name in names:
            try:
                fs.get_file(f"{root.rstrip('/')}/{name}", str(dest / name))
            except FileNotFoundError:
                continue
        return dest
    if init.version is None:
        return Path(init.url)
    from tasks.registry import ArtifactStore

    return ArtifactStore(src.store_url, src.store_options).get_tree(init.digest, dest, only=names)


def fetch_weights(init: StartingWeights, src: WeightSources) -> Path | None:
    """Local, verified starting weights whose shapes match the model (None for scratch).

    Registry versions are fetched from the artifact store into `<cache_dir>/weights/` once
    (named by digest, written only after verification); a pretrained directory is warmed into
    `<cache_dir>/models/`; every shape is checked here, before any rank starts, so weights of
    another model fail naming the tensor."""
    from tasks.config import ModelConfig
    from tasks.models.weights import check_shapes

    model = ModelConfig.model_validate(src.model)
    path = weights_path(init, src.cache_dir)
    if path is None:
        return None
    assert init.digest is not None and init.url is not None
    if init.kind == "pretrained":
        from tasks.models.pretrained import warm_pretrained

        warm_pretrained(init.url, model.pretrained_storage_options, src.cache_dir, init.digest)
    elif init.version is None:
        now = local_tree_digest(path) if init.kind == "tree" else sha256_file(path)
        if now != init.digest:
            raise InvalidInputError(f"train.init_from: {path} changed since this run was planned "
                                    f"(digest was {init.digest[:12]}...); start a new run")
    else:
        from tasks.registry import ArtifactStore

        store = ArtifactStore(src.store_url, src.store_options)
        if init.kind == "tree":
            if not path.is_dir():
                log.info("starting weights: fetching %s (tree %s) into %s", init.note, init.digest[:12], path)
                store.get_tree(init.digest, path)
        else:
            if not path.is_file():
                log.info("starting weights: fetching %s (sha256 %s) into %s", init.note, init.digest[:12], path)
                store.get(init.digest, path)
    check_shapes(path, model)
    return path
