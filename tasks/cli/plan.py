"""`retrainer plan CONFIG`: the budget (tasks/plan/cli.py), once the data the config names has been checked
against the model where this machine's cache holds it already.

Why here: the check reads the warm's record of a cached dataset (its largest token ids, tasks/data/warm_state.py),
a layer above the planner. A dataset cached for a model with a larger vocabulary is refused, naming the
dataset, its largest id and `model.vocab_size`, before anything is warmed or any rank starts; data not cached
yet (or not readable now) is the warm's to check.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from tasks.base.errors import RetrainerError
from tasks.plan import cli as budget

log = logging.getLogger(__name__)


def register(subparsers: Any) -> None:
    budget.register(subparsers)
    subparsers.choices["plan"].set_defaults(handler=_handle)


def _handle(args: argparse.Namespace) -> int:
    # lazy: a verb loads only what it runs (retrainer --help stays instant)
    from tasks.data.sources import refuse_cached, suite_sources, training_sources
    from tasks.data.warm import remote_manifest_hash

    cfg = budget.configured(args)
    planned = []
    for source in [*training_sources(cfg), *suite_sources(cfg)]:
        try:
            planned.append((source, remote_manifest_hash(source.source_url, source.manifest,
                                                         source.storage_options)))
        except RetrainerError as exc:  # nothing there (yet) to have been cached; the warm says what is wrong
            log.debug("plan: %s not checked against the cache: %s", source.field, exc)
    refuse_cached(cfg, planned)
    return budget.report(args, cfg)
