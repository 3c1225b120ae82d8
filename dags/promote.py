"""promote_model: put a published version on an alias through that alias's gate and its approvers.

check (the version exists and is not live there; `force` only for the alias's movers, with a reason) ->
evaluate (the version and the alias's live one on the config's suites, scored by evaluation ranks through the
job's launcher, or from the cache; skipped when forced) -> gate (the config's rules) -> approval (the alias's
approvers, when `publish.policy.<alias>.approval` requires it; never the person who started the run unless the
alias allows self-approval) -> promote (one compare-and-swap on the version live when the promotion started,
recorded as `promote` under the approver, and the alias's Asset event model://<name>/<alias>). Thin wiring over
tasks.stages.promote.
"""

from __future__ import annotations

from datetime import timedelta

from airflow.providers.standard.operators.hitl import ApprovalOperator
from airflow.sdk import Asset, Param, XComArg, dag, get_current_context, task
from retrainer_airflow.audit import run_name, triggering_user
from retrainer_airflow.configs import MODEL_EVENTS, alias_params, configs_by_name
from retrainer_airflow.contract import note_run, refusal_noted, refuse_unknown_params
from retrainer_airflow.operators import PromoteApproval
from retrainer_airflow.people import run_starter

from tasks.base.audit import via
from tasks.evaluate import VersionsScored
from tasks.models.resolve import ConfigSnapshot
from tasks.registry import alias_asset_uri
from tasks.stages import promote as promotion_stages
from tasks.stages.approval import MAX_COMMENT, ApprovalAnswer
from tasks.stages.gate import GateDecision

CONFIGS = configs_by_name()


@dag(
    dag_id="promote_model",
    schedule=None,
    catchup=False,
    tags=["retrainer"],
    doc_md=__doc__,
    params={
        **alias_params(CONFIGS, "promote"),
        "version": Param(None, type=["null", "integer"], minimum=1, description="the version to put on the alias"),
        "force": Param(False, type="boolean",
                       description="skip the gate (movers only; say why in reason); the approval still applies"),
        "reason": Param("promote", type="string", minLength=1, maxLength=500, description="audit note"),
    },
)
def promote_model():
    @task(execution_timeout=timedelta(minutes=10))
    def check() -> dict:
        ctx = get_current_context()
        params = ctx["params"]
        with refusal_noted(ctx["ti"], "promote"):
            refuse_unknown_params(ctx["dag_run"].conf, ctx["dag"].params)  # where REST did not check
            job = ConfigSnapshot.take(CONFIGS[params["model"]], {"publish.alias": params["alias"]})
            force = bool(params["force"])
            return promotion_stages.stage_promote_check(
                job, params["version"], force=force, reason=params["reason"],
                requester=run_starter(ctx) if force else None).to_xcom()

    @task(execution_timeout=timedelta(hours=6))
    def evaluate(promotion: dict) -> dict | None:
        planned = promotion_stages.Promotion.from_xcom(promotion)
        if planned.force:
            return None
        with refusal_noted(get_current_context()["ti"], "evaluate"):
            return promotion_stages.stage_promote_evaluate(planned).to_xcom()

    @task.short_circuit(execution_timeout=timedelta(hours=1))
    def gate(promotion: dict, scored: dict | None) -> bool:
        ti = get_current_context()["ti"]
        if scored is None:  # forced: no gate, the approval still comes
            ti.xcom_push(key="decision", value=None)
            return True
        decision = promotion_stages.stage_promote_gate(promotion_stages.Promotion.from_xcom(promotion),
                                                       VersionsScored.from_xcom(scored))
        ti.xcom_push(key="decision", value=decision.to_xcom())
        if not decision.publish:
            note_run(ti, f"gate: {decision.reason}")
        return decision.publish

    @task(execution_timeout=timedelta(minutes=10), outlets=[MODEL_EVENTS])
    def promote(promotion: dict, *, outlet_events=None) -> dict:
        ctx = get_current_context()
        ti = ctx["ti"]
        planned = promotion_stages.Promotion.from_xcom(promotion)
        decided = ti.xcom_pull(task_ids="gate", key="decision")
        answer = ti.xcom_pull(task_ids="approval")
        approval = ApprovalAnswer.from_dict(answer) if answer is not None else None
        approver = approval.by if approval is not None and approval.approved else None
        with refusal_noted(ti, "promote"):
            record = promotion_stages.stage_promote(
                planned, None if decided is None else GateDecision.from_xcom(decided),
                actor=via(approver or triggering_user(ctx), run_name(ctx)), approved_by=approver,
                comment=approval.comment if approval is not None else "")
        outlet_events[MODEL_EVENTS].add(Asset(alias_asset_uri(record.model, record.alias)),
                                        extra={"version": record.to_version})
        note_run(ti, f"promoted {record.model} v{record.to_version} onto {record.alias} (was "
                     f"{'nothing' if record.from_version is None else f'v{record.from_version}'})")
        return record.to_dict()

    checked = check()
    scored = evaluate(checked)
    passed = gate(checked, scored)
    # No answer within publish.approval_timeout_s: the default, Reject.
    approval = PromoteApproval(
        task_id="approval", subject="Promote the version?", defaults=ApprovalOperator.REJECT, plan_out=checked,
        scored=scored, decision=XComArg(passed.operator, key="decision"),
        params={"comment": Param(None, type=["null", "string"], maxLength=MAX_COMMENT,  # null: optional in the UI
                                 description="why (kept in the run note or the alias history)")})
    passed >> approval >> promote(checked)


promote_dag = promote_model()
