"""Bad rows are counted per file; too many, or no documents at all, fail with exit 2 and leave no manifest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.data.prepare.conftest import texts, write_jsonl, write_parquet

BAD_JSONL = "\n".join([
    json.dumps({"text": "a good row"}),
    "{not json",
    json.dumps({"body": "no text field"}),
    json.dumps({"text": 5}),
    "",  # blank lines are not rows
    json.dumps(["not", "an", "object"]),
    json.dumps({"text": "another good row"}),
]) + "\n"


def _bad_corpus(tmp_path: Path) -> list[Path]:
    (tmp_path / "rows.jsonl").write_text(BAD_JSONL)
    (tmp_path / "notes.txt").write_bytes(b"first block\n\nsecond block\nbad \xff byte here\n\nthird\n")
    return [tmp_path / "rows.jsonl", tmp_path / "notes.txt",
            write_parquet(tmp_path / "t.parquet", ["x", "y", None, "z", b"\xffnot utf-8"])]


def test_bad_rows_are_reported_per_file(tmp_path: Path, bpe_dir: Path, prepare,
                                        caplog: pytest.LogCaptureFixture) -> None:
    run = prepare(*_bad_corpus(tmp_path), "--tokenizer", bpe_dir, "--dest", tmp_path / "ds",
                  "--max-bad-fraction", 0.7, "--heldout-fraction", 0)
    assert run.rc == 0, run.err
    assert run.summary["bad_rows"] == {
        str(tmp_path / "rows.jsonl"): {"bad": 4, "rows": 6, "first": "line 2: not valid JSON"},
        str(tmp_path / "notes.txt"): {"bad": 1, "rows": 3, "first": "line 4: invalid UTF-8"},
        str(tmp_path / "t.parquet"): {"bad": 2, "rows": 5, "first": "row 3: null value"},
    }
    assert run.summary["documents"] == {"train": 2 + 2 + 3, "heldout": 0}
    assert "rows.jsonl: 4 of 6 rows bad, skipped (first: line 2: not valid JSON)" in caplog.text
    assert (tmp_path / "ds/manifest.json").is_file()


def test_too_many_bad_rows_fail_naming_file_and_line_and_write_nothing(tmp_path: Path, bpe_dir: Path,
                                                                       prepare) -> None:
    good = write_jsonl(tmp_path / "good.jsonl", texts(400, seed=4))  # read first: shards get written
    run = prepare(good, *_bad_corpus(tmp_path), "--tokenizer", bpe_dir, "--dest", tmp_path / "ds",
                  "--tokens-per-shard", 1000, "--workers", 2)
    assert run.rc == 2
    assert f"retrainer: error: {tmp_path / 'rows.jsonl'}: line 2: not valid JSON (4 of 6 rows bad" in run.err
    assert not (tmp_path / "ds/manifest.json").exists()
    assert not [p for p in (tmp_path / "ds").rglob("*") if p.is_file()]  # shards written before the failure: gone
    # One bad row of a whole file is tolerated by default; in notes.txt it is 1 of 3.
    run = prepare(tmp_path / "notes.txt", "--tokenizer", bpe_dir, "--dest", tmp_path / "ds2")
    assert run.rc == 2 and "notes.txt: line 4: invalid UTF-8 (1 of 3 rows bad, 33.3% > --max-bad-fraction 1.0%)" \
        in run.err
    assert not (tmp_path / "ds2/manifest.json").exists()


def test_an_empty_corpus_fails(tmp_path: Path, bpe_dir: Path, prepare) -> None:
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "blank.txt").write_text("\n  \n\n")
    run = prepare(tmp_path / "empty.jsonl", tmp_path / "blank.txt", "--tokenizer", bpe_dir, "--dest", tmp_path / "ds")
    assert run.rc == 2 and "empty.jsonl" in run.err and "no documents (empty corpus)" in run.err
    assert not (tmp_path / "ds/manifest.json").exists()
    assert prepare(tmp_path / "*.parquet", "--tokenizer", bpe_dir, "--dest", tmp_path / "ds").rc == 2


def test_input_errors_name_the_culprit(tmp_path: Path, bpe_dir: Path, prepare) -> None:
    docs = write_jsonl(tmp_path / "a.jsonl", ["hello"])
    no_eos = tmp_path / "plain"
    no_eos.mkdir()
    (no_eos / "tokenizer.json").write_bytes((bpe_dir / "tokenizer.json").read_bytes())
    cases = {
        "no EOS token: pass --eos-token": [docs, "--tokenizer", no_eos],
        "EOS token '<nope>' is not in the tokenizer's vocabulary": [docs, "--tokenizer", bpe_dir,
                                                                    "--eos-token", "<nope>"],
        "b.parquet: no column 'text' (columns: id, body): pass --column": [
            _parquet(tmp_path / "b.parquet"), "--tokenizer", bpe_dir],
        "c.csv: cannot tell the format from the name": [_touch(tmp_path / "c.csv"), "--tokenizer", bpe_dir],
        "missing.jsonl: no such file or directory": [tmp_path / "missing.jsonl", "--tokenizer", bpe_dir],
        "--heldout-fraction must be in [0, 1)": [docs, "--tokenizer", bpe_dir, "--heldout-fraction", 1],
    }
    for message, args in cases.items():
        run = prepare(*args, "--dest", tmp_path / "ds")
        assert run.rc == 2 and message in run.err, (message, run.err)
        assert not (tmp_path / "ds").exists()
    assert prepare(docs, "--tokenizer", bpe_dir, "--dest", tmp_path / "ds").rc == 0
    again = prepare(docs, "--tokenizer", bpe_dir, "--dest", tmp_path / "ds")
    assert again.rc == 2 and "already holds a dataset (manifest.json, train): pass --overwrite" in again.err
    assert prepare(docs, "--tokenizer", bpe_dir, "--dest", tmp_path / "ds", "--overwrite").rc == 0


def _parquet(path: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": [1], "body": ["x"]}), path)
    return path


def _touch(path: Path) -> Path:
    path.write_text("x")
    return path
