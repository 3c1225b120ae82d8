"""deploy_<name>: every move of a model's alias puts the version it points to into service (thin wiring over
tasks/deploy/), one DAG per job config with `deploy.enabled`.

Scheduled on the Asset `model://<name>/<alias>`, whose events the retrain DAG's publish and `rollback_model`
emit (through the AssetAlias "retrainer-model-alias-moved"). pull (the version live now, verified) ->
smoke_test -> hook -> deployed run on `deploy.queue`, the serving host's workers. `rollback` runs when one of
the three failed: it moves the alias back, audited with the reason the failed task left (XCom `failure`), and
emits the alias event, so this DAG then deploys the version rolled back to. If that deploy fails too, the move
was a rollback and nothing is rolled back again: the run fails loudly, saying why in its note (as every run
that ends without deploying does).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

from airflow.sdk import Asset, dag, get_current_context, task
from retrainer_airflow.configs import MODEL_EVENTS, job_configs
from retrainer_airflow.contract import note_run, refusal_noted

from tasks.deploy.check import describe
from tasks.deploy.check import smoke_test as run_smoke_test  # the names pull and smoke_test are the tasks'
from tasks.deploy.handoff import run_hook
from tasks.deploy.pull import pull as pull_here
from tasks.deploy.rollback import failure_reason, roll_back, unrecorded_failure
from tasks.deploy.target import DeployTarget, deploy_alias, resolve_target
from tasks.models.resolve import ConfigSnapshot
from tasks.registry import alias_asset_uri

log = logging.getLogger("dags.deploy")  # not __name__: Airflow imports DAG files as unusual_prefix_<hash>_deploy

STEPS = {"pull": "pull", "smoke_test": "smoke test", "hook": "hook"}  # task id -> how a failure names it


@contextmanager
def recorded(step: str) -> Iterator[None]:
    """A failure inside leaves its reason for the rollback task (XCom `failure`), then fails the task as it was."""
    try:
        yield
    except BaseException as exc:  # a timeout (AirflowTaskTimeout) and a SIGTERM are BaseExceptions too
        get_current_context()["ti"].xcom_push(key="failure", value=failure_reason(exc, STEPS[step]))
        raise


def build_deploy_dag(config_path: Path, cfg):
    model, alias = cfg.publish.model_name, deploy_alias(cfg)
    on_host = {"queue": cfg.deploy.queue} if cfg.deploy.queue else {}

    def frozen(pulled: dict) -> tuple:
        return ConfigSnapshot.from_dict(pulled["job"]).config(), DeployTarget.from_dict(pulled["target"])

    @dag(
        dag_id=f"deploy_{cfg.name}",
        schedule=Asset(alias_asset_uri(model, alias)),
        catchup=False,
        max_active_runs=1,
        tags=["retrainer", "deploy"],
        doc_md=__doc__,
    )
    def deploy_dag():
        @task(execution_timeout=timedelta(hours=6), retries=2, retry_delay=timedelta(seconds=30), **on_host)
        def pull() -> dict:
            ctx = get_current_context()
            ti = ctx["ti"]
            with recorded("pull"):
                snap = ConfigSnapshot.take(config_path).to_dict()  # every later task of the run uses this config
                ti.xcom_push(key="job", value=snap)
                events = sorted((e for evs in (ctx.get("triggering_asset_events") or {}).values() for e in evs),
                                key=lambda e: e.timestamp)
                job = ConfigSnapshot.from_dict(snap).config()
                target = resolve_target(job, [e.extra for e in events])
                ti.xcom_push(key="target", value=target.to_dict())  # the rollback's, should the pull fail
                pull_here(job, target)
            return {"job": snap, "target": target.to_dict()}

        # smoke_test and hook make sure the verified copy is on their host too (a no-op where pull put it):
        # a queue served by several hosts may run them on different ones.
        @task(execution_timeout=timedelta(hours=6), **on_host)
        def smoke_test(pulled: dict) -> dict:
            with recorded("smoke_test"):
                job, target = frozen(pulled)
                pull_here(job, target)
                return run_smoke_test(job, target)

        @task(execution_timeout=timedelta(hours=6), **on_host)
        def hook(pulled: dict) -> dict:
            with recorded("hook"):
                job, target = frozen(pulled)
                pull_here(job, target)
                return run_hook(job, target)

        @task
        def deployed(smoke: dict, hooked: dict) -> None:
            """The run's last task: the run's state is the deploy's (a rolled-back deploy is a failed run)."""
            note = f"deployed v{hooked['version']} ({alias}): {describe(smoke)}"
            log.info("retrainer: %s", note)
            note_run(get_current_context()["ti"], note)

        @task(trigger_rule="one_failed", outlets=[MODEL_EVENTS])
        def rollback(*, outlet_events=None) -> dict:
            ti = get_current_context()["ti"]
            reasons = [r for r in (ti.xcom_pull(task_ids=t, key="failure") for t in STEPS) if r]
            if not reasons:  # the task process died (killed, out of memory, worker lost): only its state is known
                states = ti.get_task_states(dag_id=ti.dag_id, task_ids=list(STEPS), run_ids=[ti.run_id])[ti.run_id]
                reasons = [unrecorded_failure([STEPS[t] for t, s in states.items() if s == "failed"])]
            pulled_job = ti.xcom_pull(task_ids="pull", key="job")
            job = ConfigSnapshot.from_dict(pulled_job) if pulled_job else ConfigSnapshot.take(config_path)
            target = ti.xcom_pull(task_ids="pull", key="target")
            with refusal_noted(ti, "rollback"):  # a refused rollback (no cascade, ...) is the run's note
                out = roll_back(job.config(), None if target is None else DeployTarget.from_dict(target),
                                reasons[0], actor=f"airflow {ti.dag_id}/{ti.run_id}")
            outlet_events[MODEL_EVENTS].add(Asset(alias_asset_uri(out.model, out.alias)),
                                            extra={"version": out.to_version, "rolled_back_from": out.from_version})
            note_run(ti, f"{reasons[0]}; rolled back {out.alias} v{out.from_version} -> v{out.to_version}")
            return out.to_dict()

        pulled = pull()
        smoked = smoke_test(pulled)
        hooked = hook(pulled)
        smoked >> hooked
        deployed(smoked, hooked)
        [pulled, smoked, hooked] >> rollback()

    return deploy_dag()


for _path, _cfg in job_configs().items():
    if _cfg.deploy.enabled:
        globals()[f"deploy_{_cfg.name}"] = build_deploy_dag(_path, _cfg)
