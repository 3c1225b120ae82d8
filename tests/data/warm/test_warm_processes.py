"""Crash and concurrency: a SIGKILLed warm resumes; two concurrent warms of one dataset cooperate."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

from tasks.data.warm import warm
from tests.data.warm.conftest import Tree, assert_dataset_matches, subprocess_env, warm_cmd


def _final_files(dataset_dir: Path) -> int:
    return sum(1 for p in dataset_dir.rglob("*") if p.is_file()) if dataset_dir.is_dir() else 0


def test_sigkill_mid_warm_then_resume_fetches_only_missing(tree: Tree, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    dataset_dir = cache / "datasets" / tree.manifest.hash[:16]
    # One request in flight keeps the warm slow enough to kill it in the middle.
    proc = subprocess.Popen(warm_cmd(tree, cache, "--workers", "1", "--json"), env=subprocess_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while _final_files(dataset_dir) < 40 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, "the warm finished before it could be killed"

    # Nothing partial under a final name, and the dataset is not marked complete.
    present = assert_dataset_matches(dataset_dir, tree.files, complete=False)
    assert 40 <= present < len(tree.files)
    assert not (dataset_dir / "manifest.json").exists()

    resumed = warm(tree.url, cache, storage_options=tree.storage_options, progress=False)
    assert resumed.report.files_fetched == len(tree.files) - present
    assert resumed.report.files_skipped == present
    assert assert_dataset_matches(resumed.dataset_dir, tree.files) == len(tree.files)
    assert not list((cache / "partial").rglob("*.part"))


def test_two_concurrent_warms_cooperate(tree: Tree, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    procs = [subprocess.Popen(warm_cmd(tree, cache, "--json", "--workers", "8"), env=subprocess_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        outs.append(json.loads(out))

    assert {o["dataset_dir"] for o in outs} == {str(cache.resolve() / "datasets" / tree.manifest.hash[:16])}
    fetched = [o["report"]["files_fetched"] for o in outs]
    assert sum(fetched) == len(tree.files), f"files fetched twice or lost: {fetched}"
    assert sorted(fetched) == [0, len(tree.files)]  # the second waited on the lock, then found all verified
    assert assert_dataset_matches(Path(outs[0]["dataset_dir"]), tree.files) == len(tree.files)
