"""Warm under faults: the S3 endpoint goes away for a few seconds (or for good), the cache disk fills."""

from __future__ import annotations

import hashlib
import socket
import threading
import time
from pathlib import Path

from tasks.data.synthetic import make_data
from tests.faults.conftest import Job, TaskProcess, driver, make_job, read_json, run_task
from tests.faults.test_train_faults import small_tmpfs
from tests.services import S3Endpoint, free_port


class FlakyEndpoint:
    """A TCP front for the S3 server on its own port. While down, it accepts and drops every connection
    (what a client sees when a load balancer has no backend); it counts those refusals."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.removeprefix("http://").split(":")
        self.upstream = (host, int(port))
        self.port = free_port()
        self.down = False
        self.refused = 0
        self._sock = socket.create_server(("127.0.0.1", self.port))
        self._stop = False
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _serve(self) -> None:
        while not self._stop:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            if self.down:
                self.refused += 1
                client.close()
                continue
            upstream = socket.create_connection(self.upstream)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while not self.down and (data := src.recv(65536)):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                s.close()

    def close(self) -> None:
        self._stop = True
        self._sock.close()


def s3_job(tmp: Path, s3: S3Endpoint, bucket: str, endpoint_url: str) -> Job:
    job = make_job(tmp, f"sqlite:///{tmp / 'registry.db'}")
    options = {**s3.storage_options, "client_kwargs": {"endpoint_url": s3.endpoint_url}}
    make_data(f"s3://{bucket}/tiny", name="tiny-llama", n_train_shards=8, tokens_per_shard=4096,
              storage_options=options)
    job.update("data", source_url=f"s3://{bucket}/tiny",
               storage_options={**options, "client_kwargs": {"endpoint_url": endpoint_url}})
    return job


def no_partial_files(cache: Path) -> None:
    """Every file under a final name in the cache is whole: it matches the dataset manifest."""
    for manifest in cache.rglob("manifest.json"):
        entries = {f["key"]: f for f in read_json(manifest)["files"]}
        for key, entry in entries.items():
            path = manifest.parent / key
            if path.exists():
                assert hashlib.sha256(path.read_bytes()).hexdigest() == entry["sha256"], path
    # Shards without a manifest next to them must not exist under a final name either.
    for shard in cache.rglob("shard-*.bin"):
        assert any((p / "manifest.json").exists() for p in shard.parents if cache in p.parents or p == cache), shard


def test_s3_down_for_seconds_during_warm_retries_then_succeeds(
    tmp_path: Path, s3: S3Endpoint, s3_bucket: str, no_leftovers: None
) -> None:
    front = FlakyEndpoint(s3.endpoint_url)
    try:
        job = s3_job(tmp_path, s3, s3_bucket, front.url)
        front.down = True
        task = TaskProcess(driver(job, tmp_path / "state", "warm"), tmp_path / "warm.log")
        task.wait_for(lambda: front.refused >= 1, "the warm to hit the outage", timeout=120)
        time.sleep(2.0)  # a few seconds of outage, then the endpoint is back
        front.down = False
        rc = task.finish(timeout=300)
        out = task.text()
        assert rc == 0, out[-3000:]
        assert front.refused >= 1
        warm = read_json(tmp_path / "state" / "warm.json")
        dataset = Path(warm["dataset_dir"])
        manifest = read_json(dataset / "manifest.json")
        assert len(manifest["files"]) == 9
        for entry in manifest["files"]:
            assert hashlib.sha256((dataset / entry["key"]).read_bytes()).hexdigest() == entry["sha256"]
        no_partial_files(tmp_path / "cache")
    finally:
        front.close()


def test_s3_down_for_good_fails_in_bounded_time_with_nothing_partial(
    tmp_path: Path, s3: S3Endpoint, s3_bucket: str, no_leftovers: None
) -> None:
    front = FlakyEndpoint(s3.endpoint_url)
    try:
        job = s3_job(tmp_path, s3, s3_bucket, front.url)
        front.down = True
        started = time.monotonic()
        rc, out = run_task(driver(job, tmp_path / "state", "warm"), tmp_path / "warm.log", timeout=300)
        assert rc != 0, out[-3000:]
        assert time.monotonic() - started < 300  # bounded: gave up on its own
        assert front.refused >= 2  # it did retry
        assert not (tmp_path / "state" / "warm.json").exists()
        no_partial_files(tmp_path / "cache")
        assert not list((tmp_path / "cache").rglob("*.bin"))
    finally:
        front.close()


def test_s3_down_for_good_reports_one_clear_line(
    tmp_path: Path, s3: S3Endpoint, s3_bucket: str, no_leftovers: None
) -> None:
    front = FlakyEndpoint(s3.endpoint_url)
    try:
        job = s3_job(tmp_path, s3, s3_bucket, front.url)
        front.down = True
        rc, out = run_task(driver(job, tmp_path / "state", "warm"), tmp_path / "warm.log", timeout=300)
        assert rc != 0
        assert "Traceback" not in out and "retrainer: error:" in out
    finally:
        front.close()


def test_cache_disk_full_fails_clearly_previous_dataset_intact(tmp_path: Path, no_leftovers: None) -> None:
    job = make_job(tmp_path, f"sqlite:///{tmp_path / 'registry.db'}")
    with small_tmpfs(tmp_path / "cache", "1m"):
        rc, out = run_task(driver(job, tmp_path / "a", "warm"), tmp_path / "warm-a.log")
        assert rc == 0, out[-3000:]
        first = Path(read_json(tmp_path / "a" / "warm.json")["dataset_dir"])
        before = {p: p.read_bytes() for p in first.rglob("*") if p.is_file()}

        # A second, bigger dataset (2 x 1.2 MB shards) cannot fit in what is left.
        make_data(str(tmp_path / "store" / "big"), name="big", n_train_shards=2, tokens_per_shard=600_000)
        job.update("data", source_url=str(tmp_path / "store" / "big"))
        rc, out = run_task(driver(job, tmp_path / "b", "warm"), tmp_path / "warm-b.log")
        assert rc != 0, out[-3000:]
        assert "retrainer: error:" in out
        error = out.split("retrainer: error:")[-1]
        assert "No space left" in error or "budget" in error or "space" in error, error
        assert not (tmp_path / "b" / "warm.json").exists()
        assert {p: p.read_bytes() for p in first.rglob("*") if p.is_file()} == before  # the warm one intact
        no_partial_files(tmp_path / "cache")
