"""The DAGs' own operators: RankJobOperator (train, evaluate) and the approvals (AliasApproval, below).

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

from retrainer_airflow.audit import triggering_user
from retrainer_airflow.contract import note_run, refusal_noted
from retrainer_airflow.people import person, respondents
from retrainer_airflow.triggers import RankJobTrigger
from tasks.base.policy import NotPermittedError, check_approver
from tasks.config.endpoints import registry_for
from tasks.config.schema import JobConfig
from tasks.evaluate import Evaluated
from tasks.stages import lifecycle
from tasks.stages.approval import ApprovalAnswer, promotion_body
from tasks.stages.gate import GateDecision
from tasks.stages.promote import Promotion

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
        from tasks.launch import Outcome

        planned = lifecycle.Planned.from_xcom(self.plan_out)
        cfg, run = planned.config(), planned.run
        job, outcome = event["job"], Outcome.from_dict(event["outcome"])
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


class AliasApproval(ApprovalOperator):
    """A person's go/no-go before an alias moves, asked only when the alias's policy requires it
    (`publish.policy.<alias>.approval`); otherwise it passes at once. Only the alias's approvers may answer:
    Airflow is told who they are where the auth manager lists its users (HITL `assigned_users`: the API
    refuses anyone else, and so does this task if someone else answered anyway), and the person who started
    the run is not one of them unless the alias allows self-approval. Reject (or no answer by
    `publish.approval_timeout_s`) skips the move and says why in the run's note; an answer from someone who
    may not approve is noted and counts as a rejection; Approve hands the approver on.

    An answer given at any moment stands. Airflow 3.3.2 fails a waiting task answered within about a
    second (the scheduler takes the waiting try's stale exit event for a kill, apache/airflow#67330), after
    the answer is recorded on the task's request. The task's retries cover that: a retry (not a first try,
    nor the first after a person cleared the task, who wants to be asked again) does not ask anew, which
    would erase the recorded answer, but waits on the request it has (HITLTrigger): a recorded answer
    resumes it at once, else a person answers it as before.

    Subclasses say which alias moves (`target(context)` -> the run's config and the alias) and what is asked
    (`ask(context, config)` -> subject and markdown body)."""

    template_fields = (*ApprovalOperator.template_fields, "plan_out")

    def __init__(self, *, plan_out: Any, **kwargs: Any) -> None:
        kwargs.setdefault("retries", 2)  # see the class docstring: the stale-exit race, not flaky work
        kwargs.setdefault("retry_delay", timedelta(seconds=2))
        super().__init__(**kwargs)
        self.plan_out = plan_out

    def target(self, context: Any) -> tuple[JobConfig, str]:
        raise NotImplementedError

    def ask(self, context: Any, cfg: JobConfig) -> tuple[str, str]:
        raise NotImplementedError

    def execute(self, context):
        ti = context["ti"]
        cfg, alias = self.target(context)
        policy = cfg.publish.policy_for(alias)
        if policy.approval != "required":
            log.info("retrainer: moving %s needs no approval (publish.policy.%s.approval)", alias, alias)
            return None
        starter = triggering_user(context)
        excluded = starter if policy.self_approval == "forbidden" else None
        assigned = respondents(policy.approvers, excluded)
        if assigned is not None and not assigned:
            with refusal_noted(ti, "approval"):
                raise NotPermittedError(
                    f"nobody may approve this move onto {alias!r}: publish.policy.{alias}.approvers "
                    f"[{', '.join(policy.approvers)}] admit no user of this Airflow"
                    + (f" but {starter}, who started the run (self_approval: forbidden)" if excluded else "")
                    + ": not moved")
        subject, body = self.ask(context, cfg)
        who = ", ".join(u["name"] for u in assigned) if assigned is not None else ", ".join(policy.approvers)
        self.subject, self.assigned_users = subject, assigned
        self.body = (f"{body}\n\nWho may answer: {who} (publish.policy.{alias}.approvers"
                     + (f"; not {starter}, who started this run" if excluded else "") + ").")
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
        cfg, alias = self.target(context)
        answer = ApprovalAnswer.of(event["chosen_options"] == [self.APPROVE], event["responded_by_user"],
                                   event["params_input"])
        responder = (event["responded_by_user"] or {}).get("name")
        try:
            if responder:
                check_approver(cfg.publish.policy_for(alias), alias, person(str(responder)),
                               triggering_user(context))
        except NotPermittedError as refused:  # fail closed: nothing moves on a word that does not count
            answer = ApprovalAnswer(approved=False, by=answer.by, comment=answer.comment)
            note = f"approval: an answer from {responder} does not count: {refused}; nothing moved"
            log.warning("retrainer: %s", note)
            note_run(context["ti"], note)
            super().execute_complete(context, {**event, "chosen_options": [self.REJECT]})
            return answer.to_dict()
        if answer.approved:
            log.info("retrainer: approved by %s", answer.by)
        else:  # noted first: the operator ends a rejection by raising (that skips what follows)
            note = answer.run_note(cfg.publish.approval_timeout_s)
            log.warning("retrainer: %s", note)
            note_run(context["ti"], note)
        super().execute_complete(context, event)
        return answer.to_dict()


class PublishApproval(AliasApproval):
    """The retrain DAG's approval between gate and publish: the candidate's metrics next to the live version's
    and every gate rule's result (tasks.stages.approval's summary), for the run's alias."""

    template_fields = (*AliasApproval.template_fields, "metrics", "decision")

    def __init__(self, *, metrics: Any, decision: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.metrics, self.decision = metrics, decision

    def target(self, context: Any) -> tuple[JobConfig, str]:
        cfg = lifecycle.Planned.from_xcom(self.plan_out).config()
        return cfg, cfg.publish.alias

    def ask(self, context: Any, cfg: JobConfig) -> tuple[str, str]:
        asked = lifecycle.stage_approval_request(cfg, lifecycle.Planned.from_xcom(self.plan_out).run,
                                                 Evaluated.from_xcom(self.metrics),
                                                 GateDecision.from_xcom(self.decision))
        return asked["subject"], asked["body"]


class PromoteApproval(AliasApproval):
    """promote_model's approval between gate and move: the version and the alias's live one side by side, the
    gate's rules (or that a mover forced past it), for the promotion's target alias."""

    template_fields = (*AliasApproval.template_fields, "scored", "decision")

    def __init__(self, *, scored: Any, decision: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.scored, self.decision = scored, decision

    def target(self, context: Any) -> tuple[JobConfig, str]:
        cfg = Promotion.from_xcom(self.plan_out).config()
        return cfg, cfg.publish.alias

    def ask(self, context: Any, cfg: JobConfig) -> tuple[str, str]:
        promotion = Promotion.from_xcom(self.plan_out)
        model, alias = cfg.publish.model_name, cfg.publish.alias
        reg = registry_for(cfg)
        live = None if promotion.live_version is None else reg.get_version(model, promotion.live_version)
        body = promotion_body(model, alias, reg.get_version(model, promotion.version), live, self.scored,
                              self.decision, triggering_user(context), promotion.reason,
                              cfg.publish.approval_timeout_s)
        return f"Promote {model} v{promotion.version} to {alias}?", body
