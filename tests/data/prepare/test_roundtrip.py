"""JSONL + Parquet + text through a real BPE: exact round trip, hash-stable split, same bytes for any --workers."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer

from tests.data.prepare.conftest import documents, split_tokens, texts, tree, write_jsonl, write_parquet, write_text


def test_round_trip_split_and_bytes_do_not_depend_on_workers(tmp_path: Path, bpe_dir: Path, prepare) -> None:
    jsonl, parquet, text = texts(150, seed=1), texts(120, seed=2), [t.replace("; ", ";\n") for t in texts(60, seed=3)]
    files = [write_jsonl(tmp_path / "a.jsonl", jsonl), write_parquet(tmp_path / "b.parquet", parquet),
             write_text(tmp_path / "c.txt", text)]
    corpus = jsonl + parquet + text
    common = ["--tokenizer", bpe_dir, "--heldout-fraction", 0.3, "--tokens-per-shard", 700, "--name", "corpus"]
    one = prepare(*files, "--dest", tmp_path / "w1", "--workers", 1, *common)
    two = prepare(*files, "--dest", tmp_path / "w2", "--workers", 2, *common)
    assert one.rc == two.rc == 0, one.err + two.err
    assert tree(tmp_path / "w1") == tree(tmp_path / "w2")  # every shard and the manifest, byte for byte
    summary = one.summary
    assert summary["manifest_hash"] == two.summary["manifest_hash"]
    assert summary["dtype"] == "uint16" and summary["files"] == 3 and summary["bad_rows"] == {}
    assert summary["shards"]["train"] > 3  # documents run across shard boundaries

    tok = Tokenizer.from_file(str(bpe_dir / "tokenizer.json"))
    eos = summary["eos_id"]
    assert eos == tok.token_to_id("<|endoftext|>")
    decoded = {split: [tok.decode(ids, skip_special_tokens=False)
                       for ids in documents(split_tokens(tmp_path / "w1", split), eos)]
               for split in ("train", "heldout")}
    held = set(decoded["heldout"])
    assert not held & set(decoded["train"])
    assert decoded["train"] == [t for t in corpus if t not in held]  # input order, nothing lost or altered
    assert decoded["heldout"] == [t for t in corpus if t in held]
    assert 0.15 < len(decoded["heldout"]) / len(corpus) < 0.45
    assert summary["documents"] == {"train": len(decoded["train"]), "heldout": len(decoded["heldout"])}
    total = {s: sum(f["size"] for f in json.loads((tmp_path / "w1/manifest.json").read_text())["files"]
                    if f["key"].startswith(s)) // 2 for s in ("train", "heldout")}
    assert summary["tokens"] == total

    # The split is a function of the document alone: other files, other order, other chunks -> same side.
    shuffled = [write_jsonl(tmp_path / "z.jsonl", corpus[::-1])]
    three = prepare(*shuffled, "--dest", tmp_path / "w3", "--workers", 2, *common)
    assert three.rc == 0, three.err
    held3 = {tok.decode(ids) for ids in documents(split_tokens(tmp_path / "w3", "heldout"), eos)}
    assert held3 == held
