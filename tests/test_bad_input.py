"""Bad input at the door: a clear error naming the culprit, a non-zero exit, the registry unchanged."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tasks import REPO_ROOT
from tasks.cli import main

ROOT = REPO_ROOT
RETRAINER = str(Path(sys.executable).with_name("retrainer"))


def demo_config(tmp_path: Path, **changes) -> dict:
    cfg = yaml.safe_load((ROOT / "configs" / "tiny-llama.yaml").read_text())
    cfg["data"].update(source_url=str(tmp_path / "store" / "data"), cache_dir=str(tmp_path / "cache"))
    cfg["train"]["output_dir"] = str(tmp_path / "runs")
    cfg["publish"].update(registry_url=f"sqlite:///{tmp_path / 'registry.db'}",
                          store_url=str(tmp_path / "store" / "models"))
    for section, values in changes.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


def write(tmp_path: Path, cfg: dict, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().err


def test_wrong_field_type_names_the_field(tmp_path: Path) -> None:
    path = write(tmp_path, demo_config(tmp_path, train={"steps": "many"}))
    proc = subprocess.run([RETRAINER, "plan", str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "train.steps" in proc.stderr and str(path) in proc.stderr
    assert "Traceback" not in proc.stderr


def test_unknown_key_names_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = demo_config(tmp_path)
    cfg["train"]["learning_rat"] = 0.1
    code, err = run_cli(capsys, "plan", str(write(tmp_path, cfg)))
    assert code == 2
    assert "train.learning_rat" in err and "Extra inputs are not permitted" in err


def test_malformed_yaml_names_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("model: {d_model: 64\n  n_heads: [")
    code, err = run_cli(capsys, "plan", str(path))
    assert code == 2
    assert str(path) in err and "malformed YAML" in err


def test_missing_data_file_names_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tasks.data.synthetic import make_data

    cfg = demo_config(tmp_path)
    make_data(cfg["data"]["source_url"], name="tiny-llama", n_train_shards=2, tokens_per_shard=4096)
    missing = Path(cfg["data"]["source_url"]) / "train" / "shard-00001.bin"
    missing.unlink()
    code, err = run_cli(capsys, "warm", str(write(tmp_path, cfg)))
    assert code != 0
    assert "train/shard-00001.bin" in err
    # Nothing of the missing file under its final name in the cache.
    assert not list((tmp_path / "cache").rglob("shard-00001.bin"))


def test_rollback_to_missing_version_changes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    from tasks.registry import ArtifactStore, Lineage, Registry, upgrade

    db = f"sqlite:///{tmp_path / 'registry.db'}"
    upgrade(db)
    registry = Registry(db)
    store = ArtifactStore(str(tmp_path / "models"), {})
    for i in (1, 2):
        weights = tmp_path / f"w{i}.pt"
        torch.save({"w": torch.full((4,), float(i))}, weights)
        record = registry.publish_version("m", store.put(weights), Lineage("c", "d", "r", f"t{i}"), {"loss": 1.0 / i},
                                          created_by="test")
        registry.switch_alias("m", "production", record.version, actor="test", reason="setup")
    before = [h.to_dict() for h in registry.history("m")]

    code, err = run_cli(capsys, "rollback", "--db", db, "--model", "m", "--to", "7")
    assert code != 0
    assert "7" in err and "'m'" in err
    assert [h.to_dict() for h in registry.history("m")] == before
    assert registry.live_version("m", "production").version == 2



def test_an_unset_variable_is_refused_at_load_naming_it_and_its_key(tmp_path: Path) -> None:
    """`${VAR}` without a default and VAR unset: one line naming the variable and the key, before anything is read
    (the pretrained folder named is not there: reading it would be another error) or written; no value of
    another variable (a secret) in it."""
    secret = "s3cr3t-never-printed"
    cfg = demo_config(tmp_path, model={"pretrained": str(tmp_path / "no-such-model")})
    cfg["publish"].update(registry_url="postgresql+psycopg://retrainer:${RETRAINER_TEST_DB_PASSWORD}@db/registry",
                          storage_options={"secret": "${RETRAINER_TEST_S3_SECRET}"})
    path = write(tmp_path, cfg)
    env = {k: v for k, v in os.environ.items() if k != "RETRAINER_TEST_DB_PASSWORD"}
    env.update(RETRAINER_TEST_S3_SECRET=secret, RETRAINER_HOME=str(tmp_path / "home"))
    proc = subprocess.run([RETRAINER, "plan", str(path)], capture_output=True, text=True, timeout=120, env=env)
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == (f"retrainer: error: {path}: publish.registry_url: ${{RETRAINER_TEST_DB_PASSWORD}} is not "
                           "set (no default)\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.yaml"]  # no cache, run dir, registry or home


@pytest.mark.parametrize(("changes", "problem"), [
    ({"train": {"steps": 18446744073709551617}}, "train.steps: Input should be less than or equal to 1000000000"),
    ({"parallel": {"micro_batches": 2**63}}, "parallel.micro_batches: Input should be less than or equal to 16777216"),
    ({"train": {"seed": 2**64}}, "train.seed: Input should be less than or equal to 4294967295"),
    ({"model": {"d_model": 2**40}}, "model.d_model: Input should be less than or equal to 1048576"),
    ({"evaluate": {"batch_size": 10**6}}, "evaluate.batch_size: Input should be less than or equal to 4096"),
    ({"cluster": {"hang_timeout_s": 1e300}}, "cluster.hang_timeout_s: Input should be less than or equal to 31536000"),
    ({"train": {"micro_batch_size": 2**13}, "parallel": {"micro_batches": 2**12}},  # x dp 2
     "the global batch of 67108864 (train.micro_batch_size x parallel.micro_batches x parallel.dp) exceeds 16777216"),
])
def test_a_huge_number_is_refused_at_load_naming_the_field_and_its_bound(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], changes: dict, problem: str) -> None:
    path = write(tmp_path, demo_config(tmp_path, **changes))
    code, err = run_cli(capsys, "plan", str(path))
    assert code == 2
    assert problem in err and f"retrainer: error: {path}: invalid config" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.yaml"]


def test_steps_past_64_bits_are_refused_by_the_real_command(tmp_path: Path) -> None:
    path = write(tmp_path, demo_config(tmp_path, train={"steps": 18446744073709551617}))
    proc = subprocess.run([RETRAINER, "train", str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "train.steps: Input should be less than or equal to 1000000000" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("retrainer: error:") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.yaml"]
