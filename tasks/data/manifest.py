"""Datasets: the manifest format, reading one, and `manifest URL` (a prefix's objects hashed into its manifest).

A dataset is `manifest.json` plus token shards under one fsspec prefix. Shards are
flat little-endian token arrays of the manifest's `dtype` (uint16 when the vocabulary
fits, else uint32: `tasks.base.dataset_format.TOKEN_DTYPES`); splits are key prefixes
(`train/`, `heldout/`). The manifest lists every object with its size and sha256, so a warm
can verify every byte; the *manifest hash* (sha256 of the manifest file's bytes as
stored) names the dataset in the cache and in a published version's lineage. A chat dataset's
manifest has a `chat` section and lists each shard's loss mask and document starts
(`tasks.base.dataset_format.mask_key` / `starts_key`) beside it.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, ValidationInfo, field_validator

from tasks.base.dataset_format import (
    FORMAT,
    MANIFEST_KEY,
    MASK_ROOT,
    MAX_VOCAB,
    SPLITS,
    STARTS_DTYPE,
    STARTS_ROOT,
    TOKEN_DTYPES,
    SplitShape,
    dtype_capacity,
    manifest_hash,
    packed_windows_bound,
    starts_key,
    token_bytes,
    validate_key,
    window_starts,
)
from tasks.base.errors import InvalidInputError, validation_problems
from tasks.base.fsutil import put_object

log = logging.getLogger(__name__)


class ManifestFile(BaseModel):
    """One object of a dataset."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    key: str
    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")

    @field_validator("key")
    @classmethod
    def _key(cls, v: str) -> str:
        return validate_key(v)


MaskRule = Literal["generation", "prefix"]
Overlong = Literal["truncate", "drop"]
OVERLONG: tuple[str, ...] = get_args(Overlong)


class ChatFormat(BaseModel):
    """What made a chat dataset's loss mask and documents: in the manifest, so the dataset's hash (and a run's
    experiment key) changes when the template, the mask rule or the length rule does."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    template_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    mask_rule: MaskRule  # the template's {% generation %} spans, or rendered prefixes
    seq_len: int = Field(gt=0)  # a conversation longer than this many tokens was cut or dropped ...
    overlong: Overlong  # ... as this says


class Manifest(BaseModel):
    """The dataset manifest (`retrainer-dataset/1`). Parse with `Manifest.parse` to keep its hash."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal["retrainer-dataset/1"] = FORMAT
    name: str = Field(min_length=1)
    dtype: str = "uint16"
    vocab_size: int = Field(256, gt=0, le=MAX_VOCAB)
    files: list[ManifestFile]
    chat: ChatFormat | None = None  # a chat dataset: loss masks and document starts beside the token shards

    _raw: bytes | None = PrivateAttr(default=None)

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v: str) -> str:
        if v not in TOKEN_DTYPES:
            raise ValueError(f"must be one of {sorted(TOKEN_DTYPES)}, got {v!r}")
        return v

    @field_validator("vocab_size")
    @classmethod
    def _fits_dtype(cls, v: int, info: ValidationInfo) -> int:
        dtype = info.data.get("dtype")
        if dtype is not None and v > dtype_capacity(dtype):
            raise ValueError(f"{v} token ids do not fit {dtype} (at most {dtype_capacity(dtype)})")
        return v

    @field_validator("files")
    @classmethod
    def _whole_tokens(cls, files: list[ManifestFile], info: ValidationInfo) -> list[ManifestFile]:
        """Every file of a split is a token shard: a size that is not a whole number of tokens is a cut or
        foreign file, which the reader would split into misaligned tokens."""
        dtype = info.data.get("dtype")
        if dtype is None:
            return files
        width = token_bytes(dtype)
        for f in files:
            if f.key.split("/", 1)[0] in SPLITS and f.size % width:
                raise ValueError(f"{f.key}: {f.size} bytes is not a whole number of {dtype} tokens "
                                 f"({width} bytes each)")
        return files

    @field_validator("files")
    @classmethod
    def _unique(cls, files: list[ManifestFile]) -> list[ManifestFile]:
        seen: set[str] = set()
        for f in files:
            if f.key in seen:
                raise ValueError(f"duplicate key {f.key!r}")
            seen.add(f.key)
        # A key may not be both a file and a directory of another key.
        dirs = {"/".join(f.key.split("/")[:i]) for f in files for i in range(1, f.key.count("/") + 1)}
        clash = seen & dirs
        if clash:
            raise ValueError(f"key {sorted(clash)[0]!r} is both a file and a directory")
        return files

    @classmethod
    def parse(cls, raw: bytes, source: str) -> Manifest:
        """Validate manifest bytes; errors name `source` and the offending field."""
        try:
            data = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InvalidInputError(f"{source}: manifest is not valid JSON: {exc}") from None
        try:
            manifest = cls.model_validate(data)
        except ValidationError as exc:
            raise InvalidInputError(f"{source}: invalid manifest:\n  {validation_problems(exc)}") from None
        manifest._raw = bytes(raw)
        return manifest

    def to_bytes(self) -> bytes:
        """Canonical stored form (the bytes the manifest hash is taken over when we write one)."""
        if self._raw is not None:
            return self._raw
        # A plain-text manifest has no `chat` key at all: its bytes (and hash) are what they were before chat data.
        data = self.model_dump(mode="json", exclude={"chat"} if self.chat is None else set())
        return (json.dumps(data, indent=1, sort_keys=True) + "\n").encode()

    @property
    def hash(self) -> str:
        return manifest_hash(self.to_bytes())

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def split(self, name: str) -> list[ManifestFile]:
        """Files of one split (`train` or `heldout`), in key order."""
        prefix = name.rstrip("/") + "/"
        return sorted((f for f in self.files if f.key.startswith(prefix)), key=lambda f: f.key)

    def split_shape(self, name: str, seq_len: int) -> SplitShape:
        """The windows (and a chat split's documents) of one split at `seq_len`, from the listed sizes alone."""
        sizes = {f.key: f.size for f in self.files}
        width, start_width = token_bytes(self.dtype), int(STARTS_DTYPE[2:])
        windows = documents = 0
        for entry in self.split(name):
            tokens = entry.size // width
            if self.chat is None:
                windows += len(window_starts(tokens, seq_len))
            elif tokens:
                docs = sizes.get(starts_key(entry.key), 0) // start_width
                windows, documents = windows + packed_windows_bound(tokens, docs, seq_len), documents + docs
        return SplitShape(windows, documents, self.chat is not None)


def prefix_fs(url: str, storage_options: dict[str, Any] | None) -> tuple[Any, str]:
    """The fsspec filesystem of a dataset URL and the path under it."""
    import fsspec

    return fsspec.core.url_to_fs(url, **(storage_options or {}))


def object_path(root: str, key: str) -> str:
    """The path of a dataset's object `key` under its root (`prefix_fs`'s path)."""
    return f"{root.rstrip('/')}/{key}" if root else key


def claim_destination(fs: Any, root: str, url: str, *, overwrite: bool) -> None:
    """Where a dataset is about to be written (`make-data`, `prepare-data`): refuse a prefix that already holds
    one (its manifest or a split) unless `overwrite`, which removes it first, manifest first (a reader never
    sees a manifest naming a removed shard, and no shard of the old dataset stays behind)."""
    held = [key for key in (MANIFEST_KEY, *SPLITS, MASK_ROOT, STARTS_ROOT) if fs.exists(object_path(root, key))]
    if held and not overwrite:
        raise InvalidInputError(f"{url}: already holds a dataset ({', '.join(held)}): pass --overwrite to replace it")
    for key in held:
        fs.rm(object_path(root, key), recursive=True)


def read_manifest(url: str, storage_options: dict[str, Any] | None = None) -> Manifest:
    """Read and validate a manifest. `url` is the manifest object, or a dataset prefix (then `manifest.json`)."""
    if not url.rstrip("/").endswith(".json"):
        url = url.rstrip("/") + "/" + MANIFEST_KEY
    fs, path = prefix_fs(url, storage_options)
    try:
        raw = fs.cat_file(path)
    except FileNotFoundError:
        raise InvalidInputError(f"{url}: manifest not found") from None
    return Manifest.parse(raw, source=url)


def build_manifest(
    prefix_url: str,
    *,
    output_key: str = MANIFEST_KEY,
    name: str | None = None,
    vocab_size: int = 256,
    storage_options: dict[str, Any] | None = None,
) -> Manifest:
    """List every object under a prefix, hash it, and write the manifest at `output_key` under the prefix."""
    if output_key != MANIFEST_KEY:
        try:
            validate_key(output_key)
        except ValueError as exc:
            raise InvalidInputError(f"--output: {exc}") from None
    fs, root = prefix_fs(prefix_url, storage_options)
    root = root.rstrip("/")
    try:
        listing = fs.find(root, detail=True)
    except FileNotFoundError:
        raise InvalidInputError(f"{prefix_url}: prefix not found") from None
    files: list[ManifestFile] = []
    for path, info in sorted(listing.items()):
        if info.get("type") == "directory":
            continue
        key = path[len(root) + 1:] if root else path
        if key in (output_key, MANIFEST_KEY):
            continue
        h = hashlib.sha256()
        with fs.open(path, "rb") as fh:
            while chunk := fh.read(1 << 22):
                h.update(chunk)
        try:
            files.append(ManifestFile(key=key, size=int(info["size"]), sha256=h.hexdigest()))
        except ValidationError as exc:
            raise InvalidInputError(f"{prefix_url}: object {key!r} cannot be in a manifest: "
                                    f"{exc.errors()[0]['msg']}") from None
    if not files:
        raise InvalidInputError(f"{prefix_url}: no objects under this prefix")
    try:
        manifest = Manifest(name=name or Path(root).name or "dataset", vocab_size=vocab_size, files=files)
    except ValidationError as exc:
        raise InvalidInputError(f"{prefix_url}: cannot write a manifest:\n  {validation_problems(exc)}") from None
    put_object(fs, object_path(root, output_key), manifest.to_bytes())
    log.info("manifest: %d objects, %d bytes, hash %s", len(files), manifest.total_bytes, manifest.hash[:16])
    return manifest
