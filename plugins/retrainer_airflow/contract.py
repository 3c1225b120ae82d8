"""The retrainer's contract with Airflow: what a run's form, conf and triggering events mean, and how a task
tells the run's note. tasks/ never sees an Airflow object; the DAGs and operators call these.

- the manual-run form (Params) -> dotted config overrides (`overrides_from_params`);
- a conf that names a key the DAG has no param for is refused (`refuse_unknown_params`; the API server's
  middleware, retrainer_registry.conf_guard, and the DAG's first task for runs started another way);
- a data-arrival Asset event's `extra.source_url` names the snapshot to train on (`arrived_source_url`);
- a task tells why its run ended by pushing the XCom `RUN_NOTE_KEY` (`note_run`, `refusal_noted`); the
  run-notes listener (retrainer_registry.run_notes) copies it into the DAG run's note.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from tasks.base.errors import ConfigError, InvalidInputError, RetrainerError

log = logging.getLogger(__name__)

# Manual-run Params (the Airflow form) -> dotted config overrides.
PARAM_OVERRIDES = {
    "steps": "train.steps",
    "tp": "parallel.tp",
    "pp": "parallel.pp",
    "dp": "parallel.dp",
    "micro_batches": "parallel.micro_batches",
    "alias": "publish.alias",
    "slurm_time_limit": "cluster.slurm.time_limit",
}

# The XCom a task pushes for its run's note; the plugin's run-notes listener copies it into the DAG run's note.
RUN_NOTE_KEY = "run_note"


def overrides_from_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """Map a manual run's form values onto config fields; unset (None) values keep the config's."""
    return {field: params[name] for name, field in PARAM_OVERRIDES.items() if params.get(name) is not None}


def refuse_unknown_params(conf: Mapping[str, Any] | None, params: Iterable[str]) -> None:
    """A run's conf may name only the DAG's params: Airflow takes any other key and ignores it, so a typo
    (`stpes`) would run with the default. Raises InvalidInputError naming each unknown key."""
    known = sorted(params)
    unknown = sorted(set(conf or {}) - set(known))
    if unknown:
        raise InvalidInputError(f"unknown conf key{'s' * (len(unknown) > 1)} {', '.join(map(repr, unknown))}: "
                                f"not a param of this DAG (its params: {', '.join(known)})")


def arrived_source_url(events: Iterable[Any]) -> str | None:
    """The snapshot the data-arrival events name: `extra.source_url` of the newest event that has one."""
    for event in sorted(events, key=lambda e: e.timestamp, reverse=True):
        url = (event.extra or {}).get("source_url")
        if url is None:
            continue
        if not isinstance(url, str) or not url.strip() or any(c in url for c in "\n\r\x00"):
            raise InvalidInputError(f"asset event extra.source_url: not a URL: {url!r}")
        return url.strip()
    return None


def run_overrides(context: Mapping[str, Any]) -> dict[str, Any]:
    """The config overrides of the run a task belongs to: its form values (after refusing an unknown conf key)
    and, for a data-triggered run, the snapshot that arrived as `data.source_url`."""
    refuse_unknown_params(context["dag_run"].conf, context["dag"].params)
    overrides = overrides_from_params(context["params"])
    events = [e for evs in (context.get("triggering_asset_events") or {}).values() for e in evs]
    if arrived := arrived_source_url(events):
        log.info("retrainer: data arrived at %s: this run trains on it", arrived)
        overrides["data.source_url"] = arrived
    return overrides


def note_run(ti: Any, note: str) -> None:
    """Make `note` the run's note (shown on the run in the UI)."""
    ti.xcom_push(key=RUN_NOTE_KEY, value=note)


@contextmanager
def refusal_noted(ti: Any, stage: str) -> Iterator[None]:
    """A refusal (bad config, input, plan) raised inside becomes the run's note, `<stage>: <its message>`,
    so the UI shows why the run failed on the run itself; the task still fails, with that note as its exit
    (SystemExit): Airflow logs an exit as one line, where an exception gets its whole traceback, which for a
    refusal only buries the reason. Anything else (a bug) leaves as it came, traceback and all."""
    try:
        yield
    except (ConfigError, RetrainerError) as exc:
        message = str(exc)
        note = message if message.startswith(f"{stage}:") else f"{stage}: {message}"
        note_run(ti, note)
        raise SystemExit(note) from None
