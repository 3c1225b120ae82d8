"""rollback_model: move a model's alias back to the version that was live before (or to a chosen one).

Only for a person the alias's policy admits as a mover (`publish.policy.<alias>.movers`, default role:op), and
only back: a chosen version the alias never held is refused (putting it there is a promotion: promote_model).

Thin wiring over tasks.stages.lifecycle.stage_rollback. By default the alias goes to the newest version live on it
before the current one that was not itself rolled back from it (twice means further back, never redo); a
chosen version that was rolled back from the alias needs `force` and a reason. The switch is audited in the
registry's history under the person who triggered the run (`alice via airflow rollback_model/<run>`) and
emits an Asset event model://<name>/<alias> so a deploy DAG can react.
"""

from __future__ import annotations

from airflow.sdk import Asset, Param, dag, get_current_context, task
from retrainer_airflow.audit import run_actor
from retrainer_airflow.configs import MODEL_EVENTS, alias_params, configs_by_name
from retrainer_airflow.contract import refusal_noted, refuse_unknown_params
from retrainer_airflow.people import run_starter

from tasks.models.resolve import load_config
from tasks.registry import alias_asset_uri
from tasks.stages import lifecycle

CONFIGS = configs_by_name()


@dag(
    dag_id="rollback_model",
    schedule=None,
    catchup=False,
    tags=["retrainer"],
    doc_md=__doc__,
    params={
        **alias_params(CONFIGS, "roll back"),
        "to_version": Param(None, type=["null", "integer"], minimum=1,
                            description="target version (default: the newest one live before the current that "
                                        "was not rolled back from the alias)"),
        "force": Param(False, type="boolean",
                       description="allow a target version that was rolled back from this alias (say why in reason)"),
        "reason": Param("rollback", type="string", minLength=1, maxLength=500, description="audit note"),
    },
)
def rollback_model():
    @task(outlets=[MODEL_EVENTS])
    def rollback(*, outlet_events=None) -> dict:
        ctx = get_current_context()
        params = ctx["params"]
        with refusal_noted(ctx["ti"], "rollback"):  # a refusal here is the run's note
            refuse_unknown_params(ctx["dag_run"].conf, ctx["dag"].params)  # where REST did not check
            cfg = load_config(CONFIGS[params["model"]])
            result = lifecycle.stage_rollback(
                cfg, alias=params["alias"], to_version=params["to_version"], actor=run_actor(ctx),
                reason=params["reason"], force=bool(params["force"]), mover=run_starter(ctx),
            )
        outlet_events[MODEL_EVENTS].add(Asset(alias_asset_uri(result.model, result.alias)),
                                        extra={"version": result.to_version})
        return result.to_dict()

    rollback()


rollback_dag = rollback_model()
