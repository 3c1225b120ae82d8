"""retrain_<name>: one DAG per job config in the config folder (thin wiring over tasks.stages.lifecycle).

plan -> warm -> [dry-run stop] -> train (experiment lock, retries resume) -> evaluate -> gate -> approval
(a person approves or rejects when the run's alias requires it: `publish.approval`) -> publish
-> housekeeping (the run's other checkpoints pruned once the alias points at its version).
The plan task freezes the run: the config as the file was then, the data's manifest hash, the starting
weights (`train.init_from`); every later task reads them from its XCom. Scheduled by the config's cron
`schedule`, by data arrival (`data.asset`: an Asset event, whose extra `source_url` names the snapshot
to train on), or both. The config folder is $RETRAINER_CONFIG_DIR, else the project's configs/
(retrainer_airflow.configs).
"""

from __future__ import annotations

import logging
from datetime import timedelta
from pathlib import Path

from airflow.providers.standard.operators.hitl import ApprovalOperator
from airflow.sdk import (
    Asset,
    AssetOrTimeSchedule,
    AsyncCallback,
    CronTriggerTimetable,
    DeadlineAlert,
    DeadlineReference,
    Param,
    XComArg,
    dag,
    get_current_context,
    task,
)
from retrainer_airflow.audit import run_name, triggering_user
from retrainer_airflow.configs import MODEL_EVENTS, config_dir, job_configs
from retrainer_airflow.contract import note_run, refusal_noted, run_overrides
from retrainer_airflow.lineage import report_lineage
from retrainer_airflow.operators import PublishApproval, RankJobOperator

from tasks.base.alerts import deadline_missed
from tasks.config.bounds import NAME_PATTERN
from tasks.config.duration import format_duration
from tasks.config.schema import JobConfig
from tasks.evaluate import Evaluated
from tasks.launch import pool_for
from tasks.models.resolve import ConfigSnapshot
from tasks.plan.evaluation import evaluation_layout
from tasks.registry import alias_asset_uri
from tasks.stages import lifecycle
from tasks.stages.approval import MAX_COMMENT, approver, publish_attribution
from tasks.stages.gate import GateDecision
from tasks.stages.lineage import publish_lineage
from tasks.stages.publish import PublishResult

log = logging.getLogger("dags.retrain")  # not __name__: Airflow imports DAG files as unusual_prefix_<hash>_retrain

CONFIG_DIR = config_dir()


def log_failure_reason(context) -> None:
    """One line saying why the task failed, for whoever reads the run at 3am."""
    ti = context["ti"]
    log.error("retrainer: %s.%s failed: %s", ti.dag_id, ti.task_id, context.get("exception"))


def deadline_for(cfg) -> DeadlineAlert | None:
    """`train.deadline`: an alert (the triggerer logs the run that overran) when a run is still not done that
    long after it was queued."""
    if cfg.train.deadline is None:
        return None
    return DeadlineAlert(reference=DeadlineReference.DAGRUN_QUEUED_AT, interval=cfg.train.deadline,
                         callback=AsyncCallback(deadline_missed,
                                                kwargs={"deadline": format_duration(cfg.train.deadline)}),
                         name="train.deadline")


def schedule_for(cfg):
    """Cron, data arrival, or either (whichever comes first), from the config."""
    cron = cfg.schedule.cron
    if cfg.data.asset is None:
        return cron
    arrival = Asset(cfg.data.asset)
    if cron is None:
        return arrival
    return AssetOrTimeSchedule(timetable=CronTriggerTimetable(cron, timezone="UTC"), assets=arrival)


def build_retrain_dag(config_path: Path, cfg: JobConfig):
    pool, pool_slots = pool_for(cfg)  # one pool per cluster, sized in GPU slots
    _, eval_slots = pool_for(evaluation_layout(cfg))  # the evaluation ranks' own layout, same cluster

    @dag(
        dag_id=f"retrain_{cfg.name}",
        schedule=schedule_for(cfg),
        catchup=False,
        max_active_runs=1,
        tags=["retrainer"],
        doc_md=__doc__,
        default_args={"on_failure_callback": log_failure_reason},
        deadline=deadline_for(cfg),
        params={
            "steps": Param(cfg.train.steps, type="integer", minimum=1, maximum=10_000_000,
                           description="training steps"),
            "tp": Param(None, type=["null", "integer"], minimum=1, maximum=64, description="tensor parallel"),
            "pp": Param(None, type=["null", "integer"], minimum=1, maximum=64, description="pipeline stages"),
            "dp": Param(None, type=["null", "integer"], minimum=1, maximum=4096, description="data parallel"),
            "micro_batches": Param(None, type=["null", "integer"], minimum=1, maximum=4096,
                                   description="gradient accumulation / pipeline micro-batches"),
            "alias": Param(cfg.publish.alias, type="string", minLength=1, maxLength=200,
                           pattern=NAME_PATTERN, description="alias to move on publish"),
            "slurm_time_limit": Param(None, type=["null", "string"], minLength=1, maxLength=32,
                                      description="Slurm time limit (cluster.slurm.time_limit), e.g. 2-00:00:00"),
            "dry_run": Param(False, type="boolean", description="plan and warm only"),
            "force": Param(False, type="boolean",
                           description="launch even if the plan says it cannot fit, or a stopped run at another "
                                       "global batch would be left behind"),
        },
    )
    def retrain():
        def frozen(plan_out: dict):
            planned = lifecycle.Planned.from_xcom(plan_out)
            return planned.config(), planned.run

        @task(execution_timeout=timedelta(minutes=10))
        def plan() -> dict:
            ctx = get_current_context()
            with refusal_noted(ctx["ti"], "plan"):  # a refusal here is the run's note
                # Paths that skip the REST trigger's check (CLI, dag.test, other DAGs) stop here.
                job = ConfigSnapshot.take(config_path, run_overrides(ctx))  # resolved once, for the whole run
                # Skips a run with no new data, or whose result the gate refuses.
                return lifecycle.stage_plan_run(job, force=bool(ctx["params"]["force"])).to_xcom()

        @task.short_circuit
        def new_data(plan_out: dict) -> bool:
            if plan_out["skip"]:
                log.info("retrainer: %s", plan_out["skip"])
                note_run(get_current_context()["ti"], plan_out["skip"])
            return not plan_out["skip"]

        @task(execution_timeout=timedelta(hours=6), retries=3, retry_delay=timedelta(seconds=5),
              retry_exponential_backoff=True, outlets=[Asset(f"dataset://{cfg.name}")])
        def warm(plan_out: dict) -> dict:
            return lifecycle.stage_warm(*frozen(plan_out)).to_xcom()

        @task.short_circuit
        def not_dry_run(_warm: dict) -> bool:
            return not get_current_context()["params"]["dry_run"]

        planned = plan()
        warmed = warm(planned)
        new_data(planned) >> warmed
        go = not_dry_run(warmed)

        # Both defer while their job runs where the engine allows (cluster.defers); their pool counts deferred
        # tasks' slots (README: `airflow pools set ... --include-deferred`): a deferred job still holds the GPUs.
        ranks = {"pool": pool, "priority_weight": cfg.schedule.priority, "weight_rule": "absolute"}
        train = RankJobOperator(task_id="train", stage="train", plan_out=planned, warm_out=warmed,
                                execution_timeout=timedelta(days=3), retries=2, retry_delay=timedelta(seconds=10),
                                retry_exponential_backoff=True, pool_slots=pool_slots, **ranks)
        # Evaluation runs as ranks on the training nodes: it takes the training pool's slots.
        # A retry soon, not after Airflow's default 5 minutes: a deferred task resumed within seconds can lose its
        # first try to the executor's stale "success" of the deferring exit (seen: "finished with state success, but
        # the task instance's state attribute is queued" -> up_for_retry), and the retry then only collects. Two
        # retries: one run lost both of its tries that way across a restart of every component (apache/airflow#67330).
        evaluate = RankJobOperator(task_id="evaluate", stage="evaluate", plan_out=planned, warm_out=warmed,
                                   summary=train.output, execution_timeout=timedelta(hours=6), retries=2,
                                   retry_delay=timedelta(seconds=10), pool_slots=eval_slots, **ranks)

        @task.short_circuit(execution_timeout=timedelta(hours=1))
        def gate(plan_out: dict, metrics: dict) -> bool:
            decision = lifecycle.stage_gate(*frozen(plan_out), Evaluated.from_xcom(metrics))
            ti = get_current_context()["ti"]
            ti.xcom_push(key="decision", value=decision.to_xcom())  # publish records the rules
            if not decision.publish:
                note_run(ti, f"gate: {decision.reason}")
            return decision.publish

        @task(execution_timeout=timedelta(hours=1), retries=2, retry_delay=timedelta(seconds=5),
              outlets=[MODEL_EVENTS])
        def publish(plan_out: dict, summary: dict, metrics: dict, *, outlet_events=None) -> dict:
            ctx = get_current_context()
            ti = ctx["ti"]
            decision = GateDecision.from_xcom(ti.xcom_pull(task_ids="gate", key="decision"))
            answer = ti.xcom_pull(task_ids="approval")
            actor, reason = publish_attribution(answer, run_name(ctx), triggering_user(ctx))
            cfg, run = frozen(plan_out)
            with refusal_noted(ti, "publish"):  # e.g. the alias moved while a person decided
                result = lifecycle.stage_publish(cfg, run, lifecycle.Trained.from_xcom(summary),
                                                 Evaluated.from_xcom(metrics), gate=decision, actor=actor,
                                                 reason=reason, approved_by=approver(answer))
            report_lineage(publish_lineage(run, result))  # OpenLineage, where configured: data -> version
            if result.switched:  # the event says the alias moved: only when it did
                outlet_events[MODEL_EVENTS].add(Asset(alias_asset_uri(result.model, result.alias)),
                                                extra={"version": result.version,
                                                       "parent_version": result.parent_version})
            note_run(ti, lifecycle.publish_note(result))  # the run's note: what, from what
            return result.to_xcom()

        @task(execution_timeout=timedelta(hours=1), retries=1)  # after the switch; the publish stands regardless
        def housekeeping(plan_out: dict, published_out: dict) -> dict:
            return lifecycle.stage_housekeeping(*frozen(plan_out), PublishResult.from_xcom(published_out)).to_xcom()

        go >> train
        summary, metrics = train.output, evaluate.output
        publish_ok = gate(planned, metrics)
        published = publish(planned, summary, metrics)
        # No answer within publish.approval_timeout_s: the default, Reject.
        approval = PublishApproval(
            task_id="approval", subject="Publish the retrained model?", defaults=ApprovalOperator.REJECT,
            plan_out=planned, metrics=metrics, decision=XComArg(publish_ok.operator, key="decision"),
            params={"comment": Param(None, type=["null", "string"], maxLength=MAX_COMMENT,  # null: optional in the UI
                                     description="why (kept in the run note or the alias history)")})
        publish_ok >> approval >> published
        housekeeping(planned, published)

    return retrain()


for _path, _cfg in job_configs().items():
    globals()[f"retrain_{_cfg.name}"] = build_retrain_dag(_path, _cfg)
