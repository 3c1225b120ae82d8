"""Job config: validation at the edge, variable expansion, the experiment key, overrides."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tasks import REPO_ROOT
from tasks.base.errors import ConfigError
from tasks.config.key import GEMMA_OPTIONS, MOE_OFF, keyed_model
from tasks.models.resolve import load_config

ROOT = REPO_ROOT
DEMO = ROOT / "configs" / "tiny-llama.yaml"


def write(tmp_path: Path, mutate) -> Path:
    cfg = yaml.safe_load(DEMO.read_text())
    mutate(cfg)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_demo_config_is_valid_and_expands_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("RETRAINER_HOME", str(tmp_path))
    monkeypatch.delenv("RETRAINER_DB_URL", raising=False)
    cfg = load_config(DEMO)
    assert cfg.publish.registry_url == f"sqlite:///{tmp_path}/registry.db"
    assert cfg.data.cache_dir == f"{tmp_path}/cache"
    assert cfg.parallel.layout.world_size == 2


def test_the_chat_demo_config_reads_the_teams_model_and_its_shipped_template(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`retrainer demo --chat`: the model it writes where `model.pretrained` points sizes the config, and the
    shipped tokenizer's template marks the assistant's tokens with generation markers."""
    from tasks.cli.demo_chat import CONFIG, TOKENIZER, write_base_model
    from tasks.data.prepare.chat import load_template

    monkeypatch.setenv("RETRAINER_HOME", str(tmp_path))
    write_base_model(tmp_path / "object-store" / "models" / "tiny-chat-base")
    cfg = load_config(CONFIG)
    assert (cfg.model.family, cfg.model.vocab_size, cfg.model.seq_len, cfg.model.n_layers) == ("llama", 512, 128, 2)
    assert cfg.evaluate.benchmarks[0].include_path == f"{tmp_path}/evals/tiny-chat"
    assert "check.tiny_chat_facts.exact_match" in cfg.evaluate.metric_names()
    assert load_template(TOKENIZER).mask_rule == "generation"


def test_env_default_syntax_prefers_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RETRAINER_DB_URL", "postgresql+psycopg://u@db/registry")
    assert load_config(DEMO).publish.registry_url == "postgresql+psycopg://u@db/registry"


def test_fingerprint_ignores_run_time_knobs(tmp_path: Path) -> None:
    base = load_config(DEMO)
    moved = base.with_overrides({"cluster.master_port": 31000, "publish.alias": "staging",
                                 "train.output_dir": str(tmp_path), "train.init_from": "version:3",
                                 "data.source_url": str(tmp_path / "elsewhere")})
    assert moved.fingerprint() == base.fingerprint()
    assert base.with_overrides({"train.steps": 41}).fingerprint() != base.fingerprint()
    assert len(base.fingerprint()) == 64


def test_attention_options_at_their_plain_values_keep_the_key_a_run_had_before_they_existed() -> None:
    """A weekly run resumed across an upgrade keeps its experiment key, checkpoints and reuse: `head_dim`,
    `qk_norm` and `sliding_window` enter the key only where they change the maths."""
    base = load_config(DEMO)
    plain = base.model.d_model // base.model.n_heads
    same = base.with_overrides({"model.head_dim": plain, "model.qk_norm": False, "model.sliding_window": None})
    assert same.fingerprint() == base.fingerprint()
    mistral = base.with_overrides({"model.family": "mistral"})  # llama refuses a window at load
    assert mistral.with_overrides({"model.sliding_window": 8}).fingerprint() != mistral.fingerprint()
    assert base.with_overrides({"model.head_dim": plain * 2}).fingerprint() != base.fingerprint()
    # Gemma's options likewise: null (off) leaves the key alone, a value changes it.
    assert base.with_overrides({f"model.{o}": None for o in GEMMA_OPTIONS}).fingerprint() == base.fingerprint()
    gemma2 = base.with_overrides({"model.family": "gemma2"})
    assert gemma2.with_overrides({"model.attn_logit_softcapping": 50.0}).fingerprint() != gemma2.fingerprint()
    # The mixture-of-experts options too: a dense model's key has none of them, a MoE one has its values.
    assert not set(keyed_model(base.model.model_dump(mode="json"))) & set(MOE_OFF)
    moe = base.with_overrides({"model.family": "mixtral", "model.num_experts": 4, "model.num_experts_per_tok": 2,
                               "model.norm_topk_prob": True})
    assert moe.with_overrides({"model.router_aux_loss_coef": 0.01}).fingerprint() != moe.fingerprint()


def test_experiment_key_is_config_data_and_starting_weights(tmp_path: Path) -> None:
    """New data or new starting weights = a new run (and run dir); the same three = the same run."""
    from tasks.runs.identity import StartingWeights, identity, scratch

    cfg = load_config(DEMO)
    base = identity(cfg, "a" * 64, scratch(cfg))
    assert identity(cfg, "a" * 64, scratch(cfg)) == base
    new_data = identity(cfg, "b" * 64, scratch(cfg))
    from_v1 = identity(cfg, "a" * 64, StartingWeights("live", version=1, digest="c" * 64, url="x", note="v1"))
    keys = {base.experiment_key, new_data.experiment_key, from_v1.experiment_key}
    assert len(keys) == 3
    assert len({run.run_dir(cfg) for run in (base, new_data, from_v1)}) == 3
    # The same weights reached as "live" or as "version:1" are the same run.
    as_version = identity(cfg, "a" * 64, StartingWeights("version:1", version=1, digest="c" * 64, url="x", note=""))
    assert as_version.experiment_key == from_v1.experiment_key


def test_run_dir_of_another_key_is_refused_naming_both(tmp_path: Path) -> None:
    from tasks.base.errors import InvalidInputError
    from tasks.runs.identity import claim_run_dir, identity, scratch

    cfg = load_config(DEMO)
    mine, other = identity(cfg, "a" * 64, scratch(cfg)), identity(cfg, "b" * 64, scratch(cfg))
    claim_run_dir(tmp_path, mine)
    claim_run_dir(tmp_path, mine)  # a retry of the same run: fine
    with pytest.raises(InvalidInputError, match=rf"{other.experiment_key}.*|{mine.experiment_key}") as err:
        claim_run_dir(tmp_path, other)
    assert mine.experiment_key in str(err.value) and other.experiment_key in str(err.value)


@pytest.mark.parametrize("value", ["version:", "version:0", "version:x"])
def test_init_from_version_must_name_a_version(value: str) -> None:
    with pytest.raises(ConfigError, match=r"train\.init_from"):
        load_config(DEMO).with_overrides({"train.init_from": value})


def test_schedule_is_a_cron_or_cron_and_priority_and_engines_that_outlive_the_task_defer(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, lambda c: c.update(schedule="0 3 * * 1"))).schedule.cron == "0 3 * * 1"
    both = load_config(write(tmp_path, lambda c: c.update(schedule={"cron": None, "priority": 5}))).schedule
    assert (both.cron, both.priority) == (None, 5)
    base = load_config(DEMO)
    assert not base.cluster.defers  # local: the ranks die with the task, it cannot defer
    assert base.with_overrides({"cluster.launcher": "slurm"}).cluster.defers
    assert base.with_overrides({"cluster.launcher": "kubernetes"}).cluster.defers
    assert not base.with_overrides({"cluster.launcher": "slurm", "cluster.deferrable": False}).cluster.defers
    # Neither is part of what a run computes: the experiment key does not change.
    assert both and base.with_overrides({"cluster.deferrable": False}).fingerprint() == base.fingerprint()


def test_overrides_are_validated() -> None:
    base = load_config(DEMO)
    with pytest.raises(ConfigError, match=r"train\.steps"):
        base.with_overrides({"train.steps": 0})
    with pytest.raises(ConfigError, match="unknown field 'stepz'"):
        base.with_overrides({"train.stepz": 3})


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda c: c["parallel"].update(tp=3), r"parallel\.tp \(3\) must divide model\.n_heads"),
        (lambda c: c["parallel"].update(pp=9), r"parallel\.pp \(9\) cannot exceed model\.n_layers"),
        (lambda c: c["model"].update(d_model=-64), r"model\.d_model"),
        (lambda c: c["parallel"].update(pp=2, zero_stage=2), "zero_stage must be 0 or 1"),
        (lambda c: c.update(name="bad name; drop"), "name"),
        (lambda c: c["data"].update(replay=[{"source_url": "/a", "weight": 0.6}, {"source_url": "/b", "weight": 0.4}]),
         r"data\.replay: the weights sum to 1; data\.source_url gets 1 - that, which must be > 0"),
        (lambda c: c["data"].update(replay=[{"source_url": "/a", "weight": 1.5}]), r"data\.replay\.0\.weight"),
        (lambda c: c["data"].update(replay=[{"source_url": "/a"}]), r"data\.replay\.0\.weight"),
        (lambda c: c["data"].update(replay=[{"source_url": "/a", "weight": 0.1, "manifst": "m.json"}]),
         r"data\.replay\.0\.manifst"),
        (lambda c: c["data"].update(replay=[{"source_url": c["data"]["source_url"], "weight": 0.1}]),
         r"data\.replay: .*tiny-text.* listed twice"),
        (lambda c: c.update(retention={"keep_days": -1}), r"retention\.keep_days"),
        (lambda c: c.update(retention={"keep_run": 3}), r"retention\.keep_run"),
        # 17 sources of 1% each draw one sample a step each at times: more than the 16 of a global batch.
        (lambda c: c["data"].update(replay=[{"source_url": f"/s{i}", "weight": 0.01} for i in range(17)]),
         r"data\.replay: the replay sources draw up to 17 samples in one step, more than the global batch of 16"),
        (lambda c: c["cluster"].update(launcher="ssh", deferrable=True), r"cluster\.deferrable: the ssh launcher"),
        (lambda c: c["cluster"].update(deferrable=True), r"cluster\.deferrable: the local launcher"),
        (lambda c: c.update(schedule={"cron": "@daily", "priority": 10**6}), r"schedule\.priority"),
        (lambda c: c.update(schedule={"cron": "@daily", "prio": 3}), r"schedule\.prio"),
        (lambda c: c.update(tracking={"mlflow_uri": "https://me:hunter22@mlflow.example"}),
         r"tracking\.mlflow_uri(.|\n)*MLFLOW_TRACKING_PASSWORD"),
        (lambda c: c.update(tracking={"wandb": True}), r"tracking\.wandb"),
        (lambda c: (c["train"].update(precision="bf16"), c["cluster"].update(device="cpu")),
         r"train\.precision bf16 needs GPU ranks, and cluster\.device says they are CPU ranks"),
        (lambda c: (c["train"].update(precision="bf16"),
                    c["cluster"].update(launcher="kubernetes", kubernetes={"gpus_per_node": 0})),
         r"and cluster\.kubernetes\.gpus_per_node says they are CPU ranks"),
        (lambda c: c["cluster"].update(device="tpu"), r"cluster\.device"),
        (lambda c: c["cluster"].update(host_memory_gib=0), r"cluster\.host_memory_gib"),
    ],
)
def test_invalid_layouts_name_the_field(tmp_path: Path, mutate, message: str) -> None:
    path = write(tmp_path, mutate)
    with pytest.raises(ConfigError, match=message) as err:
        load_config(path)
    assert str(path) in str(err.value)


def test_approval_is_per_alias_and_a_bad_mode_names_the_field() -> None:
    base = load_config(DEMO)
    assert not base.publish.approval_required and base.publish.approval_timeout_s == 24 * 3600
    per_alias = base.with_overrides({"publish.approval": {"production": "required", "staging": "none"}})
    assert per_alias.publish.approval_required
    assert not per_alias.with_overrides({"publish.alias": "staging"}).publish.approval_required
    assert not per_alias.with_overrides({"publish.alias": "canary"}).publish.approval_required  # not listed: none
    assert base.with_overrides({"publish.approval": "required", "publish.alias": "canary"}).publish.approval_required
    for bad in ("requried", {"production": "yes"}, {"prod/blue": "required"}, True):
        with pytest.raises(ConfigError, match=r"publish\.approval: .*one of \('none', 'required'\)"):
            base.with_overrides({"publish.approval": bad})
    with pytest.raises(ConfigError, match=r"publish\.approval_timeout_s"):
        base.with_overrides({"publish.approval_timeout_s": 0})


def test_the_policy_names_approval_approvers_and_movers_per_alias_and_the_older_form_keeps_working(
        tmp_path: Path) -> None:
    """`publish.policy` per alias, "*" for the others, safe defaults for an alias nobody listed; the older
    `publish.approval` still means what it meant, but not together with `policy`; bad entries are named."""
    base = load_config(DEMO)
    default = base.publish.policy_for("production")
    assert (default.approval, default.approvers, default.movers, default.self_approval) == (
        "none", ("role:op",), ("role:op",), "forbidden")
    cfg = base.with_overrides({"publish.policy": {
        "production": {"approval": "required", "approvers": ["alice", "role:op"], "movers": ["role:admin"]},
        "*": {"movers": ["role:user"]}}})
    prod, other = cfg.publish.policy_for("production"), cfg.publish.policy_for("canary")
    assert cfg.publish.approval_required and prod.approvers == ("alice", "role:op") and prod.movers == ("role:admin",)
    assert other.approval == "none" and other.movers == ("role:user",)
    assert cfg.with_overrides({"train.steps": 3}).publish.policy == cfg.publish.policy  # a dump validates again
    older = base.with_overrides({"publish.approval": {"production": "required"}})
    assert older.publish.policy_for("production").approval == "required"
    assert older.publish.policy_for("production").approvers == ("role:op",)  # the safe defaults came along
    assert older.with_overrides({"train.steps": 3}).publish.approval_required
    path = write(tmp_path, lambda c: c["publish"].update(approval="required", policy={"staging": {"movers": ["bob"]}}))
    with pytest.raises(ConfigError, match=r"publish\.approval and publish\.policy both given.*"
                                          r"publish\.policy\.<alias>\.approval: required"):
        load_config(path)
    for bad, where in (({"production": {"movers": []}}, r"publish\.policy\.production\.movers"),
                       ({"production": {"approvers": ["role:"]}}, r"publish\.policy\.production\.approvers"),
                       ({"production": {"self_approval": "yes"}}, r"publish\.policy\.production\.self_approval"),
                       ({"production": {"aproval": "required"}}, r"publish\.policy\.production\.aproval"),
                       ({"prod/blue": {}}, r"publish\.policy: .*prod/blue")):
        with pytest.raises(ConfigError, match=where):
            base.with_overrides({"publish.policy": bad})


def test_deadline_takes_clear_durations_and_is_no_part_of_the_experiment_key() -> None:
    from datetime import timedelta

    base = load_config(DEMO)
    assert base.train.deadline is None
    for written, meant in [("2d", timedelta(days=2)), ("36h", timedelta(hours=36)), ("1d12h", timedelta(hours=36)),
                           ("90m", timedelta(minutes=90)), (3600, timedelta(hours=1)), ("PT6H", timedelta(hours=6))]:
        cfg = base.with_overrides({"train.deadline": written})
        assert cfg.train.deadline == meant, written
        assert cfg.fingerprint() == base.fingerprint()  # when to alert changes nothing trained
    for bad, message in [("soon", r"train\.deadline: .*not a duration \('soon'\)"),
                         ("0s", r"train\.deadline: .*longer than zero"), (-5, r"train\.deadline: .*longer than zero")]:
        with pytest.raises(ConfigError, match=message):
            base.with_overrides({"train.deadline": bad})


def test_a_second_model_is_a_copy_with_a_new_name(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """What a user does for a second model: copy the demo config, change `name`. Nothing the two must not
    share (registry entry, data trigger, run folder, rank port) is shared; the demo keeps what it had."""
    from tasks.config.cluster import MASTER_PORTS, default_master_port

    monkeypatch.setenv("RETRAINER_HOME", str(tmp_path))
    first = load_config(DEMO)
    second = load_config(write(tmp_path, lambda c: c.update(name="tiny-llama-2")))
    assert (first.publish.model_name, first.data.asset, first.train.output_dir) == (
        "tiny-llama", "retrainer-data://tiny-llama", f"{tmp_path}/runs/tiny-llama")
    assert (second.publish.model_name, second.data.asset, second.train.output_dir) == (
        "tiny-llama-2", "retrainer-data://tiny-llama-2", f"{tmp_path}/runs/tiny-llama-2")
    assert first.cluster.master_port != second.cluster.master_port
    # The port is the name's, the same in every process (no salted hash()), and in the documented range.
    assert second.cluster.master_port == default_master_port("tiny-llama-2") in MASTER_PORTS
    assert default_master_port("tiny-llama") == first.cluster.master_port == 27208
    ports = {default_master_port(f"model-{i}") for i in range(200)}
    assert len(ports) >= 198  # a couple of collisions in 200 names at most: 10000 ports


def test_explicit_values_win_over_the_name_defaults(tmp_path: Path) -> None:
    def explicit(c: dict) -> None:
        c["name"] = "other"
        c["publish"]["model_name"] = "shared-entry"
        c["data"]["asset"] = None  # data arrival off
        c["train"]["output_dir"] = str(tmp_path / "mine")
        c["cluster"]["master_port"] = 29500

    cfg = load_config(write(tmp_path, explicit))
    assert (cfg.publish.model_name, cfg.data.asset, cfg.train.output_dir, cfg.cluster.master_port) == (
        "shared-entry", None, str(tmp_path / "mine"), 29500)
    # A config without a cluster section still gets the name's port; overrides keep the resolved values.
    bare = load_config(write(tmp_path, lambda c: c.pop("cluster")))
    assert bare.cluster.master_port == load_config(DEMO).cluster.master_port
    assert bare.with_overrides({"train.steps": 3}).cluster.master_port == bare.cluster.master_port


def test_durations_read_as_people_write_them() -> None:
    from datetime import timedelta

    from tasks.config.duration import format_duration

    assert format_duration(86400) == "1 day"
    assert format_duration(timedelta(days=1, hours=12)) == "1 day 12 hours"
    assert format_duration(5400.4) == "1 hour 30 minutes"
    assert format_duration(61) == "1 minute 1 second"
    assert format_duration(0) == "0 seconds"


def test_a_variable_needs_a_value_or_a_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`${VAR:-default}` and an explicit empty default keep working, RETRAINER_HOME defaults to ./.retrainer, and
    a default's own unset variable matters only when the default is taken; an unset `${VAR}` names VAR and its key."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RETRAINER_HOME", raising=False)
    monkeypatch.delenv("RETRAINER_DB_URL", raising=False)
    monkeypatch.delenv("RETRAINER_TEST_UNSET", raising=False)
    monkeypatch.setenv("RETRAINER_TEST_EMPTY", "")
    monkeypatch.setenv("RETRAINER_TEST_HOST", "node-a")

    def hosts(cfg: dict) -> None:
        cfg["cluster"] = {"launcher": "ssh", "hosts": ["${RETRAINER_TEST_HOST:-${RETRAINER_TEST_UNSET}}",
                                                       "node-b${RETRAINER_TEST_UNSET:-}${RETRAINER_TEST_EMPTY}"]}

    cfg = load_config(write(tmp_path, hosts))
    assert cfg.cluster.hosts == ["node-a", "node-b"]
    assert cfg.data.cache_dir == str(tmp_path / ".retrainer" / "cache")

    monkeypatch.delenv("RETRAINER_TEST_HOST")
    with pytest.raises(ConfigError) as refused:
        load_config(write(tmp_path, hosts))
    assert str(refused.value) == (f"{tmp_path / 'job.yaml'}: cluster.hosts.0: ${{RETRAINER_TEST_UNSET}} is not set "
                                  "(no default)")
