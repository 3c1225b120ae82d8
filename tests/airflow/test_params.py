"""The manual-run form of the retrain and rollback DAGs: bad values are refused before anything runs,
with the offending field named; a conf key that is no param, or a layout the plan refuses, fails the
run in its first task with the reason as the run's note (the REST side of this is in test_standalone.py
and test_ux.py)."""

from __future__ import annotations

import copy
import importlib.util
import sys
import warnings

import pytest

from tasks import REPO_ROOT

ROOT = REPO_ROOT

BAD_RETRAIN = [
    ({"steps": 0}, "steps"),            # below minimum
    ({"steps": "ten"}, "steps"),        # wrong type
    ({"steps": 1.5}, "steps"),          # not an integer
    ({"tp": 0}, "tp"),                  # layout override below minimum
    ({"pp": 65}, "pp"),                 # above maximum
    ({"micro_batches": -1}, "micro_batches"),
    ({"alias": ""}, "alias"),           # too short
    ({"alias": "a/b"}, "alias"),        # pattern
    ({"dry_run": "no"}, "dry_run"),     # wrong type
    ({"force": 1}, "force"),
]


def _dag_module(name: str):
    spec = importlib.util.spec_from_file_location(f"retrainer_params_{name}", ROOT / "dags" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def validate(dag, conf: dict) -> dict:
    """What Airflow does with a trigger's conf: merge it over the DAG's Params, validate each."""
    params = copy.deepcopy(dag.params)
    for key, value in conf.items():
        params[key] = value  # an existing Param validates the new value here
    return params.validate()


@pytest.fixture(scope="module")
def retrain_dag():
    return _dag_module("retrain").__dict__["retrain_tiny-llama"]


@pytest.fixture(scope="module")
def rollback_dag():
    return _dag_module("rollback").rollback_model()  # the @dag function builds the DAG when called


@pytest.mark.parametrize(("conf", "field"), BAD_RETRAIN)
def test_dag_params_reject_bad_values_naming_the_field(retrain_dag, conf: dict, field: str) -> None:
    from airflow.sdk.exceptions import ParamValidationError

    with pytest.raises(ParamValidationError, match=rf"param {field}\b"):
        validate(retrain_dag, conf)


def test_dag_params_accept_a_good_manual_run(retrain_dag) -> None:
    resolved = validate(
        retrain_dag, {"steps": 3, "tp": 1, "pp": 1, "dp": 2, "micro_batches": 2, "alias": "staging", "dry_run": True}
    )
    assert resolved["steps"] == 3 and resolved["alias"] == "staging" and resolved["dry_run"] is True
    assert resolved["force"] is False  # defaults fill the rest


def test_rollback_form_only_offers_known_models(rollback_dag) -> None:
    from airflow.sdk.exceptions import ParamValidationError

    assert rollback_dag.params.get_param("model").schema["enum"] == ["tiny-llama"]
    for conf, field in (({"model": "nope"}, "model"), ({"to_version": 0}, "to_version"),
                        ({"reason": ""}, "reason"), ({"alias": "prod/blue"}, "alias"), ({"force": "yes"}, "force")):
        with pytest.raises(ParamValidationError, match=rf"param {field}\b"):
            validate(rollback_dag, conf)


@pytest.mark.parametrize(("conf", "field"), [({"steps": -3}, "steps"), ({"steps": "many"}, "steps")])
def test_dag_test_refuses_a_bad_run_conf_before_running_anything(retrain_dag, airflow_db: str, conf: dict,
                                                                 field: str) -> None:
    from airflow.sdk.exceptions import ParamValidationError

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ParamValidationError, match=rf"param {field}\b"):
            retrain_dag.test(run_conf=conf)


def _failed_run(dag, conf: dict) -> tuple[dict[str, str], str]:
    """Run the DAG through dag.test(): its task states and the run's note, as the UI shows them."""
    from tests.dags.test_lifecycle_e2e import run_dag, run_note, run_state

    dag_run = run_dag(dag, conf)
    return {t: run_state(dag_run, t) for t in dag.task_ids}, run_note(dag_run)


@pytest.mark.parametrize(("which", "conf", "first"), [("retrain", {"stpes": 10}, "plan"),
                                                      ("rollback", {"modle": "tiny-llama"}, "rollback")])
def test_an_unknown_conf_key_fails_the_first_task_naming_it(request: pytest.FixtureRequest, airflow_db: str,
                                                            which: str, conf: dict, first: str) -> None:
    """What the REST trigger refuses, a run started another way (here dag.test) stops at its first task."""
    dag = request.getfixturevalue(f"{which}_dag")
    states, note = _failed_run(dag, conf)
    assert states[first] == "failed" and all(s in ("upstream_failed", None) for t, s in states.items()
                                             if t != first), states
    key = next(iter(conf))
    assert note.startswith(f"{first}: unknown conf key '{key}': not a param of this DAG"), note
    assert all(name in note for name in dag.params), note  # and what it could have meant


def test_a_layout_the_plan_refuses_is_the_runs_note(retrain_dag, airflow_db: str, capfd: pytest.CaptureFixture[str],
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """tp=3 passes the form (1..64) but the model's 2 heads do not divide by it: the plan's own message. The
    task log says so in lines naming the field, from loggers with readable names, and no traceback (a
    refusal, not a bug)."""
    from tasks.base.errors import ConfigError
    from tasks.models.resolve import load_config

    with pytest.raises(ConfigError) as refused:
        load_config(ROOT / "configs" / "tiny-llama.yaml", {"parallel.tp": 3})
    capfd.readouterr()
    states, note = _failed_run(retrain_dag, {"tp": 3})
    assert states["plan"] == "failed" and states["train"] == "upstream_failed", states
    assert note == f"plan: {refused.value}" and "parallel.tp (3) must divide model.n_heads" in note
    out = "".join(capfd.readouterr())  # dag.test() streams the task's log to this process (Airflow's lines)
    assert "Task exited" in out and "parallel.tp (3) must divide" in out, out[-3000:]
    assert "Traceback" not in out and "Task failed with exception" not in out, out[-3000:]
    ours = [(r.name, r.getMessage()) for r in caplog.records if r.getMessage().startswith("retrainer: ")]
    assert ("dags.retrain", f"retrainer: retrain_tiny-llama.plan failed: {note}") in ours, ours
