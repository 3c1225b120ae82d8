"""A run's starting weights: resolved from `train.init_from` when the run starts, fetched onto a node's cache.

Why here, above the registry and the models: resolving asks the registry (live / version:N) and the
pretrained listing, fetching pulls from the artifact store and checks the shapes against the model; the
run identity itself (tasks/runs/identity.py) stays a plain record every layer can read. Each node's warm
(tasks/inputs/node.py), the evaluation ranks and publish fetch through `fetch_weights` / `fetch_model_files`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import fsspec

from tasks.base.errors import InvalidInputError
from tasks.base.fsutil import sha256_file
from tasks.base.model_files import GENERATION_CONFIG, HF_CONFIG, TOKENIZER_FILES
from tasks.config.model import ModelConfig
from tasks.config.schema import JobConfig
from tasks.models.pretrained import listing_digest, model_dir, planned_listing, warm_pretrained
from tasks.registry import NotFoundError
from tasks.registry.store import ArtifactStore, local_tree_manifest
from tasks.runs.identity import StartingWeights, scratch

if TYPE_CHECKING:  # the database layer (sqlalchemy, ~0.25 s) stays out of the ranks that fetch weights
    from tasks.registry import Registry

log = logging.getLogger(__name__)


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
    url = cfg.model.pretrained
    assert url is not None
    digest = listing_digest(url, cfg.model.pretrained_storage_options)
    return StartingWeights(requested=requested, digest=digest, url=url, kind="pretrained",
                           note=f"pretrained {url} (listing {digest[:12]})")


def local_tree_digest(path: Path) -> str:
    """The tree digest of a local directory (the registry's: a manifest of path, size, sha256)."""
    return local_tree_manifest(path).digest


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
        return model_dir(cache_dir, init.digest)
    if init.version is None:
        return Path(init.url)
    return Path(cache_dir) / "weights" / (init.digest if init.kind == "tree" else f"{init.digest}.pt")


def fetch_model_files(init: StartingWeights, src: WeightSources, dest: Path) -> Path | None:
    """The config.json, generation_config.json and tokenizer files of the model a run started from, fetched
    alone into `dest` (never its weights: an export and a user metric need only these of it); None when it has
    none (scratch, a weights file)."""
    names = (HF_CONFIG, GENERATION_CONFIG, *TOKENIZER_FILES)
    if init.scratch or init.kind == "file":
        return None
    assert init.digest is not None and init.url is not None
    if init.kind == "pretrained":  # the files of the folder as it was planned (and checked when warmed)
        options = src.model.get("pretrained_storage_options", {})
        listed = {e["path"] for e in planned_listing(init.url, options, init.digest)}
        fs, root = fsspec.core.url_to_fs(init.url, **options)
        dest.mkdir(parents=True, exist_ok=True)
        for name in names:
            if name in listed:
                fs.get_file(f"{root.rstrip('/')}/{name}", str(dest / name))
        return dest
    if init.version is None:
        return Path(init.url)
    return ArtifactStore(src.store_url, src.store_options).get_tree(init.digest, dest, only=names)


def fetch_weights(init: StartingWeights, src: WeightSources) -> Path | None:
    """Local, verified starting weights whose shapes match the model (None for scratch).

    Registry versions are fetched from the artifact store into `<cache_dir>/weights/` once
    (named by digest, written only after verification); a pretrained directory is warmed into
    `<cache_dir>/models/`, checked whole as it enters (tasks/models/intake.py); every other's shapes
    are checked here, before any rank starts, so weights of another model fail naming the tensor."""
    model = ModelConfig.model_validate(src.model)
    path = weights_path(init, src.cache_dir)
    if path is None:
        return None
    assert init.digest is not None and init.url is not None
    if init.kind == "pretrained":
        return warm_pretrained(init.url, model, src.cache_dir, init.digest)
    if init.version is None:
        now = local_tree_digest(path) if init.kind == "tree" else sha256_file(path)
        if now != init.digest:
            raise InvalidInputError(f"train.init_from: {path} changed since this run was planned "
                                    f"(digest was {init.digest[:12]}...); start a new run")
    else:
        store = ArtifactStore(src.store_url, src.store_options)
        if init.kind == "tree":
            if not path.is_dir():
                log.info("starting weights: fetching %s (tree %s) into %s", init.note, init.digest[:12], path)
                store.get_tree(init.digest, path)
        else:
            if not path.is_file():
                log.info("starting weights: fetching %s (sha256 %s) into %s", init.note, init.digest[:12], path)
                store.get(init.digest, path)
    from tasks.models.weights import check_shapes  # torch (~1 s): only where there are weights to check

    check_shapes(path, model)
    return path
