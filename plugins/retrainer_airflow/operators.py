"""The retrain DAG's own operators: RankJobOperator (train, evaluate) and PublishApproval (below).

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
from airflow.providers.standard.triggers.hitl import HITLTrigger
from airflow.sdk import BaseOperator
from airflow.sdk.timezone import utcnow

from retrainer_airflow.contract import note_run
from retrainer_airflow.triggers import RankJobTrigger
from tasks import lifecycle
from tasks.approval import ApprovalAnswer
from tasks.evaluate import Evaluated
from tasks.gate import GateDecision

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
        planned = lifecycle.Planned.from_xcom(self.plan_out)
        cfg, run, warmed = planned.config(), planned.run, lifecycle.Warmed.from_xcom(self.warm_out)
        if self.stage == "train":
            if not cfg.cluster.defers:
                return lifecycle.stage_train(cfg, run, warmed, holder=self._holder(context)).to_xcom()
            step = lifecycle.stage_train_submit(cfg, run, warmed, holder=self._holder(context))
        else:
            trained = lifecycle.Trained.from_xcom(self.summary)
            if not cfg.cluster.defers:
                return lifecycle.stage_evaluate(cfg, run, trained, warmed).to_xcom()
            step = lifecycle.stage_evaluate_submit(cfg, run, trained, warmed)
        if isinstance(step, dict) and self.execution_timeout is not None:
            step = {**step, "deadline": time.time() + self.execution_timeout.total_seconds()}
        return self._next(step)

    def resume(self, context: Any, event: dict[str, Any]) -> Any:
        planned = lifecycle.Planned.from_xcom(self.plan_out)
        cfg, run = planned.config(), planned.run
        job, outcome = event["job"], event["outcome"]
        if self.stage == "train":
            step = lifecycle.stage_train_collect(cfg, run, lifecycle.Warmed.from_xcom(self.warm_out), job, outcome,
                                                 holder=self._holder(context))
        else:
            step = lifecycle.stage_evaluate_collect(cfg, job, outcome)
        return self._next(step)

    def _next(self, step: lifecycle.Trained | Evaluated | dict[str, Any]) -> Any:
        """The stage's result as its XCom, or (a submitted job's handle) defer until the job ends."""
        if not isinstance(step, dict):
            return step.to_xcom()
        self.defer(trigger=RankJobTrigger(snapshot=self.plan_out["job"], job=step), method_name="resume")


class PublishApproval(ApprovalOperator):
    """A person's go/no-go between gate and publish, asked only when the run's alias requires it
    (`publish.approval` of the run's frozen config); otherwise it passes at once. The request shows
    tasks.approval's summary; Reject (or no answer by `publish.approval_timeout_s`) skips publish and
    says why in the run's note; Approve hands the approver to publish.

    An answer given at any moment stands. Airflow 3.3.2 fails a waiting task answered within about a
    second (the scheduler takes the waiting try's stale exit event for a kill, apache/airflow#67330), after
    the answer is recorded on the task's request. The task's retries cover that: a retry (not a first try,
    nor the first after a person cleared the task, who wants to be asked again) does not ask anew, which
    would erase the recorded answer, but waits on the request it has (HITLTrigger): a recorded answer
    resumes it at once, else a person answers it as before."""

    template_fields = (*ApprovalOperator.template_fields, "plan_out", "metrics", "decision")

    def __init__(self, *, plan_out: Any, metrics: Any, decision: Any, **kwargs: Any) -> None:
        kwargs.setdefault("retries", 2)  # see the class docstring: the stale-exit race, not flaky work
        kwargs.setdefault("retry_delay", timedelta(seconds=2))
        super().__init__(**kwargs)
        self.plan_out, self.metrics, self.decision = plan_out, metrics, decision

    def execute(self, context):
        ti = context["ti"]
        planned = lifecycle.Planned.from_xcom(self.plan_out)
        cfg = planned.config()
        if not cfg.publish.approval_required:
            log.info("retrainer: publishing to %s needs no approval (publish.approval)", cfg.publish.alias)
            return None
        request = lifecycle.stage_approval_request(cfg, planned.run, Evaluated.from_xcom(self.metrics),
                                                   GateDecision.from_xcom(self.decision))
        self.subject, self.body = request["subject"], request["body"]
        self.response_timeout = timedelta(seconds=cfg.publish.approval_timeout_s)
        # Airflow's own reckoning (its sensors' first reschedule): a clear restarts the series of tries.
        first_try = ti.max_tries - (self.retries or 0) + 1
        if ti.try_number > first_try:
            log.warning("retrainer: try %s of the approval: an earlier try was asked and may have been answered "
                        "(apache/airflow#67330); taking that answer, or waiting for it, instead of asking again",
                        ti.try_number)
            self.defer(trigger=HITLTrigger(ti_id=ti.id, options=self.options, defaults=self.defaults,
                                           params=self.serialized_params, multiple=self.multiple,
                                           timeout_datetime=utcnow() + self.response_timeout, poke_interval=1.0),
                       method_name="execute_complete")
        return super().execute(context)

    def execute_complete(self, context, event):
        if "error" in event:  # not an answer: Airflow's own handling fails the task
            return super().execute_complete(context, event)
        answer = ApprovalAnswer.of(event["chosen_options"] == [self.APPROVE], event["responded_by_user"],
                                   event["params_input"])
        if answer.approved:
            log.info("retrainer: approved by %s", answer.by)
        else:  # noted first: the operator ends a rejection by raising (that skips publish)
            cfg = lifecycle.Planned.from_xcom(self.plan_out).config()
            note = answer.run_note(cfg.publish.approval_timeout_s)
            log.warning("retrainer: %s", note)
            note_run(context["ti"], note)
        super().execute_complete(context, event)
        return answer.to_dict()
