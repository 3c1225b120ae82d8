"""The bounds every config field is checked against, and the strict base model every section derives from."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# Upper bounds of the numeric fields, far above any real job: a typo or a 2^64 is refused by name at load, before
# a rank starts, and the products the planner and the ranks form stay inside int64.
# Model sizes: 2^20 is 40x the widest model today (d_model 25600, d_ff 73728) and 8000x the deepest (126 layers);
# vocabularies: what a dataset's widest token dtype holds (tasks/base/dataset_format.py).
MAX_WIDTH = 2**20
# Positions: 2^24 tokens (16.7M), above the longest context today (10M).
MAX_POSITIONS = 2**24
# Ranks, GPUs and nodes: a million (2^20) is beyond any cluster built.
MAX_RANKS = 2**20
# Steps: 10^9 is three years at 0.1 s a step; it bounds the warmup, the checkpoint interval and the checkpoints kept.
MAX_STEPS = 10**9
# Sequences in a batch, and the global batch (micro_batch_size x micro_batches x dp): 2^24, so the samples a run
# draws (global batch x steps < 2^54) stay int64 indices (tasks/train/data.py Sampler).
MAX_BATCH = 2**24
# Evaluation: batches x batch_size <= 2^28 windows, whose indices tasks/evaluate/spec.py holds at once.
MAX_EVAL_BATCHES, MAX_EVAL_BATCH_SIZE = 2**16, 2**12
# Seeds: numpy's legacy seeding takes < 2^32, and torch's generators take seed x 100_003 + layer
# (tasks/models/common/init.py) in 64 bits; numpy's SeedSequence refuses a negative seed.
MAX_SEED = 2**32 - 1
# Registry versions: the registry's version columns are 32-bit INTEGERs (sql/versions/0001_registry.py).
MAX_VERSION = 2**31 - 1
# Byte counts: 64-bit, as the OS reports sizes (off_t).
MAX_BYTES = 2**63 - 1
# Waits: a timeout longer than a year is a typo, and an unbounded one (inf, 1e300) overflows threading's waits.
MAX_WAIT_S = 365 * 24 * 3600
