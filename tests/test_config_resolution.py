"""A run resolves its config once and freezes the resolved form; every later process builds it from that.

The user's view: a config whose model sizes come from a pretrained model's config.json is planned once;
the run then goes on (warm, train, the triggerer following the job, evaluate, gate, publish) even if the
pretrained directory is unreachable by then, nothing in the run's snapshot holds a secret, and each
process validates the config once (counted here on JobConfig's validator), not once per call.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from tasks import REPO_ROOT
from tasks.base.errors import ConfigError
from tasks.config import load as config_module
from tasks.config.schema import JobConfig

ROOT = REPO_ROOT
SECRET = "s3cr3t-value-never-frozen"


def pretrained_dir(dest: Path) -> Path:
    """A Hugging Face model directory as far as resolution reads it: its config.json."""
    from transformers import LlamaConfig

    hf = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                     architectures=["LlamaForCausalLM"])
    dest.mkdir(parents=True)
    (dest / "config.json").write_text(json.dumps(hf.to_dict()))
    return dest


def job_file(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PRETRAINED_DIR", str(pretrained_dir(tmp / "hf")))
    monkeypatch.setenv("STORE_KEY", SECRET)
    doc = yaml.safe_load((ROOT / "configs" / "tiny-llama.yaml").read_text())
    doc["name"] = "team-llama"
    doc["model"] = {"pretrained": "${PRETRAINED_DIR}", "seq_len": 32,
                    "pretrained_storage_options": {"key": "${STORE_KEY}"}}
    doc["parallel"] = {"tp": 2, "pp": 1, "dp": 1}
    doc["train"]["output_dir"] = str(tmp / "runs")
    doc["publish"].update(registry_url=f"sqlite:///{tmp / 'registry.db'}", store_url=str(tmp / "store"))
    path = tmp / "configs" / "team-llama.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture
def validations(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Every JobConfig validation from here on (the cache of a fresh process: empty)."""
    seen: list[object] = []
    validate = JobConfig.model_validate

    def counted(data, *args, **kwargs):
        seen.append(data)
        return validate(data, *args, **kwargs)

    monkeypatch.setattr(config_module, "_VALIDATED", {})
    monkeypatch.setattr(JobConfig, "model_validate", counted)
    return seen


def new_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config_module, "_VALIDATED", {})


def test_the_plan_freezes_the_resolved_config_and_each_later_process_validates_it_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, validations: list[object]) -> None:
    from tasks import launch
    from tasks.launch.torchrun import write_worker_config
    from tasks.models.resolve import ConfigSnapshot, load_config
    from tasks.plan import plan
    from tasks.plan.evaluation import evaluation_layout
    from tasks.runs.identity import RunIdentity, scratch
    from tasks.stages.lifecycle import Planned

    path = job_file(tmp_path, monkeypatch)
    # The plan task: the form's values and the arrived data as overrides, resolved once.
    job = ConfigSnapshot.take(path, {"train.steps": 7, "publish.alias": "staging", "parallel.dp": None})
    cfg = job.config()
    assert len(validations) == 1
    assert (cfg.model.family, cfg.model.d_model, cfg.model.n_layers, cfg.model.kv_heads) == ("llama", 64, 4, 2)
    assert (cfg.train.steps, cfg.publish.alias, cfg.model.pretrained_storage_options) == (7, "staging",
                                                                                          {"key": SECRET})
    frozen = json.dumps(job.to_dict())
    assert SECRET not in frozen and "${STORE_KEY}" in frozen and "${PRETRAINED_DIR}" in frozen

    run = RunIdentity(experiment_key="k" * 64, config_fingerprint=cfg.fingerprint(), data_url=cfg.data.source_url,
                      data_manifest_hash="m" * 64,
                      init=scratch(cfg))
    plan_out = json.loads(json.dumps(Planned(job, run, plan(cfg, device="cpu"), None).to_xcom()))  # as XCom has it
    shutil.rmtree(tmp_path / "hf")  # the pretrained model is gone (or its store unreachable) after the plan

    # warm, gate, approval, publish, housekeeping: the frozen config, nothing else.
    for _task in ("warm", "gate", "approval", "publish", "housekeeping"):
        new_process(monkeypatch)
        before = len(validations)
        assert Planned.from_xcom(plan_out).config() == cfg
        assert len(validations) - before == 1
    # train and evaluate submit their jobs in their own directories; the triggerer and the resumed task follow
    # the job by its handle: each builds the frozen config once, and what it derives costs no validation.
    for what in ("train", "trigger", "evaluate"):
        new_process(monkeypatch)
        before = len(validations)
        frozen_cfg = ConfigSnapshot.from_dict(plan_out["job"]).config()
        derived = evaluation_layout(frozen_cfg) if what == "evaluate" else frozen_cfg
        spec = launch.JobSpec.from_handle({"job_name": what, "output_dir": str(tmp_path / "runs" / what)})
        launch.get_launcher(derived)
        ranks_input = json.loads(write_worker_config(derived, spec, run).read_text())  # where the ranks write
        assert ranks_input["job"]["train"]["output_dir"] == str(tmp_path / "runs" / what)
        assert Planned.from_xcom(plan_out).config() == cfg  # built again in the same process: the same one
        assert len(validations) - before == 1, what
    # A config file whose pretrained model is gone cannot be planned: only the frozen run went on.
    with pytest.raises(ConfigError, match=r"model\.pretrained: .* has no config\.json"):
        load_config(path)


def test_dag_parse_loads_each_config_once(airflow_db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          validations: list[object]) -> None:
    """The DAG processor parses the four DAG files; each config is read and validated once among them."""
    import warnings

    from airflow.dag_processing.dagbag import DagBag

    from tasks.models import resolve

    config_dir = job_file(tmp_path, monkeypatch).parent
    shutil.copy(ROOT / "configs" / "tiny-llama.yaml", config_dir / "tiny-llama.yaml")
    monkeypatch.setenv("RETRAINER_CONFIG_DIR", str(config_dir))
    loads: list[str] = []
    take = resolve.ConfigSnapshot.take.__func__

    def counted(cls, path, overrides=None):
        loads.append(Path(path).name)
        return take(cls, path, overrides)

    monkeypatch.setattr(resolve.ConfigSnapshot, "take", classmethod(counted))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bag = DagBag(dag_folder=str(ROOT / "dags"))
    assert bag.import_errors == {}
    assert {"retrain_team-llama", "retrain_tiny-llama", "rollback_model", "publish_dataset"} <= set(bag.dag_ids)
    assert sorted(loads) == ["team-llama.yaml", "tiny-llama.yaml"]
    assert len(validations) == 2
