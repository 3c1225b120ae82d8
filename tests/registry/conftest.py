"""Registry test helpers: a real checkpoint dir, a config pointing at the test registry, a CLI runner."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tasks import REPO_ROOT
from tasks.config.schema import JobConfig
from tasks.models.resolve import load_config

ROOT = REPO_ROOT


def make_checkpoint(root: Path, cfg: JobConfig, tag: str, seed: int = 0, *, data_manifest_hash: str = "m",
                    fingerprint: str | None = None) -> Path:
    """A checkpoint dir as the trainer leaves it: DeepSpeed layer files + COMPLETE marker with the run identity."""
    from tasks.runs.identity import identity, scratch
    from tasks.train.checkpoint import make_marker
    from tests.checkpoints import reference_state, write_layer_files

    ckpt = root / tag
    ckpt.mkdir(parents=True)
    write_layer_files(ckpt, cfg.model, reference_state(cfg.model, seed))
    run = identity(cfg, data_manifest_hash, scratch(cfg))
    marker = make_marker(cfg, run, tag, 10 * (seed + 1), cfg.parallel.layout.world_size)
    if fingerprint is not None:
        marker["config_fingerprint"] = fingerprint
    (ckpt / "COMPLETE").write_text(json.dumps(marker))
    return ckpt


def experiment_key_of(checkpoint: Path) -> str:
    return json.loads((checkpoint / "COMPLETE").read_text())["experiment_key"]


@pytest.fixture
def job_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[str], JobConfig]:
    """The demo config with publish pointed at `registry_url` and a store under tmp_path."""
    monkeypatch.setenv("RETRAINER_HOME", str(tmp_path / "home"))
    base = load_config(ROOT / "configs" / "tiny-llama.yaml")

    def make(registry_url: str, store_url: str | None = None, **extra: Any) -> JobConfig:
        overrides = {"publish.registry_url": registry_url, "publish.store_url": store_url or str(tmp_path / "store"),
                     "publish.export_dtype": "fp32"}  # the export holds the checkpoint's weights exactly
        overrides.update(extra)
        return base.with_overrides(overrides)

    return make


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., tuple[int, str, str]]:
    """Run the real `retrainer` entry point (tasks.cli.main): its parsing and error mapping as they are."""
    import tasks.cli

    def run(*argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        try:
            rc = tasks.cli.main(list(argv))
        except SystemExit as exc:  # argparse errors
            rc = int(exc.code or 0)
        out, err = capsys.readouterr()
        return rc, out, err

    return run
