"""Real tokenizers trained in-process, small corpora in every input format, and the CLI run in-process."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tasks import cli
from tasks.base.dataset_format import TOKEN_DTYPES

EOS = "<|endoftext|>"
WORDS = ["the", "model", "learns", "a", "quiet", "song", "near", "the", "harbour", "while", "every", "apples;",
         "naïve", "café", "déjà", "vu,", "Zürich", "東京", "🙂", "—", "tabs\tand", "'quotes'", '"double"', "{braces}",
         "[1,", "2]", "back\\slash"]


def texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40))) for _ in range(n)]


def save_tokenizer(tok: Any, directory: Path, eos: str | None = EOS) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    if eos is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": eos}}))
    return directory


@pytest.fixture(scope="session")
def bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE (exact round trip for any text) trained on a few KB."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts(200, seed=0), trainer)
    return save_tokenizer(tok, tmp_path_factory.mktemp("bpe"))


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def write_parquet(path: Path, docs: list[str | bytes | None], row_group_size: int = 40) -> Path:
    """A string column; bytes values go in unvalidated, as a non-validating writer would store them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    raw = [d.encode() if isinstance(d, str) else d for d in docs]
    column = pa.array(raw, pa.binary()).view(pa.string())
    pq.write_table(pa.table({"id": list(range(len(docs))), "text": column}), path, row_group_size=row_group_size)
    return path


def write_text(path: Path, docs: list[str]) -> Path:
    """Blank-line-separated blocks (docs must not contain blank lines)."""
    path.write_text("\n\n".join(docs) + "\n")
    return path


@dataclass
class Run:
    rc: int
    out: str
    err: str

    @property
    def summary(self) -> dict[str, Any]:
        return json.loads(self.out)


@pytest.fixture
def prepare(capsys: pytest.CaptureFixture[str]) -> Callable[..., Run]:
    """`retrainer prepare-data ARGS...` in this process (its workers are real spawned processes)."""

    def run(*args: object) -> Run:
        capsys.readouterr()
        rc = cli.main(["prepare-data", *map(str, args)])
        out, err = capsys.readouterr()
        return Run(rc, out, err)

    return run


def split_tokens(dataset: Path, split: str) -> np.ndarray:
    """One split's tokens, shards concatenated in key order, read with the manifest's dtype."""
    manifest = json.loads((dataset / "manifest.json").read_text())
    dtype = TOKEN_DTYPES[manifest["dtype"]]
    keys = sorted(f["key"] for f in manifest["files"] if f["key"].startswith(f"{split}/"))
    return np.concatenate([np.fromfile(dataset / k, dtype=dtype) for k in keys] or [np.zeros(0, dtype)])


def documents(ids: np.ndarray, eos_id: int) -> list[list[int]]:
    """Split a token stream on EOS; every document must end with one."""
    assert ids.size == 0 or ids[-1] == eos_id
    cuts = np.flatnonzero(ids == eos_id)
    return [part[:-1].tolist() for part in np.split(ids, cuts + 1)[:-1]]


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
