"""The evaluation worker with the rank-side test hooks patched in (see tests/hooks/__init__.py)."""

from __future__ import annotations

import logging
import os
import time

from tasks.evaluate import worker
from tasks.train.rank import exit_without_teardown

log = logging.getLogger("tests.hooks")


def install() -> None:
    if delay := float(os.environ.get("HOOK_EVAL_DELAY_S") or 0):
        product_inputs = worker.batch_inputs
        batch = {"n": 0}

        def batch_inputs(windows, indices):  # once per evaluated batch
            batch["n"] += 1
            log.info("evaluate: hook: sleeping %.1f s before batch %d", delay, batch["n"])
            time.sleep(delay)
            return product_inputs(windows, indices)

        worker.batch_inputs = batch_inputs

    if bad_rank := os.environ.get("HOOK_EVAL_BAD_TOKEN_RANK"):  # that rank's embedding raises IndexError
        unbroken_inputs = worker.batch_inputs

        def bad_batch_inputs(windows, indices):
            if os.environ.get("RANK") == bad_rank:
                read = windows.get

                def get(which):  # this batch's first token past any vocabulary
                    batch = read(which).clone()
                    batch[0, 0] = 2**31 - 1
                    return batch

                windows.get = get
            return unbroken_inputs(windows, indices)

        worker.batch_inputs = bad_batch_inputs


if __name__ == "__main__":
    install()
    exit_without_teardown(worker.main)
