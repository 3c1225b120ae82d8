"""Deploy on model events, in one process (`retrainer deploy`, tasks.deploy): a real Hugging Face export of a tiny
Llama (the project's own exporter), a real SQLite registry and artifact store, the smoke test's real transformers
process, real hook processes.

A good export reproduces the loss its evaluation recorded and reaches the hook, which sees it in its environment
(and no expanded secret on any command line); a broken export (a truncated shard, weights that are not what was
evaluated) fails the smoke test and the alias goes back, audited with the reason; a corrupt artifact fails the
verified pull the same way; a version that is live because of a rollback is never rolled back again.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from retrainer_airflow.contract import RUN_NOTE_KEY, refusal_noted

from tasks import REPO_ROOT
from tasks.base.errors import ConfigError
from tasks.config.schema import JobConfig
from tasks.deploy.handoff import run_hook
from tasks.deploy.pull import pull
from tasks.deploy.rollback import roll_back
from tasks.deploy.target import DeployError, resolve_target
from tasks.models.resolve import load_config
from tasks.registry import ArtifactStore, Lineage, Registry, upgrade

ROOT = REPO_ROOT
MODEL, ALIAS = "tiny-llama", "production"


@dataclass(frozen=True)
class Export:
    """The exporter's output for one checkpoint, and what its evaluation recorded."""

    dir: Path
    metrics: dict[str, Any]
    data_url: str
    manifest_hash: str


def _document(root: Path, deploy: dict[str, Any]) -> dict[str, Any]:
    cfg = yaml.safe_load((ROOT / "configs" / "tiny-llama.yaml").read_text())
    cfg["data"].update(source_url=str(root.parent / "data"), cache_dir=str(root / "cache"))
    cfg["evaluate"].update(batches=2, batch_size=4)
    cfg["publish"].update(registry_url=f"sqlite:///{root / 'registry.db'}", store_url=str(root / "store"),
                          export_dtype="fp32")
    cfg["deploy"] = deploy
    return cfg


def _evaluated(cfg: JobConfig, checkpoint: Path) -> dict[str, Any]:
    """What the evaluate stage records, scored here by the project's own reference model on exactly the
    evaluation's windows (the model is tiny: one process holds it)."""
    import torch

    from tasks.evaluate.spec import resolve_suites, suite_hash, window_order
    from tasks.models.weights import load_reference
    from tasks.runs.identity import RunIdentity
    from tasks.train.data import TokenWindows

    run = RunIdentity.from_dict(json.loads((checkpoint / "COMPLETE").read_text())["run"])
    suites = resolve_suites(cfg, run)
    windows = TokenWindows(run.data_url, "heldout", cfg.model.seq_len, cfg.model.vocab_size)
    tokens = windows.get(window_order(len(windows), cfg.evaluate.batches, cfg.evaluate.batch_size))
    model = load_reference(checkpoint, cfg.model, as_dtype=cfg.publish.export_dtype).eval()
    with torch.no_grad():
        logits = model(tokens[:, :-1]).double()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).item()
    return {"metrics": {"heldout.loss": loss}, "loss": loss, "suites": suites, "suite_hash": suite_hash(cfg, suites),
            "batches": cfg.evaluate.batches, "batch_size": cfg.evaluate.batch_size}


@pytest.fixture(scope="module")
def export(tmp_path_factory: pytest.TempPathFactory) -> Export:
    """One real publish (tasks.stages.publish: the checkpoint exported as a Hugging Face directory), its tree kept."""
    from tasks.data.synthetic import make_data
    from tasks.stages.publish import publish
    from tests.registry.conftest import experiment_key_of, make_checkpoint

    root = tmp_path_factory.mktemp("deploy-export") / "publisher"
    root.mkdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RETRAINER_HOME", str(root / "home"))
        path = root / "job.yaml"
        path.write_text(yaml.safe_dump(_document(root, {})))
        cfg = load_config(path)
        upgrade(cfg.publish.registry_url)
        manifest = make_data(cfg.data.source_url, name=MODEL, n_train_shards=1, tokens_per_shard=4096)
        checkpoint = make_checkpoint(root / "ckpt", cfg, "step-10", seed=1, data_manifest_hash=manifest.hash)
        metrics = _evaluated(cfg, checkpoint)
        result = publish(cfg, checkpoint, metrics, experiment_key=experiment_key_of(checkpoint), actor="ci")
        tree = ArtifactStore(cfg.publish.store_url).get_tree(result.digest, root / "tree")
    return Export(dir=tree, metrics=metrics, data_url=cfg.data.source_url, manifest_hash=manifest.hash)


@pytest.fixture
def job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, export: Export):
    """`job(deploy_section)` -> (config path, config): this test's own registry, store and serving directory."""
    monkeypatch.setenv("RETRAINER_HOME", str(tmp_path / "home"))
    root = tmp_path / "deployer"
    root.mkdir()
    (tmp_path / "data").symlink_to(export.data_url)  # the data the export was evaluated on
    upgrade(f"sqlite:///{root / 'registry.db'}")

    def make(**deploy: Any) -> tuple[Path, JobConfig]:
        path = root / "job.yaml"
        path.write_text(yaml.safe_dump(_document(root, {"enabled": True, "models_dir": str(root / "serving"),
                                                        **deploy})))
        return path, load_config(path)

    return make


def publish_tree(cfg: JobConfig, directory: Path, metrics: dict[str, Any], export: Export) -> int:
    """Publish a directory as the next version and point the alias at it (publish's protocol: content-addressed
    tree, immutable version, compare-and-swap switch)."""
    ref = ArtifactStore(cfg.publish.store_url).put_tree(directory)
    with Registry(cfg.publish.registry_url) as reg:
        live = reg.live_version(MODEL, ALIAS)
        lineage = Lineage(config_hash="k" * 64, data_manifest_hash=export.manifest_hash, code_revision="test",
                          checkpoint_tag=f"step-{ref.digest[:6]}", serving_bytes=None,
                          data_url=str(Path(cfg.data.source_url)))
        rec = reg.publish_version(MODEL, ref, lineage, metrics, created_by="ci")
        reg.switch_alias(MODEL, ALIAS, rec.version, expect=live.version if live else None, actor="ci",
                         reason="retrain", action="publish")
    return rec.version


def variant(export: Export, dest: Path, change) -> Path:
    """A copy of the export with `change(directory)` applied: another tree, another digest."""
    shutil.copytree(export.dir, dest)
    change(dest)
    return dest


def _shard(directory: Path) -> Path:
    """The file of the export that holds the final norm (an export has four per pipeline stage)."""
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    return directory / index["weight_map"]["model.norm.weight"]


def truncate_shard(directory: Path) -> None:
    shard = _shard(directory)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])


def scale_final_norm(directory: Path) -> None:
    """Loadable weights that are not the evaluated ones: the final RMSNorm scaled 30x."""
    from safetensors.torch import load_file, save_file

    shard = _shard(directory)
    tensors = load_file(shard)
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * 30
    save_file(tensors, shard, metadata={"format": "pt"})


def note_in_config(directory: Path) -> None:
    """A harmless change (a key transformers ignores): a second, good version."""
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "retrainer_note": "v2"}))


def _history(cfg: JobConfig) -> list[tuple[str, int | None, int, str, str]]:
    with Registry(cfg.publish.registry_url) as reg:
        return [(h.action, h.from_version, h.to_version, h.actor, h.reason) for h in reg.history(MODEL, ALIAS)]


def _live(cfg: JobConfig) -> int:
    with Registry(cfg.publish.registry_url) as reg:
        return reg.live_version(MODEL, ALIAS).version


def _deploy_cli(config: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    import tasks.cli

    capsys.readouterr()
    rc = tasks.cli.main(["deploy", str(config)])
    out, err = capsys.readouterr()
    return rc, out, err


# -- the config ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("deploy", "family", "message"), [
    ({"enabled": True}, "llama", "deploy.enabled needs a hook"),
    ({"command": "true", "entry_point": "a.b:c"}, "llama", "set one of deploy.command and deploy.entry_point"),
    ({"enabled": True, "command": "true"}, "gpt", "model.family 'gpt' exports are not transformers models"),
    ({"command": "true", "smoke_test": {"loss_tolerance": 0}}, "llama", "deploy.smoke_test.loss_tolerance"),
    ({"command": "true", "smoke_test": {"generate_tokens": 0}}, "llama", "deploy.smoke_test.generate_tokens"),
    ({"command": "true", "queue": "serving host"}, "llama", "deploy.queue"),
    ({"command": "true", "models_dir": "relative/dir"}, "llama", "deploy.models_dir"),
    ({"entry_point": "not an entry point"}, "llama", "deploy.entry_point"),
    ({"hook": "true"}, "llama", "deploy.hook"),
])
def test_the_deploy_section_is_checked_at_load(tmp_path: Path, deploy: dict, family: str, message: str) -> None:
    doc = _document(tmp_path, deploy)
    doc["model"]["family"] = family
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
        load_config(path)


def test_deploy_is_off_by_default() -> None:
    cfg = load_config(ROOT / "configs" / "tiny-llama.yaml")
    assert cfg.deploy.enabled is False and cfg.deploy.command is None and cfg.deploy.entry_point is None
    assert cfg.deploy.smoke_test.loss_tolerance == 0.02


# -- deploys ------------------------------------------------------------------------------------------------


def test_a_published_export_passes_the_smoke_test_and_reaches_the_hook(
    job, export: Export, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from tasks.registry.store import local_tree_manifest

    # The hook's own secret, given as ${HOOK_TOKEN} (expanded when the config is loaded): it reaches the hook in
    # its environment, never a command line.
    monkeypatch.setenv("HOOK_TOKEN", "tok-5ec12e7")
    seen = tmp_path / "seen.txt"
    config, cfg = job(command=f'printf "%s\\n" "$RETRAINER_DEPLOY_VERSION" "$RETRAINER_DEPLOY_MODEL_DIR" '
                              f'"$RETRAINER_DEPLOY_MOVED_BY" "${{HOOK_TOKEN}}" > {seen}; '
                              f'tr "\\0" " " < /proc/$$/cmdline > {tmp_path / "cmdline.txt"}')
    assert "tok-5ec12e7" in (cfg.deploy.command or "")
    assert publish_tree(cfg, export.dir, export.metrics, export) == 1

    rc, out, err = _deploy_cli(config, capsys)
    assert rc == 0, err[-3000:]
    version, model_dir, moved_by, token = seen.read_text().splitlines()
    assert (version, moved_by, token) == ("1", "publish", "tok-5ec12e7")
    with Registry(cfg.publish.registry_url) as reg:
        assert local_tree_manifest(model_dir).digest == reg.get_version(MODEL, 1).artifact_digest
    assert Path(model_dir).parent == Path(cfg.deploy.models_dir or "")
    cmdline = (tmp_path / "cmdline.txt").read_text()
    assert "bash" in cmdline and "tok-5ec12e7" not in cmdline
    # The served weights reproduce the evaluation's held-out loss (fp32 export: to float rounding).
    assert f"deployed {MODEL} v1 (production)" in out and "0.00% apart" in out, out
    assert "generated 8 tokens" in out
    assert _history(cfg) == [("publish", None, 1, "ci", "retrain")]  # nothing rolled back


@pytest.mark.parametrize(("break_it", "why"), [
    (truncate_shard, "smoke test failed: v2: loading the export with transformers: "),
    (scale_final_norm, "when evaluated"),
])
def test_a_broken_export_fails_the_smoke_test_and_the_alias_goes_back(
    job, export: Export, tmp_path: Path, capsys: pytest.CaptureFixture[str], break_it, why: str
) -> None:
    config, cfg = job(entry_point="tests.hooks.deploy:record")
    assert publish_tree(cfg, export.dir, export.metrics, export) == 1
    # v2 claims the evaluation of v1's weights, but its export is broken.
    assert publish_tree(cfg, variant(export, tmp_path / "broken", break_it), export.metrics, export) == 2

    rc, _, err = _deploy_cli(config, capsys)
    assert rc == 1
    assert why in err and "rolled production back v2 -> v1" in err, err[-3000:]
    assert _live(cfg) == 1
    action, moved_from, moved_to, actor, reason = _history(cfg)[-1]
    assert (action, moved_from, moved_to) == ("rollback", 2, 1)
    assert reason.startswith("deploy: smoke test failed: v2: ") and why in reason, reason
    assert "(cli)" in actor
    if break_it is scale_final_norm:
        assert "held-out loss" in reason and "the export does not compute what was evaluated" in reason
    assert not (Path(cfg.deploy.models_dir or "") / "hook.jsonl").exists()  # v2 never reached the hook


def test_a_corrupt_artifact_fails_the_verified_pull_and_the_alias_goes_back(job, export: Export,
                                                                             tmp_path: Path) -> None:
    from tasks.deploy.run import run_deploy

    _, cfg = job(command="exit 0")
    publish_tree(cfg, export.dir, export.metrics, export)
    v2 = publish_tree(cfg, variant(export, tmp_path / "v2", note_in_config), export.metrics, export)
    with Registry(cfg.publish.registry_url) as reg:
        stored = Path(ArtifactStore(cfg.publish.store_url).tree_path(reg.get_version(MODEL, v2).artifact_digest))
    (stored / "config.json").write_text("{}")  # the bytes in the store rot

    with pytest.raises(DeployError, match=r"pull failed: CorruptArtifactError: .*config\.json is corrupt"):
        run_deploy(cfg, actor="ci")
    assert _live(cfg) == 1
    assert _history(cfg)[-1][:3] == ("rollback", 2, 1)
    assert _history(cfg)[-1][4].startswith("deploy: pull failed: CorruptArtifactError: ")
    assert list(Path(cfg.deploy.models_dir or "").iterdir()) == []  # nothing half-pulled left


class NotedTask:
    """What `refusal_noted` needs of an Airflow task instance: the XCom it pushes the run's note to."""

    def __init__(self) -> None:
        self.notes: list[str] = []

    def xcom_push(self, key: str, value: str) -> None:
        assert key == RUN_NOTE_KEY
        self.notes.append(value)


def test_a_version_live_because_of_a_rollback_is_not_rolled_back_again(job, export: Export, tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    _, cfg = job(command="exit 0")
    publish_tree(cfg, export.dir, export.metrics, export)
    publish_tree(cfg, variant(export, tmp_path / "v2", note_in_config), export.metrics, export)

    # The deploy of v2 failed: back to v1 (compare-and-swap on v2), audited.
    failed = resolve_target(cfg, [{"version": 2}])
    assert (failed.version, failed.moved_by, failed.moved_from) == (2, "publish", 1)
    out = roll_back(cfg, failed, "hook failed: reload refused", actor="ci")
    assert (out.from_version, out.to_version) == (2, 1)
    # Its event deploys v1; that deploy failing too does not cascade: the alias stays, loudly.
    again = resolve_target(cfg, [{"version": 1}])
    assert (again.version, again.via_rollback) == (1, True)
    history = _history(cfg)
    run = NotedTask()  # the deploy DAG's rollback task: the refusal is the run's note (contract.refusal_noted)
    with pytest.raises(SystemExit, match=r"v1 is live because of a rollback \(from v2\), so it is not rolled back "
                                         "again"), refusal_noted(run, "rollback"):
        roll_back(cfg, again, "smoke test failed: v1: no GPU", actor="ci")
    assert _history(cfg) == history and _live(cfg) == 1
    assert run.notes == [f"rollback: deploy of {MODEL} v1 ({ALIAS}) failed: smoke test failed: v1: no GPU. v1 is live "
                         "because of a rollback (from v2), so it is not rolled back again: serving needs a person"]

    # The alias moved on between a deploy's start and its failure: that move is not undone.
    with Registry(cfg.publish.registry_url) as reg:
        reg.switch_alias(MODEL, ALIAS, 2, actor="operator", reason="fixed serving", action="promote", force=True)
        started = resolve_target(cfg, [{"version": 2}])
        reg.switch_alias(MODEL, ALIAS, 1, actor="operator", reason="changed my mind", action="promote")
    with pytest.raises(DeployError, match="not rolled back, the alias moved since"):
        roll_back(cfg, started, "hook failed: x", actor="ci")
    assert _live(cfg) == 1 and _history(cfg)[-1][3:] == ("operator", "changed my mind")

    # An event older than the alias: what is live now is deployed, and the log says so.
    with caplog.at_level("WARNING", logger="tasks.deploy"):
        assert resolve_target(cfg, [{"version": 2}]).version == 1
    assert "the event said tiny-llama/production moved to v2, it points to v1 now: deploying v1" in caplog.text


def test_hooks_get_the_target_and_their_failures_name_why(job, export: Export) -> None:
    _, cfg = job(entry_point="tasks.deploy.hooks:serving_pointer")
    publish_tree(cfg, export.dir, export.metrics, export)
    target = resolve_target(cfg)
    pull(cfg, target)
    run_hook(cfg, target)  # the shipped example: a serving pointer
    link = Path(cfg.deploy.models_dir or "") / ALIAS
    assert link.is_symlink() and link.resolve() == Path(target.model_dir).resolve()
    pointer = json.loads((link.parent / f"{ALIAS}.json").read_text())
    assert (pointer["version"], pointer["digest"], pointer["path"]) == (1, target.digest, target.model_dir)

    failing = cfg.model_copy(update={"deploy": cfg.deploy.model_copy(
        update={"entry_point": None, "command": "echo reloading; echo 'reload refused: 503' >&2; exit 3"})})
    with pytest.raises(DeployError, match=r"hook failed: deploy\.command for v1: the process exited 3: "
                                          r"reload refused: 503"):
        run_hook(failing, target)
    hanging = cfg.model_copy(update={"deploy": cfg.deploy.model_copy(
        update={"entry_point": None, "command": "sleep 60", "hook_timeout_s": 0.5})})
    with pytest.raises(DeployError, match=r"hook failed: deploy\.command for v1: timed out after 0\.5 s"):
        run_hook(hanging, target)
    raising = cfg.model_copy(update={"deploy": cfg.deploy.model_copy(update={"entry_point": "tasks.deploy:nope"})})
    with pytest.raises(DeployError, match=r"hook failed: deploy\.entry_point tasks\.deploy:nope for v1: "
                                          r"the process exited 1: .*deploy entry point 'tasks\.deploy:nope'"):
        run_hook(raising, target)
