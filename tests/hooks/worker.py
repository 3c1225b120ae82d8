"""The training worker with the rank-side test hooks patched in (see tests/hooks/__init__.py)."""

from __future__ import annotations

import copy
import logging
import os
import time

from tasks.train import checkpoint as ck
from tasks.train import telemetry, worker

log = logging.getLogger("tests.hooks")


def install() -> None:
    step = {"now": 0}
    product_batches = worker.Trainer.batches

    def batches(self, step0):  # called once per step, before it runs
        step["now"] = step0 + 1
        return product_batches(self, step0)

    worker.Trainer.batches = batches

    if nan_at := int(os.environ.get("HOOK_NAN_AT_STEP") or 0):
        product_family = worker.get_family

        def get_family(name):  # the family as the product has it, its loss turned NaN at one step
            family = product_family(name)
            patched = copy.copy(family)

            def make_loss_fn(tp):
                loss_fn = family.make_loss_fn(tp)
                return lambda logits, labels: loss_fn(logits, labels) * (
                    float("nan") if step["now"] == nan_at else 1.0)

            patched.make_loss_fn = make_loss_fn
            return patched

        worker.get_family = get_family

    if delay := float(os.environ.get("HOOK_STEP_DELAY_S") or 0):
        product_report = worker.Trainer.report

        def report(self, state, at_step, loss):
            product_report(self, state, at_step, loss)
            if state == "training" and at_step == step["now"]:  # after a step, not the resume point
                time.sleep(delay)

        worker.Trainer.report = report

    if spec := os.environ.get("HOOK_CKPT_DELAY"):
        at, seconds = spec.split(":")
        product_finalize = ck.finalize

        def finalize(root, tag, marker, keep_last):
            if marker["step"] == int(at):
                log.warning("hook: pausing %s s inside the commit of step %s", seconds, at)
                time.sleep(float(seconds))
            return product_finalize(root, tag, marker, keep_last)

        ck.finalize = finalize

    if os.environ.get("HOOK_REWORD_LOGS"):
        class Reword(logging.Filter):
            def filter(self, record: logging.LogRecord) -> bool:
                record.msg = "~~ " + str(record.msg).replace("step", "stage").replace("failed", "went wrong")
                return True

        for logger in (worker.log, telemetry.log):
            logger.addFilter(Reword())


if __name__ == "__main__":
    install()
    worker.exit_without_teardown(worker.main)
