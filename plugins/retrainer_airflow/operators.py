"""The retrain DAG's own operators: RankJobOperator (train, evaluate) and PublishApproval.

RankJobOperator: the train and evaluate tasks, deferring while their job runs where the engine allows.

With `cluster.defers` (slurm, kubernetes) the task submits the job, defers to RankJobTrigger
and resumes only to collect the outcome: a multi-day training holds no worker, and a worker
restart does not touch it. A job the cluster took away is submitted again from the resume
(it continues from its last checkpoint) and the task defers anew. Otherwise (local, ssh:
ranks that die with their launcher) the task supervises the job itself, as a plain task.
`execution_timeout` bounds the job's whole life: while deferred the trigger enforces it
(cancelling the job), since Airflow does not time deferred tasks out.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Any, Literal

from airflow.providers.standard.operators.hitl import ApprovalOperator
from airflow.sdk import BaseOperator

from retrainer_airflow.triggers import RankJobTrigger
from tasks import lifecycle
from tasks.approval import ApprovalAnswer

log = logging.getLogger(__name__)


class RankJobOperator(BaseOperator):
    template_fields = ("plan_out", "warm_out", "summary")

    def __init__(self, *, stage: Literal["train", "evaluate"], plan_out: Any, warm_out: Any, summary: Any = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.stage, self.plan_out, self.warm_out, self.summary = stage, plan_out, warm_out, summary

    def _holder(self, context: Any) -> str:
        ti = context["ti"]
        return f"airflow {ti.dag_id}/{ti.run_id}/{ti.task_id} try {ti.try_number}"

    def execute(self, context: Any) -> Any:
        cfg, run = lifecycle.job_and_run(self.plan_out)
        if self.stage == "train":
            if not cfg.cluster.defers:
                return lifecycle.stage_train(cfg, run, self.warm_out, holder=self._holder(context))
            step = lifecycle.stage_train_submit(cfg, run, self.warm_out, holder=self._holder(context))
        else:
            if not cfg.cluster.defers:
                return lifecycle.stage_evaluate(cfg, run, self.summary, self.warm_out)
            step = lifecycle.stage_evaluate_submit(cfg, run, self.summary, self.warm_out)
        if "job" in step and self.execution_timeout is not None:
            step["job"]["deadline"] = time.time() + self.execution_timeout.total_seconds()
        return self._next(step)

    def resume(self, context: Any, event: dict[str, Any]) -> Any:
        cfg, run = lifecycle.job_and_run(self.plan_out)
        job, outcome = event["job"], event["outcome"]
        if self.stage == "train":
            step = lifecycle.stage_train_collect(cfg, run, self.warm_out, job, outcome, holder=self._holder(context))
        else:
            step = lifecycle.stage_evaluate_collect(cfg, job, outcome)
        return self._next(step)

    def _next(self, step: dict[str, Any]) -> Any:
        if "result" in step:
            return step["result"]
        self.defer(trigger=RankJobTrigger(snapshot=self.plan_out["job"], job=step["job"]), method_name="resume")


class PublishApproval(ApprovalOperator):
    """A person's go/no-go between gate and publish, asked only when the run's alias requires it
    (`publish.approval` of the run's frozen config); otherwise it passes at once. The request shows
    tasks.approval's summary; Reject (or no answer by `publish.approval_timeout_s`) skips publish and
    says why in the run's note; Approve hands the approver to publish."""

    def execute(self, context):
        ti = context["ti"]
        cfg, run = lifecycle.job_and_run(ti.xcom_pull(task_ids="plan"))
        if not cfg.publish.approval_required:
            log.info("retrainer: publishing to %s needs no approval (publish.approval)", cfg.publish.alias)
            return None
        request = lifecycle.stage_approval_request(cfg, run, ti.xcom_pull(task_ids="evaluate"),
                                                   ti.xcom_pull(task_ids="gate", key="decision"))
        self.subject, self.body = request["subject"], request["body"]
        self.response_timeout = timedelta(seconds=cfg.publish.approval_timeout_s)
        return super().execute(context)

    def execute_complete(self, context, event):
        if "error" in event:  # not an answer: Airflow's own handling fails the task
            return super().execute_complete(context, event)
        answer = ApprovalAnswer.of(event["chosen_options"] == [self.APPROVE], event["responded_by_user"],
                                   event["params_input"])
        if answer.approved:
            log.info("retrainer: approved by %s", answer.by)
        else:  # noted first: the operator ends a rejection by raising (that skips publish)
            cfg, _ = lifecycle.job_and_run(context["ti"].xcom_pull(task_ids="plan"))
            note = answer.run_note(cfg.publish.approval_timeout_s)
            log.warning("retrainer: %s", note)
            context["ti"].xcom_push(key="run_note", value=note)  # the run-notes listener shows it on the run
        super().execute_complete(context, event)
        return answer.to_dict()
