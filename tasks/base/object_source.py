"""Where a warm, or a pull of a model tree from the store, reads objects: obstore (Rust `object_store`) for S3,
fsspec for every other URL.

For many small objects the client is the bottleneck: s3fs/botocore spend ~2 ms of CPU
per request and `import s3fs` alone takes ~0.4 s. obstore signs and speaks HTTP in
Rust, releases the GIL while it waits, and imports in ~20 ms, so a no-op re-warm costs
milliseconds. It is used for `s3://` when every storage option has an obstore
equivalent and the credentials come from the options or the AWS_* environment;
anything else (profiles, TLS settings, other protocols) goes through fsspec, which
stays the general path. Both expose the same four reads to the fetcher.

For a few large objects (a model's shards) s3fs is the bottleneck too: its reads, in Python, ran at 200-280 MB/s
on a core where obstore's ran at 400+ (bench/pull_s3.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, Protocol

from tasks.base.errors import InvalidInputError
from tasks.base.fsutil import is_local_fs, leads_outside

log = logging.getLogger(__name__)

STREAM_CHUNK = 1 << 20
# obstore's own retries (connection errors, dropped connections, 5xx), kept short: every read is
# retried again by the fetcher (tasks/fetch, with backoff), since obstore does not retry every failure to
# send a request, and an endpoint that is down for good must fail the warm in seconds.
_OBSTORE_RETRY = {"max_retries": 2, "retry_timeout": timedelta(seconds=10),
                  "backoff": {"init_backoff": timedelta(milliseconds=200), "max_backoff": timedelta(seconds=2),
                              "base": 2}}
# No overall request timeout short enough to cut a multi-GB streamed object; stalls are caught per read.
_OBSTORE_CLIENT = {"connect_timeout": timedelta(seconds=10), "read_timeout": timedelta(seconds=60),
                   "timeout": timedelta(hours=1)}
# s3fs storage options that have an exact obstore counterpart; any other option means fsspec.
_S3_OPTIONS = {"key", "secret", "token", "anon", "endpoint_url", "client_kwargs", "config_kwargs"}
_S3_CLIENT_KWARGS = {"endpoint_url", "region_name"}
_S3_CONFIG_KWARGS = {"max_pool_connections", "signature_version"}  # transport tuning only


class RangeUnsupportedError(Exception):
    """The server answered a ranged GET with the whole object (HTTP 200): read it as one stream."""


class ObjectSource(Protocol):
    """Reads of one dataset prefix; keys are relative to it."""

    name: str  # for messages: the URL and endpoint, never credentials

    def read(self, key: str) -> Any: ...  # whole object as a buffer

    def read_range(self, key: str, start: int, end: int) -> Any: ...  # [start, end)

    def stream(self, key: str) -> Iterator[Any]: ...  # whole object in chunks

    def size(self, key: str) -> int: ...


class ObstoreS3Source:
    def __init__(self, store: Any, name: str) -> None:
        self.store = store
        self.name = name

    @contextlib.contextmanager
    def _errors(self, key: str) -> Iterator[None]:
        """obstore's NotFoundError as FileNotFoundError (not retried); a 200 to a ranged GET as its own error."""
        import obstore

        try:
            yield
        except obstore.exceptions.NotFoundError:
            raise FileNotFoundError(f"{self.name}: {key} not found") from None
        except obstore.exceptions.GenericError as exc:
            # object_store refuses a 200 to a ranged request (`rclone serve s3` sends one); its message
            # is the only marker it gives.
            if "non-partial" in str(exc):
                raise RangeUnsupportedError(str(exc).splitlines()[0]) from None
            raise

    def read(self, key: str) -> Any:
        import obstore

        with self._errors(key):
            return obstore.get(self.store, key).bytes()

    def read_range(self, key: str, start: int, end: int) -> Any:
        import obstore

        with self._errors(key):
            return obstore.get_range(self.store, key, start=start, end=end)

    def stream(self, key: str) -> Iterator[Any]:
        import obstore

        with self._errors(key):
            result = obstore.get(self.store, key)
        yield from result.stream(min_chunk_size=STREAM_CHUNK)

    def size(self, key: str) -> int:
        import obstore

        with self._errors(key):
            return int(obstore.head(self.store, key)["size"])


class FsspecSource:
    def __init__(self, fs: Any, root: str, name: str) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.name = name
        self._local = is_local_fs(fs)

    def _path(self, key: str) -> str:
        """The key's path; on this machine's disk, refused when a symlink leads out of the root (the folder
        itself may be a link: it is followed first)."""
        path = f"{self.root}/{key}" if self.root else key
        if self._local and (target := leads_outside(self.root or "/", key)) is not None:
            raise InvalidInputError(f"{self.name}: {key} is a symlink to {target}, outside {self.root}; refused")
        return path

    def read(self, key: str) -> Any:
        return self.fs.cat_file(self._path(key))

    def read_range(self, key: str, start: int, end: int) -> Any:
        return self.fs.cat_file(self._path(key), start=start, end=end)

    def stream(self, key: str) -> Iterator[Any]:
        with self.fs.open(self._path(key), "rb") as fh:
            while chunk := fh.read(STREAM_CHUNK):
                yield chunk

    def size(self, key: str) -> int:
        return int(self.fs.info(self._path(key))["size"])


def _describe(source_url: str, storage_options: dict[str, Any]) -> str:
    endpoint = storage_options.get("endpoint_url") or (storage_options.get("client_kwargs") or {}).get(
        "endpoint_url")
    return f"{source_url} (endpoint {endpoint})" if endpoint else source_url


def _obstore_s3(source_url: str, opts: dict[str, Any], max_workers: int) -> ObstoreS3Source | None:
    """An obstore S3Store equivalent to s3fs with these options, or None where it might not be."""
    client_kwargs = opts.get("client_kwargs") or {}
    config_kwargs = opts.get("config_kwargs") or {}
    if os.environ.get("RETRAINER_WARM_OBSTORE", "1") == "0" or set(opts) - _S3_OPTIONS \
            or set(client_kwargs) - _S3_CLIENT_KWARGS or set(config_kwargs) - _S3_CONFIG_KWARGS:
        return None
    anon = bool(opts.get("anon"))
    if not anon and not opts.get("key") and not os.environ.get("AWS_ACCESS_KEY_ID"):
        return None  # profiles, instance roles, SSO: botocore's credential chain, via s3fs
    endpoint = opts.get("endpoint_url") or client_kwargs.get("endpoint_url") or os.environ.get("AWS_ENDPOINT_URL")
    region = client_kwargs.get("region_name") or os.environ.get("AWS_REGION") or os.environ.get(
        "AWS_DEFAULT_REGION")
    if not endpoint and not region:
        return None  # AWS proper with an unknown region: botocore finds it, object_store would guess
    try:
        import obstore  # noqa: F401
        from obstore.store import S3Store
    except ImportError:
        return None
    bucket, _, prefix = source_url.split("://", 1)[1].partition("/")
    config: dict[str, Any] = {"region": region or "us-east-1"}
    if endpoint:
        config.update(endpoint=endpoint, allow_http=endpoint.startswith("http://"))
    else:
        config["virtual_hosted_style_request"] = True  # AWS proper: bucket.s3.<region>..., as botocore does
    if anon:
        config["skip_signature"] = True
    else:
        for ours, theirs in (("key", "access_key_id"), ("secret", "secret_access_key"), ("token", "session_token")):
            if opts.get(ours):
                config[theirs] = opts[ours]
    client = {**_OBSTORE_CLIENT, "pool_max_idle_per_host": str(max_workers)}
    store = S3Store(bucket, prefix=prefix.strip("/") or None, client_options=client,  # type: ignore[arg-type]
                    retry_config=_OBSTORE_RETRY, **config)  # type: ignore[arg-type]
    return ObstoreS3Source(store, _describe(source_url, opts))


def open_source(source_url: str, storage_options: dict[str, Any] | None, max_workers: int) -> ObjectSource:
    """The reader for `source_url`: obstore for S3 where it is equivalent to s3fs, else fsspec."""
    opts = dict(storage_options or {})
    protocol = source_url.split("://", 1)[0] if "://" in source_url else "file"
    if protocol in ("s3", "s3a"):
        fast = _obstore_s3(source_url, opts, max_workers)
        if fast is not None:
            return fast
        log.debug("%s through s3fs (storage options or credentials obstore would not match)", source_url)
        # aiobotocore's pool (10) would cap requests in flight below our thread count.
        cfg = dict(opts.get("config_kwargs") or {})
        cfg.setdefault("max_pool_connections", max_workers)
        opts["config_kwargs"] = cfg
    import fsspec

    fs, root = fsspec.core.url_to_fs(source_url, **opts)
    fs.invalidate_cache()
    return FsspecSource(fs, root, _describe(source_url, opts))
