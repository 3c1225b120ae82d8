"""One evaluation rank, started like a training rank: `python -m tasks.evaluate.worker --config C`.

Why ranks: a 7B+ model does not fit one process, so evaluation runs on the cluster through the
training launcher, in `evaluate.parallel` (default: the training layout). Each node's first rank
warms the suites' datasets (verified against the manifest hashes the launcher side resolved) and
fetches a registry version's weights into the node's cache; every rank then loads only its slice
(tasks/evaluate/sharded.py). DP replicas take batches b = dp_rank (mod dp); the per-token losses are
summed in float64, so any layout gives the same numbers up to float32 rounding in the forward.
Rank 0 keeps the status file current (batches done) and writes `summary.json`:
`{"models": {name: {"<suite>.loss": ..., "<suite>.perplexity": ..., "<suite>.tokens": ..., ...}}, ...,
"peak_rss_bytes": [each rank's host high-water mark]}`.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist

from tasks.base.errors import InvalidInputError, RetrainerError
from tasks.base.fsutil import atomic_write_json
from tasks.base.job_status import Status, log_for_relay, now, write_status
from tasks.config.schema import LoraConfig, TrainingJob
from tasks.config.util import load_entry_point
from tasks.data.report import refuse_unplanned
from tasks.data.tokens import ShardRules
from tasks.data.warm import warm
from tasks.evaluate.harness import RequestScorer, run_benchmarks
from tasks.evaluate.sharded import ShardedModel
from tasks.evaluate.spec import window_order
from tasks.inputs.weights import WeightSources, fetch_model_files, fetch_weights
from tasks.models.common.packing import Packing
from tasks.runs.identity import StartingWeights
from tasks.train.checkpoint import validate_checkpoint_dir
from tasks.train.data import TokenWindows
from tasks.train.memory_trace import peak_rss_bytes
from tasks.train.mirror import Mirror
from tasks.train.packing import IGNORE, packed_inputs
from tasks.train.rank import (
    exit_without_teardown,
    finish,
    join_process_group,
    quiet_start_up,
    report_failure,
)

log = logging.getLogger("tasks.evaluate.worker")


def batch_inputs(windows: TokenWindows, indices: list[int]
                 ) -> tuple[torch.Tensor, torch.Tensor, Packing | None, torch.Tensor | None]:
    """One evaluated batch as the model scores it: tokens, targets, packing and which targets count (None: all),
    read when the pipeline takes the batch (once per evaluated batch). A chat dataset's windows are packed
    conversations, scored on the assistant's tokens only (as trained)."""
    if not windows.packed:
        batch = windows.get(indices)
        return batch[:, :-1], batch[:, 1:], None, None
    (tokens, positions, docs), labels = packed_inputs(windows.get_packed(indices))
    scored = labels != IGNORE
    return tokens, labels.masked_fill(~scored, 0), (positions, docs), scored


def score_batches(model: ShardedModel, windows: TokenWindows, batches: list[list[int]]
                  ) -> Iterator[torch.Tensor | None]:
    """The NLL of every scored token of each batch on the last stage (None elsewhere), the batches through the
    stages as one pipeline (`ShardedModel.score_batches`)."""
    for scored, nll in model.score_batches(batch_inputs(windows, indices) for indices in batches):
        yield nll if nll is None or scored is None else nll[scored.to(nll.device)]


class Evaluation:
    """The ranks' side of one evaluation job: warm, load each model, score each suite, run user metrics."""

    def __init__(self, job: TrainingJob, spec: dict[str, Any]) -> None:
        join_process_group(job.cluster)
        self.job, self.spec = job, spec
        self.rank, self.world = tdist.get_rank(), tdist.get_world_size()
        p = job.parallel
        if self.world != p.layout.world_size:
            raise InvalidInputError(f"world size {self.world} != evaluation tp x pp x dp = {p.layout.world_size}")
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        own = -(-spec["batches"] // p.dp)  # rank 0's batches per suite (replica 0 takes the most)
        self.total = len(spec["models"]) * len(spec["suites"]) * own
        self.done = 0
        self.markers: dict[str, dict[str, Any]] = {}  # each checkpoint's marker, as node 0 validated it

    # ---- inputs on this node -----------------------------------------------------------------

    def on_leaders(self, fn: Any) -> Any:
        """Run `fn` on each node's first rank and hand its result to the node's other ranks."""
        mine = fn() if self.local_rank == 0 else None
        results: list[Any] = [None] * self.world
        tdist.all_gather_object(results, mine)
        return results[self.rank - self.local_rank]

    def warm_suites(self) -> dict[str, Path]:
        def fetch() -> dict[str, str]:
            dirs = {}
            for s in self.spec["suites"]:
                rules = ShardRules(self.job.model.vocab_size, (s["split"],), f"evaluate suite {s['name']}")
                result = warm(s["source_url"], self.spec["cache_dir"], manifest_key=s["manifest"],
                              storage_options=self.spec["data_storage_options"], progress=False, rules=rules,
                              seq_len=self.job.model.seq_len)
                refuse_unplanned(result.manifest_hash, s["manifest_hash"], s["source_url"],
                                 f"evaluate suite {s['name']}")
                dirs[s["name"]] = str(result.dataset_dir)
            return dirs

        return {name: Path(d) for name, d in self.on_leaders(fetch).items()}

    def weights(self, entry: dict[str, Any]) -> Path:
        """The local weights of one model, validated on each node: a checkpoint directory (node-local ones
        completed from `train.checkpoint_url`), or a registry version fetched once per node."""
        if entry.get("path"):
            return Path(self.on_leaders(lambda: str(self.checkpoint(entry))))
        init = StartingWeights(**entry["weights"])
        return Path(self.on_leaders(lambda: str(fetch_weights(init, self.sources()))))

    def adapter(self, entry: dict[str, Any]) -> tuple[LoraConfig | None, Path | None]:
        """(LoRA settings, PEFT directory) of a model scored as base + adapter: a LoRA run's checkpoint (it
        holds both: no directory) or a version's adapter published alone (fetched once per node)."""
        if "path" in entry:  # a checkpoint
            return self.job.train.lora, None
        if "adapter" not in entry:
            return None, None
        from tasks.inputs.adapter import fetch_adapter
        from tasks.runs.identity import StartingWeights

        version = StartingWeights(**entry["adapter"])
        dest = Path(self.job.train.output_dir) / "live-adapter" / str(version.digest)
        path = self.on_leaders(lambda: str(fetch_adapter(version, self.sources(), dest)))
        return LoraConfig.model_validate(entry["lora"]), Path(path)

    def sources(self) -> Any:
        s = self.spec
        return WeightSources(cache_dir=s["cache_dir"], model=s["model"], store_url=s["store_url"],
                             store_options=s["store_options"])

    def tokenizer(self) -> Any:
        """The starting model's tokenizer (fetched alone, once per node) for the user metrics, or None."""
        files = self.model_files()
        path = None if files is None else files / "tokenizer.json"
        if path is None or not path.is_file():
            return None
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(path))

    def model_files(self) -> Path | None:
        """The starting model's config and tokenizer files (fetched alone, once per node), or None."""
        def fetch() -> str | None:
            out = Path(self.job.train.output_dir)
            files: Path | None = out / "model-files"  # an earlier attempt's (a retry): fetched whole, or not at all
            if not files.is_dir():
                tmp = out / f"model-files.tmp-{os.getpid()}"
                shutil.rmtree(tmp, ignore_errors=True)
                got = fetch_model_files(StartingWeights(**self.spec["starting_weights"]), self.sources(), tmp)
                files = None if got is None else Path(got)
                if files == tmp:
                    tmp.rename(out / "model-files")
                    files = out / "model-files"
            return None if files is None else str(files)

        path = self.on_leaders(fetch)
        return None if path is None else Path(path)

    def checkpoint(self, entry: dict[str, Any]) -> Path:
        path, mirror = Path(entry["path"]), entry.get("mirror")
        if mirror is not None:
            path = Mirror(mirror["url"], mirror["storage_options"], mirror["run_id"]).weights(
                path.name, path, Path(self.job.train.output_dir) / "weights")
        self.markers[entry["name"]] = validate_checkpoint_dir(path, entry["fingerprint"], entry["experiment_key"])
        return path

    # ---- scoring -----------------------------------------------------------------------------

    def report(self, state: str, reason: str | None = None) -> None:
        if self.rank == 0 or reason is not None:
            write_status(self.job.train.output_dir, Status(state=state, step=self.done, steps=self.total,  # type: ignore[arg-type]
                                                           at=now(), reason=reason, rank=self.rank))

    def score_suite(self, model: ShardedModel, dataset_dir: Path, split: str) -> dict[str, float]:
        m, p, s = self.job.model, self.job.parallel, self.spec
        windows = TokenWindows(dataset_dir, split, m.seq_len, m.vocab_size)
        order = window_order(len(windows), s["batches"], s["batch_size"])
        sums = torch.zeros(2, dtype=torch.float64)
        mine = [order[b * s["batch_size"]:(b + 1) * s["batch_size"]].tolist()
                for b in range(model.dp_rank, s["batches"], p.dp)]
        for nll in score_batches(model, windows, mine):
            if nll is not None and model.tp.rank == 0:  # one count per replica: TP peers hold the same losses
                sums += torch.tensor([nll.double().sum().item(), nll.numel()], dtype=torch.float64)
            self.done += 1
            self.report("evaluating")
        tdist.all_reduce(sums)
        loss = float(sums[0] / sums[1])
        if not math.isfinite(loss):
            raise InvalidInputError(f"{dataset_dir}: held-out loss is not finite ({loss})")
        return {"loss": loss, "perplexity": math.exp(loss), "tokens": int(sums[1])}

    def user_metrics(self, model: ShardedModel, dirs: dict[str, Path]) -> dict[str, float]:
        if not self.spec["metrics"]:
            return {}
        tokenizer = self.tokenizer()
        out: dict[str, float] = {}
        for metric in self.spec["metrics"]:
            fn = load_entry_point(metric["entry_point"], "evaluate.metrics")
            values = fn(model, tokenizer, dirs[metric["suite"]])
            if not isinstance(values, dict) or set(values) != set(metric["names"]):
                got = sorted(values) if isinstance(values, dict) else type(values).__name__
                raise InvalidInputError(f"evaluate.metrics {metric['entry_point']}: returned {got}, the config "
                                        f"declares {sorted(metric['names'])}")
            for name, value in values.items():
                if not isinstance(value, int | float) or not math.isfinite(float(value)):
                    raise InvalidInputError(f"evaluate.metrics {metric['entry_point']}: {name} = {value!r} is not a "
                                            "finite number")
                out[f"{metric['suite']}.{name}"] = float(value)
        return out

    def run(self) -> dict[str, Any]:
        self.report("evaluating")
        dirs = self.warm_suites()
        p = self.job.parallel
        results: dict[str, Any] = {}
        benchmarks: dict[str, Any] = {}  # each model's harness record (rank 0)
        for entry in self.spec["models"]:
            weights = self.weights(entry)
            lora, adapter = self.adapter(entry)
            model = ShardedModel(self.job.model, weights, p.layout, as_dtype=entry.get("as_dtype"),
                                 dtype=self.spec["dtype"], lora=lora, adapter=adapter)
            metrics: dict[str, float] = {}
            for suite in self.spec["suites"]:
                for key, value in self.score_suite(model, dirs[suite["name"]], suite["split"]).items():
                    metrics[f"{suite['name']}.{key}"] = value
            metrics.update(self.user_metrics(model, dirs))
            if self.spec["benchmarks"]:
                scorer = RequestScorer(model, self.spec["batch_size"], self.job.model.seq_len)
                scores, benchmarks[entry["name"]] = run_benchmarks(scorer, self.model_files(), self.spec["benchmarks"])
                metrics.update(scores)
            results[entry["name"]] = metrics
            if self.rank == 0:
                log.info("evaluated %s: %s", entry["name"], ", ".join(f"{k} {v:.6g}" for k, v in metrics.items()))
            del model
        peak_rss: list[Any] = [None] * self.world  # each rank's host high-water mark (the plan's evaluation term)
        tdist.all_gather_object(peak_rss, peak_rss_bytes())
        summary = {"models": results, "benchmarks": benchmarks, "markers": self.markers, "world_size": self.world,
                   "layout": p.layout.record(), "peak_rss_bytes": peak_rss}
        if self.rank == 0:
            atomic_write_json(Path(self.job.train.output_dir) / "summary.json", summary)
        self.report("finished")
        return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tasks.evaluate.worker")
    parser.add_argument("--config", required=True, help="JSON input file written by the launcher")
    parser.add_argument("--dataset-dir", help="(unused: each suite is warmed on the node)")
    args = parser.parse_args(argv)
    log_for_relay(f"rank {os.environ.get('RANK', '0')}")
    quiet_start_up()
    spec = json.loads(Path(args.config).read_text())
    job = TrainingJob.model_validate(spec["job"])
    evaluation = None
    try:
        evaluation = Evaluation(job, spec["evaluation"])
        evaluation.run()
    except RetrainerError as exc:
        log.error("evaluation failed: %s", exc)
        return report_failure(job.train.output_dir, exc, step=evaluation.done if evaluation else 0,
                              steps=evaluation.total if evaluation else 0)
    return finish()


if __name__ == "__main__":
    exit_without_teardown(main)
