"""SIGKILL the warm task mid-download from a real S3 endpoint: the re-run completes, fetches only what
the killed attempt had not committed, and no file under a final name is partial or wrong."""

from __future__ import annotations

import hashlib
import socket
import time
from pathlib import Path

from tasks.data.synthetic import make_data
from tests.faults.conftest import TaskProcess, driver, make_job, processes_mentioning, read_json, run_task
from tests.faults.test_warm_faults import FlakyEndpoint
from tests.services import S3Endpoint

N_TRAIN = 150  # small objects, so the kill lands between commits


class SlowEndpoint(FlakyEndpoint):
    """The S3 server behind a TCP front that holds every response chunk for `delay` seconds, so a warm
    of a few hundred small objects takes seconds, not milliseconds, and the kill reliably lands mid-warm."""

    delay = 0.3

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            from_upstream = src.getpeername()[1] == self.upstream[1]
        except OSError:
            from_upstream = False
        try:
            while data := src.recv(65536):
                if from_upstream:
                    time.sleep(self.delay)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                s.close()


def final_files(cache: Path) -> list[Path]:
    return [p for p in (cache / "datasets").rglob("*") if p.is_file() and p.suffix == ".bin"]


def test_sigkill_during_warm_then_rerun_fetches_only_the_rest(
    tmp_path: Path, s3: S3Endpoint, s3_bucket: str, no_leftovers: None
) -> None:
    front = SlowEndpoint(s3.endpoint_url)
    try:
        job = make_job(tmp_path, f"sqlite:///{tmp_path / 'registry.db'}")
        options = {**s3.storage_options, "client_kwargs": {"endpoint_url": s3.endpoint_url}}
        manifest = make_data(f"s3://{s3_bucket}/many", name="tiny-llama", n_train_shards=N_TRAIN,
                             tokens_per_shard=256, storage_options=options)
        expected = {f.key: f.sha256 for f in manifest.files}
        job.update("data", source_url=f"s3://{s3_bucket}/many",
                   storage_options={**options, "client_kwargs": {"endpoint_url": front.url}})
        cache, state = tmp_path / "cache", tmp_path / "state"

        task = TaskProcess(driver(job, state, "warm"), tmp_path / "warm-1.log")
        task.wait_for(lambda: (cache / "datasets").is_dir() and len(final_files(cache)) >= 5,
                      "some shards committed", timeout=120)
        task.sigkill()
        assert processes_mentioning(str(tmp_path)) == []
        assert not (state / "warm.json").exists()
        committed = final_files(cache)
        assert 5 <= len(committed) < len(expected), "the kill did not land mid-warm"
        for path in committed:  # nothing partial under a final name
            key = f"{path.parent.name}/{path.name}"
            assert hashlib.sha256(path.read_bytes()).hexdigest() == expected[key], path

        rc, out = run_task(driver(job, state, "warm"), tmp_path / "warm-2.log", timeout=300)
        assert rc == 0, out[-3000:]
        warm = read_json(state / "warm.json")
        report = warm["report"]
        assert report["files_total"] == len(expected)
        assert 0 < report["files_fetched"] < report["files_total"]
        assert report["files_fetched"] + report["files_skipped"] == report["files_total"]
        assert report["files_fetched"] <= len(expected) - len(committed)  # what was committed is not fetched again
        dataset = Path(warm["dataset_dir"])
        assert {f["key"]: f["sha256"] for f in read_json(dataset / "manifest.json")["files"]} == expected
        for key, digest in expected.items():
            assert hashlib.sha256((dataset / key).read_bytes()).hexdigest() == digest, key
        assert not [p for p in (cache / "partial").rglob("*") if p.is_file()]
    finally:
        front.close()
