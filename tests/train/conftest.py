"""Fixtures for trainer tests: a dataset dir in the warm stage's format, tiny configs, free ports."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tasks.config.schema import JobConfig
from tests.services import free_port

TEXT = (
    "the quick brown fox jumps over the lazy dog. retraining a model every night needs checkpoints that "
    "survive a crash and a resume that continues exactly where training stopped. "
)


def write_dataset(root: Path, *, train_shards: int = 2, tokens_per_shard: int = 8192, heldout_tokens: int = 4096,
                  seed: int = 0) -> Path:
    """Byte-level shards (text with light noise) + manifest.json, exactly as tasks.data.warm lays them out."""
    rng = np.random.default_rng(seed)
    base = np.frombuffer(TEXT.encode() * 200, dtype=np.uint8).astype("<u2")
    files = []

    def shard(key: str, n: int) -> None:
        start = int(rng.integers(0, len(base) - n))
        tokens = base[start : start + n].copy()
        noise = rng.random(n) < 0.05
        tokens[noise] = rng.integers(0, 256, int(noise.sum()))
        path = root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        data = tokens.astype("<u2").tobytes()
        path.write_bytes(data)
        files.append({"key": key, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})

    for i in range(train_shards):
        shard(f"train/shard-{i:05d}.bin", tokens_per_shard)
    shard("heldout/shard-00000.bin", heldout_tokens)
    manifest = {"format": "retrainer-dataset/1", "name": "tiny", "dtype": "uint16", "vocab_size": 256, "files": files}
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


@pytest.fixture
def dataset_dir(tmp_path: Path) -> Path:
    return write_dataset(tmp_path / "dataset")


def tiny_config(tmp_path: Path, overrides: dict[str, object] | None = None, *, out: str = "run") -> JobConfig:
    """A tiny GPT job whose every section points into tmp_path; dotted overrides applied."""
    cfg = JobConfig.model_validate({
        "name": "tiny-test",
        "model": {"family": "gpt", "vocab_size": 256, "seq_len": 16, "n_layers": 2, "d_model": 32, "n_heads": 4,
                  "n_kv_heads": 2, "d_ff": 64, "dropout": 0.0},
        "data": {"source_url": str(tmp_path / "src"), "cache_dir": str(tmp_path / "cache")},
        "parallel": {"tp": 1, "pp": 1, "dp": 1, "zero_stage": 1, "micro_batches": 1},
        "train": {"steps": 5, "lr": 3e-3, "warmup_steps": 2, "micro_batch_size": 4, "grad_clip": 1.0,
                  "checkpoint_every": 5, "keep_last": 2, "seed": 7, "output_dir": str(tmp_path / out)},
        "cluster": {"master_port": free_port()},
        "evaluate": {"batches": 2, "batch_size": 4},
        "publish": {"registry_url": "sqlite://", "store_url": str(tmp_path / "store"), "model_name": "tiny"},
    })
    return cfg.with_overrides(overrides) if overrides else cfg


@pytest.fixture
def make_config(tmp_path: Path) -> Callable[..., JobConfig]:
    return lambda overrides=None, out="run": tiny_config(tmp_path, overrides, out=out)
