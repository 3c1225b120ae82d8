"""Streaming: a corpus twice the size of an RSS cap goes through while the whole process tree stays under it."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
from tokenizers import Tokenizer, models, pre_tokenizers

from tasks import REPO_ROOT

ROOT = REPO_ROOT
CORPUS_BYTES = 384 << 20
RSS_CAP = 192 << 20  # main process + workers; measured ~130 MiB with one worker, whatever the corpus size


def _tree_rss(proc: psutil.Process) -> int:
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):  # a worker exiting under us
            total += p.memory_info().rss
    return total


def test_peak_rss_of_the_process_tree_stays_far_below_the_corpus(tmp_path: Path) -> None:
    # Long words keep the tokenizer (the slow part) fast per byte, so a big corpus takes seconds.
    words = [f"{i:03d}" + "x" * 4093 for i in range(64)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate([*words, "<eos>"])}, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    block = b"".join((json.dumps({"text": " ".join(words[i % 60:i % 60 + 4])}) + "\n").encode() for i in range(256))
    with open(tmp_path / "big.jsonl", "wb") as fh:
        for _ in range(CORPUS_BYTES // len(block) + 1):
            fh.write(block)
    size = (tmp_path / "big.jsonl").stat().st_size
    assert size > 2 * RSS_CAP

    cmd = [sys.executable, "-m", "tasks.cli", "prepare-data", str(tmp_path / "big.jsonl"), "--tokenizer",
           str(tmp_path / "tokenizer.json"), "--eos-token", "<eos>", "--dest", str(tmp_path / "ds"), "--workers", "1"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        watched, peak = psutil.Process(proc.pid), 0
        while proc.poll() is None:
            peak = max(peak, _tree_rss(watched))
            time.sleep(0.01)
        out, err = proc.communicate()
    assert proc.returncode == 0, err
    summary = json.loads(out)
    docs = CORPUS_BYTES // len(block) * 256 + 256
    assert summary["documents"]["train"] + summary["documents"]["heldout"] == docs
    assert sum(summary["tokens"].values()) == 5 * docs  # 4 words + EOS each
    assert 0 < peak < RSS_CAP, f"peak RSS {peak / 2**20:.0f} MiB for a {size / 2**20:.0f} MiB corpus"
