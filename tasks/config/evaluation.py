"""The `serving` and `evaluate` sections: the evaluation suites, user metrics, the gate's rules and the
evaluation ranks' layout."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    Field,
    model_validator,
)

from tasks.base.layout import Layout
from tasks.config.bounds import MAX_BATCH, MAX_EVAL_BATCH_SIZE, MAX_EVAL_BATCHES, MAX_POSITIONS, MAX_RANKS, Strict


class ServingConfig(Strict):
    """What the published model is sized for when served (the serving memory estimate)."""

    concurrency: int = Field(1, ge=1, le=MAX_BATCH, description="concurrent sequences")
    context_len: int | None = Field(None, ge=1, le=MAX_POSITIONS,
                                    description="tokens per sequence; None: model.seq_len")
    dtype: Literal["bf16", "fp16", "fp32", "int8"] = "bf16"


_SUITE_NAME = r"^[A-Za-z0-9][A-Za-z0-9_-]*$"  # no dots: a metric's name is <suite>.<metric>
ENTRY_POINT_PATTERN = r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*$"
BUILTIN_METRICS = ("loss", "perplexity")  # what every suite reports (tasks/evaluate/worker.py)


class EvalSuite(Strict):
    """A named, manifest-verified held-out set every evaluation scores (the candidate and the live model)."""

    name: str = Field(min_length=1, max_length=100, pattern=_SUITE_NAME)
    source_url: str | None = Field(None, min_length=1, description="dataset prefix; None: the run's training data")
    manifest: str = "manifest.json"
    split: str = Field("heldout", min_length=1, pattern=_SUITE_NAME, description="key prefix of the windows")


class UserMetric(Strict):
    """A user's metric: `module:function(model, tokenizer, dataset_dir) -> {name: float}` on one suite's data."""

    entry_point: str = Field(pattern=ENTRY_POINT_PATTERN)
    suite: str = Field(description="the suite whose dataset directory the function receives")
    names: tuple[str, ...] = Field(min_length=1, description="the names it returns (recorded as <suite>.<name>)")


class Benchmark(Strict):
    """lm-evaluation-harness tasks every evaluation runs on the candidate and the live model, scored by the evaluation
    ranks (tasks/evaluate/harness.py); each setting that changes a score is pinned here and recorded."""

    name: str = Field(min_length=1, max_length=100, pattern=_SUITE_NAME)
    tasks: tuple[str, ...] = Field(min_length=1, description="harness task or group names (metrics are "
                                                             "<name>.<task>.<metric>)")
    num_fewshot: int = Field(0, ge=0, le=64, description="few-shot examples per prompt (pinned: not the task's "
                                                         "default)")
    limit: int | None = Field(None, gt=0, description="examples per task (None: all)")
    apply_chat_template: bool = Field(False, description="render prompts with the model's chat template")
    include_path: str | None = Field(None, min_length=1, description="a folder of task YAML (and their data: "
                                     "relative data_files are read from it), on the first evaluation node too")
    metrics: tuple[str, ...] = Field(("acc",), min_length=1, description="the harness metrics recorded and gated "
                                                                         "on (its `<metric>,<filter>` keys, "
                                                                         "`,none` left out)")

    @model_validator(mode="after")
    def _names(self) -> Benchmark:
        for what, names in (("tasks", self.tasks), ("metrics", self.metrics)):
            if len(set(names)) != len(names) or any(not n or "." in n or "/" in n for n in names):
                raise ValueError(f"benchmark {self.name!r}: {what} must be unique names without dots or "
                                 f"slashes, got {list(names)}")
        return self

    def metric_names(self) -> list[str]:
        return [f"{self.name}.{task}.{metric}" for task in self.tasks for metric in self.metrics]


class GateRule(Strict):
    """One condition a candidate must meet to be published."""

    metric: str = Field(description="<suite>.loss, <suite>.perplexity, <suite>.<user metric name> or "
                                    "<benchmark>.<task>.<metric>")
    direction: Literal["min", "max"] = Field("min", description="min: lower is better; max: higher is better")
    against: Literal["live", "absolute"] = "live"
    tolerance: float = Field(0.0, ge=0, description="how much worse than live is allowed")
    tolerance_kind: Literal["relative", "absolute"] = "relative"
    threshold: float | None = Field(None, description="the bound when against is absolute")

    @model_validator(mode="after")
    def _bound(self) -> GateRule:
        if self.against == "absolute" and self.threshold is None:
            raise ValueError(f"rule on {self.metric!r}: against 'absolute' needs a threshold")
        if self.against == "live" and self.threshold is not None:
            raise ValueError(f"rule on {self.metric!r}: a threshold is only for against 'absolute'")
        return self


class GateConfig(Strict):
    metric: Literal["loss"] = Field("loss", description="(without rules) the first suite's loss")
    tolerance: float = Field(0.0, ge=0, description="(without rules) publish if new <= live * (1 + tolerance)")
    rules: tuple[GateRule, ...] = Field((), description="every rule must pass; empty: the first suite's loss "
                                                        "against live with `tolerance`")


class EvalParallel(Strict):
    """The evaluation ranks' own layout (default: the training layout)."""

    tp: int = Field(1, ge=1, le=MAX_RANKS)
    pp: int = Field(1, ge=1, le=MAX_RANKS)
    dp: int = Field(1, ge=1, le=MAX_RANKS)

    @property
    def layout(self) -> Layout:
        return Layout(dp=self.dp, tp=self.tp, pp=self.pp)


ExportDtype = Literal["bf16", "fp32"]


class EvaluateConfig(Strict):
    batches: int = Field(8, gt=0, le=MAX_EVAL_BATCHES)
    # bf16: the dtype the model is published in and vLLM serves, half the memory of fp32, and the matmul units'
    # own dtype (GPU tensor cores; CPUs with AMX or AVX512-BF16: a 300M forward 3.6x faster than fp32 on one
    # Xeon core). The loss is still taken in fp32. fp32 gives every layout the same numbers to float32 rounding.
    dtype: ExportDtype = Field("bf16", description="dtype the evaluation ranks hold the weights and compute in")
    batch_size: int = Field(8, gt=0, le=MAX_EVAL_BATCH_SIZE)
    parallel: EvalParallel | None = None
    suites: tuple[EvalSuite, ...] = Field((EvalSuite(name="heldout"),), min_length=1)
    metrics: tuple[UserMetric, ...] = ()
    benchmarks: tuple[Benchmark, ...] = ()
    gate: GateConfig = GateConfig()

    @model_validator(mode="after")
    def _names(self) -> EvaluateConfig:
        names = [s.name for s in self.suites]
        if len(set(names)) != len(names):
            raise ValueError(f"evaluate.suites: suite names must be unique, got {names}")
        benchmarks = [b.name for b in self.benchmarks]
        if len(set(benchmarks)) != len(benchmarks) or set(benchmarks) & set(names):
            raise ValueError(f"evaluate.benchmarks: names must be unique and differ from the suites' ({names}), got "
                             f"{benchmarks}")
        for i, metric in enumerate(self.metrics):
            if metric.suite not in names:
                raise ValueError(f"evaluate.metrics[{i}].suite: unknown suite {metric.suite!r} (suites: {names})")
        known = self.metric_names()
        for i, rule in enumerate(self.rules()):
            if rule.metric not in known:
                raise ValueError(f"evaluate.gate.rules[{i}].metric: unknown metric {rule.metric!r} "
                                 f"(known: {', '.join(known)})")
        return self

    def metric_names(self) -> list[str]:
        """Every metric an evaluation reports, as the gate rules name them."""
        out = [f"{s.name}.{m}" for s in self.suites for m in BUILTIN_METRICS]
        out += [f"{m.suite}.{n}" for m in self.metrics for n in m.names]
        out += [name for b in self.benchmarks for name in b.metric_names()]
        if len(set(out)) != len(out):
            raise ValueError(f"evaluate.metrics: two metrics report the same name ({out})")
        return out

    def rules(self) -> tuple[GateRule, ...]:
        """The gate's rules: as configured, or the first suite's loss against live within `gate.tolerance`."""
        if self.gate.rules:
            return self.gate.rules
        return (GateRule(metric=f"{self.suites[0].name}.loss", tolerance=self.gate.tolerance),)
