"""The datasets a job reads, as its config names them, and the check of those this machine has cached already.

Why here: the warm of each node (tasks/inputs/node.py), the warm stage and `retrainer warm` read the same
list, so every launcher checks the same splits against the same vocabulary; and a dataset cached once keeps
its token ids in its record (tasks/data/warm_state.py), so a plan refuses a model that cannot read it before
anything is warmed or any rank starts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.base.dataset_format import MANIFEST_KEY, PlannedData
from tasks.data.cache import CacheLayout
from tasks.data.tokens import ShardRules
from tasks.data.warm_state import complete_record

if TYPE_CHECKING:
    from tasks.config.schema import JobConfig


@dataclass(frozen=True)
class DataSource:
    """One dataset a job reads: where (URL, manifest key, storage options), the splits it reads from it, and the
    config field that names it (for errors). Its fields travel in a node's warm spec as they are."""

    field: str
    source_url: str
    manifest: str = MANIFEST_KEY
    storage_options: dict[str, Any] = field(default_factory=dict)
    splits: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DataSource:
        """From a spec holding its fields (and others, e.g. the manifest hash a node must verify)."""
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls)} | {"splits": tuple(data["splits"])})

    def rules(self, vocab_size: int | None) -> ShardRules:
        return ShardRules(vocab_size, self.splits, self.field)


def training_sources(cfg: JobConfig) -> list[DataSource]:
    """The primary dataset (its train and held-out splits, and any split a suite reads from it), then each
    `data.replay` source (its train split: evaluation reads the primary's)."""
    d = cfg.data
    own = tuple(dict.fromkeys(("train", "heldout", *(s.split for s in cfg.evaluate.suites if s.source_url is None))))
    return [DataSource("data.source_url", d.source_url, d.manifest, d.storage_options, own),
            *(DataSource(f"data.replay[{i}].source_url", r.source_url, r.manifest, r.storage_options, ("train",))
              for i, r in enumerate(d.replay))]


def planned_data(cfg: JobConfig) -> PlannedData:
    """What the plan needs of the run's datasets, from their manifests as they are now: whether the data's
    windows are packed conversations, what every training rank holds to index the train split of the data and of
    each replay source, and what an evaluation rank holds for the largest split a suite reads."""
    from tasks.data.manifest import read_manifest  # lazy: pydantic only when a manifest must be parsed

    seq = cfg.model.seq_len
    data, *replay = [read_manifest(f"{s.source_url.rstrip('/')}/{s.manifest}", s.storage_options)
                     for s in training_sources(cfg)]
    train = [m.split_shape("train", seq) for m in (data, *replay)]
    suites = [(data if s.source_url is None else read_manifest(f"{s.source_url.rstrip('/')}/{s.manifest}",
                                                                cfg.data.storage_options)).split_shape(s.split, seq)
              for s in cfg.evaluate.suites]
    return PlannedData(packed=train[0].packed, train_index_bytes=sum(s.index_bytes(sampled=True) for s in train),
                       eval_index_bytes=max((s.index_bytes(sampled=False) for s in suites), default=0))


def suite_sources(cfg: JobConfig) -> list[DataSource]:
    """Each evaluation suite with a dataset of its own (warmed by the evaluation ranks), its split read."""
    return [DataSource(f"evaluate.suites[{i}].source_url", s.source_url, s.manifest, cfg.data.storage_options,
                       (s.split,)) for i, s in enumerate(cfg.evaluate.suites) if s.source_url is not None]


def refuse_cached(cfg: JobConfig, planned: list[tuple[DataSource, str]]) -> None:
    """Refuse a dataset (source, manifest hash) this machine's `data.cache_dir` holds complete that the model
    cannot read (a recorded token id not below `model.vocab_size`, an empty split), from the record alone."""
    layout = CacheLayout(Path(cfg.data.cache_dir).resolve())
    for source, manifest_hash in planned:
        dsid = layout.dataset_id(manifest_hash)
        record = complete_record(layout.state_path(dsid), layout.journal_path(dsid), manifest_hash)
        if record is not None:
            where = f"dataset {dsid} of {source.source_url} ({source.field}), cached at {layout.dataset_dir(dsid)}"
            record.refuse_unreadable(source.rules(cfg.model.vocab_size), where)
