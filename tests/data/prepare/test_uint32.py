"""A 70,000-token vocabulary: uint32 shards, and ids above 65,535 survive to the trainer's TokenWindows."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, models, pre_tokenizers

from tasks.train.data import TokenWindows
from tests.data.prepare.conftest import save_tokenizer, split_tokens, write_jsonl, write_parquet

VOCAB = 70_000


def test_a_vocab_beyond_uint16_gets_uint32_shards_read_by_token_windows(tmp_path: Path, prepare) -> None:
    vocab = {f"w{i}": i for i in range(VOCAB - 1)} | {"<eos>": VOCAB - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok_dir = save_tokenizer(tok, tmp_path / "tok", eos=None)  # EOS from the flag instead
    rng = random.Random(5)
    docs = [" ".join(f"w{rng.choice([rng.randrange(VOCAB - 1), rng.randrange(65_000, VOCAB - 1)])}"
                     for _ in range(rng.randint(5, 30))) for _ in range(300)]
    files = [write_jsonl(tmp_path / "a.jsonl", docs[:150]), write_parquet(tmp_path / "b.parquet", docs[150:])]

    run = prepare(*files, "--tokenizer", tok_dir / "tokenizer.json", "--eos-token", "<eos>", "--dest",
                  tmp_path / "ds", "--heldout-fraction", 0, "--tokens-per-shard", 1000, "--workers", 2)
    assert run.rc == 0, run.err
    manifest = json.loads((tmp_path / "ds/manifest.json").read_text())
    assert (manifest["dtype"], manifest["vocab_size"], run.summary["eos_id"]) == ("uint32", VOCAB, VOCAB - 1)
    assert manifest["files"][0]["size"] == 4000  # 1000 tokens x 4 bytes

    expected = np.array([vocab[w] for d in docs for w in [*d.split(), "<eos>"]], dtype=np.int64)
    assert expected.max() > 65_535 and (expected > 65_535).sum() > 1000
    assert np.array_equal(split_tokens(tmp_path / "ds", "train"), expected)
    windows = TokenWindows(tmp_path / "ds", "train", seq_len=99, vocab_size=VOCAB)
    got = windows.get(range(10)).numpy()  # the first shard's windows: 10 x 100 tokens, in order
    assert got.dtype == np.int64 and np.array_equal(got[:, :-1].ravel(), expected[: 10 * 99])
    assert got.max() > 65_535
