"""The training worker with the rank-side test hooks patched in (see tests/hooks/__init__.py)."""

from __future__ import annotations

import copy
import json
import logging
import os
import time
from pathlib import Path

from tasks.train import async_save, checkpointer, data, telemetry, worker
from tasks.train import checkpoint as ck
from tasks.train.rank import exit_without_teardown

log = logging.getLogger("tests.hooks")


def install() -> None:
    step = {"now": 0}
    product_batches = worker.Trainer.batches

    def batches(self, step0):  # called once per step, before it runs
        step["now"] = step0 + 1
        return product_batches(self, step0)

    worker.Trainer.batches = batches

    if sample_log := os.environ.get("HOOK_SAMPLE_LOG"):  # which windows each rank reads for each step
        product_get = data.TokenWindows.get
        read: list[list[int]] = []

        def get(self, indices):
            read.append([int(i) for i in indices])
            return product_get(self, indices)

        def logged_batches(self, step0):
            read.clear()
            out = batches(self, step0)
            with open(f"{sample_log}.rank{os.environ.get('RANK', '0')}", "a") as fh:
                fh.write(json.dumps({"step": step0 + 1, "dp_rank": self.dp_rank, "dp": self.cfg.parallel.dp,
                                     "micro_batches": read}) + "\n")
            return out

        data.TokenWindows.get = get
        worker.Trainer.batches = logged_batches

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

    if spec := os.environ.get("HOOK_BAD_TOKEN_AT"):  # the rank's embedding raises IndexError at that step
        at, bad_rank = (int(v) for v in spec.split(":"))
        unbroken_batches = worker.Trainer.batches

        def bad_batches(self, step0):
            out, packing = unbroken_batches(self, step0)
            if step0 + 1 == at and self.rank == bad_rank:
                x, y = out[0]
                x = x.clone()  # a copy: the batch may be a view of the dataset's mapped file
                x[0, 0] = self.cfg.model.vocab_size + 44
                out[0] = (x, y)
            return out, packing

        worker.Trainer.batches = bad_batches

    delay = float(os.environ.get("HOOK_STEP_DELAY_S") or 0)
    delays = os.environ.get("HOOK_STEP_DELAY_DIR")
    if delay or delays:
        product_report = worker.Trainer.report

        def report(self, state, at_step, loss):
            product_report(self, state, at_step, loss)
            if state == "training" and at_step == step["now"]:  # after a step, not the resume point
                if delays:
                    _wait_model_delay(delays, self.cfg.name)
                else:
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

    if spec := os.environ.get("HOOK_CKPT_WRITE_DELAY"):  # a slow disk under the background save of one step
        at, seconds = spec.split(":")
        product_write = async_save.write_file

        def slow_write(path, state):
            if f"tmp-{ck.tag_for(int(at))}" in str(path):
                log.warning("hook: writing %s slowly (%s s)", path, seconds)
                time.sleep(float(seconds))
            return product_write(path, state)

        async_save.write_file = slow_write

    if spec := os.environ.get("HOOK_CKPT_WRITE_ERROR"):  # the disk of one rank fails under one step's save
        at, bad_rank = spec.split(":")
        product_write_ = async_save.write_file

        def failing_write(path, state):
            if f"tmp-{ck.tag_for(int(at))}" in str(path) and os.environ.get("RANK") == bad_rank:
                raise OSError(28, "No space left on device (hook)", path)
            return product_write_(path, state)

        async_save.write_file = failing_write

    if directory := os.environ.get("HOOK_OPTIMIZER_PARAMS"):
        from tests.hooks.optimizer import record

        product_init = worker.Trainer.__init__

        def init(self, *args, **kwargs):
            product_init(self, *args, **kwargs)
            record(self, directory)

        worker.Trainer.__init__ = init

    if os.environ.get("HOOK_REWORD_LOGS"):
        class Reword(logging.Filter):
            def filter(self, record: logging.LogRecord) -> bool:
                record.msg = "~~ " + str(record.msg).replace("step", "stage").replace("failed", "went wrong")
                return True

        for logger in (worker.log, checkpointer.log, telemetry.log):
            logger.addFilter(Reword())


def _model_delay_s(delays: str, model: str) -> float:
    """The seconds in `<delays>/<model>` (the test changes it mid-run); none: 0."""
    try:
        return float(Path(delays, model).read_text())
    except FileNotFoundError:
        return 0.0


def _wait_model_delay(delays: str, model: str) -> None:
    """Sleep the model's delay after a step, reading it again as it goes: a test holds a job with a long one
    and releases it at once by lowering it."""
    since = time.monotonic()
    while time.monotonic() - since < _model_delay_s(delays, model):
        time.sleep(0.2)


if __name__ == "__main__":
    install()
    exit_without_teardown(worker.main)
