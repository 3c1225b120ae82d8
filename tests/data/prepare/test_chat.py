"""prepare-data --chat: conversations rendered with the model's template, the loss mask covering exactly the
assistant spans (templates with and without generation markers), overlong and assistant-less rows counted, the
manifest naming the template and mask rule; a plain-text manifest's bytes (and hash) unchanged."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tasks.base.dataset_format import MASK_DTYPE, STARTS_DTYPE, TOKEN_DTYPES, mask_key, starts_key
from tasks.data.manifest import Manifest, ManifestFile
from tests.chat import LLAMA3, QWEN, SPAN_END, chat_tokenizer, conversations, write_chat_jsonl


def read_chat(dataset: Path, split: str = "train") -> list[tuple[list[int], list[int]]]:
    """Every conversation of a split: (tokens, mask), shard after shard."""
    manifest = json.loads((dataset / "manifest.json").read_text())
    dtype = TOKEN_DTYPES[manifest["dtype"]]
    keys = sorted(f["key"] for f in manifest["files"] if f["key"].startswith(f"{split}/"))
    out = []
    for key in keys:
        tokens = np.fromfile(dataset / key, dtype=dtype)
        mask = np.fromfile(dataset / mask_key(key), dtype=MASK_DTYPE)
        starts = np.fromfile(dataset / starts_key(key), dtype=STARTS_DTYPE).tolist()
        assert len(mask) == len(tokens) and starts[0] == 0
        for a, b in zip(starts, [*starts[1:], len(tokens)], strict=True):
            out.append((tokens[a:b].tolist(), mask[a:b].tolist()))
    return out


def runs(tokens: list[int], mask: list[int]) -> list[list[int]]:
    """The masked tokens, one list per contiguous run."""
    out: list[list[int]] = []
    for i, (t, m) in enumerate(zip(tokens, mask, strict=True)):
        if m:
            if not i or not mask[i - 1]:
                out.append([])
            out[-1].append(t)
    return out


def hf_tokenizer(directory: Path) -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"),
                                   bos_token="<|begin_of_text|>", eos_token="<|endoftext|>")


@pytest.mark.parametrize(("name", "template", "rule"), [("llama3", LLAMA3, "generation"), ("qwen", QWEN, "prefix")])
def test_the_mask_covers_exactly_the_assistant_spans(tmp_path: Path, prepare, name: str, template: str,
                                                     rule: str) -> None:
    tok_dir = chat_tokenizer(tmp_path / "tok", template, jinja_file=name == "qwen")
    chats = conversations(40, seed=1)
    data = write_chat_jsonl(tmp_path / "chats.jsonl", chats)
    run = prepare(data, "--tokenizer", tok_dir, "--dest", tmp_path / "ds", "--chat", "--seq-len", 4096,
                  "--overlong", "drop", "--heldout-fraction", 0, "--workers", 1, "--tokens-per-shard", 300)
    assert run.rc == 0, run.err
    chat = run.summary["chat"]
    assert chat["mask_rule"] == rule and chat["no_assistant"] == chat["truncated"] == chat["dropped"] == 0
    got = read_chat(tmp_path / "ds")
    assert len(got) == len(chats) and run.summary["shards"]["train"] > 1
    hf = hf_tokenizer(tok_dir)
    for messages, (tokens, mask) in zip(chats, got, strict=True):
        # The tokens are transformers' rendering of the conversation with this template, tokenized.
        expected = hf.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=rule == "generation")
        assert tokens == list(expected["input_ids"])
        if rule == "generation":
            assert mask == list(expected["assistant_masks"])  # transformers' own mask
        # Each masked run decodes to one assistant message and its end-of-turn, in order; nothing else is masked.
        answers = [m["content"] + SPAN_END[name] for m in messages if m["role"] == "assistant"]
        assert [hf.decode(r) for r in runs(tokens, mask)] == answers
        assert sum(mask) == sum(len(hf.encode(a, add_special_tokens=False)) for a in answers)


def test_overlong_rows_are_cut_or_dropped_and_counted_and_rows_without_an_answer_skipped(tmp_path: Path,
                                                                                          prepare) -> None:
    tok_dir = chat_tokenizer(tmp_path / "tok", QWEN)
    hf = hf_tokenizer(tok_dir)
    chats = conversations(30, seed=2, most=30)
    lengths = [len(hf.apply_chat_template(c, chat_template=QWEN, tokenize=True, return_dict=True)["input_ids"])
               for c in chats]
    seq_len = sorted(lengths)[len(lengths) // 2]
    long = [n > seq_len for n in lengths]
    rows: list[Any] = [*chats, [{"role": "user", "content": "no answer"}], [{"role": "nobody", "content": "x"}]]
    data = write_chat_jsonl(tmp_path / "chats.jsonl", rows)
    common = ["--tokenizer", tok_dir, "--chat", "--seq-len", seq_len, "--heldout-fraction", 0, "--workers", 1,
              "--max-bad-fraction", 0.5]
    drop = prepare(data, "--dest", tmp_path / "drop", "--overlong", "drop", *common)
    cut = prepare(data, "--dest", tmp_path / "cut", "--overlong", "truncate", *common)
    assert drop.rc == cut.rc == 0, drop.err + cut.err
    assert drop.summary["chat"]["dropped"] == sum(long) and drop.summary["chat"]["truncated"] == 0
    assert [len(t) for t, _ in read_chat(tmp_path / "drop")] == [n for n, x in zip(lengths, long, strict=True) if not x]
    kept = read_chat(tmp_path / "cut")
    cut_chat = cut.summary["chat"]
    assert cut_chat["truncated"] == sum(long) and cut_chat["dropped"] == 0
    assert len(kept) + cut_chat["no_assistant"] - 1 == len(chats)  # a cut that leaves no answer is skipped too
    assert all(len(t) <= seq_len for t, _ in kept) and all(any(m) for _, m in kept)
    for summary in (drop.summary, cut.summary):
        assert summary["chat"]["no_assistant"] >= 1
        assert summary["bad_rows"][str(data)]["bad"] == 1  # the unknown role
    manifest = json.loads((tmp_path / "cut/manifest.json").read_text())["chat"]
    assert manifest["seq_len"] == seq_len and manifest["overlong"] == "truncate"
    assert drop.summary["manifest_hash"] != cut.summary["manifest_hash"]


def test_the_template_and_its_rule_are_part_of_the_dataset_identity(tmp_path: Path, prepare) -> None:
    data = write_chat_jsonl(tmp_path / "chats.jsonl", conversations(10, seed=3))
    hashes = []
    for i, template in enumerate((QWEN, QWEN.replace("<|im_end|>\n", "<|im_end|>\n\n"))):
        tok_dir = chat_tokenizer(tmp_path / f"tok{i}", template)
        run = prepare(data, "--tokenizer", tok_dir, "--dest", tmp_path / f"ds{i}", "--chat", "--seq-len", 512,
                      "--overlong", "drop", "--workers", 1)
        assert run.rc == 0, run.err
        hashes.append(run.summary["manifest_hash"])
        assert json.loads((tmp_path / f"ds{i}/manifest.json").read_text())["chat"]["template_sha256"] == \
            run.summary["chat"]["template_sha256"]
    assert hashes[0] != hashes[1]


def test_chat_options_are_explicit(tmp_path: Path, prepare) -> None:
    tok_dir = chat_tokenizer(tmp_path / "tok", QWEN)
    data = write_chat_jsonl(tmp_path / "chats.jsonl", conversations(3, seed=4))
    run = prepare(data, "--tokenizer", tok_dir, "--dest", tmp_path / "ds", "--chat", "--seq-len", 64)
    assert run.rc == 2 and "--overlong" in run.err
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    (bare / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    run = prepare(data, "--tokenizer", bare, "--dest", tmp_path / "ds", "--chat", "--seq-len", 64,
                  "--overlong", "drop")
    assert run.rc == 2 and "no chat template" in run.err


def test_a_plain_text_manifest_is_unchanged_by_chat_support() -> None:
    """Pinned: the bytes of a plain-text manifest (no `chat` key), hence every existing dataset's hash and every
    run's experiment key."""
    manifest = Manifest(name="corpus", dtype="uint16", vocab_size=600,
                        files=[ManifestFile(key="train/shard-00000.bin", size=1000, sha256="a" * 64),
                               ManifestFile(key="heldout/shard-00000.bin", size=10, sha256="b" * 64)])
    assert b"chat" not in manifest.to_bytes()
    assert manifest.hash == "49195982b0b981069a789999ca7ce666b4974265b5084f254f597f8a8281103f"


def test_parquet_conversations_and_any_worker_count_give_the_same_dataset(tmp_path: Path, prepare) -> None:
    """Messages as a list<struct> column, or as JSON strings, read as the same conversations as JSONL; the bytes
    do not depend on --workers."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tok_dir = chat_tokenizer(tmp_path / "tok", LLAMA3)
    chats = conversations(60, seed=6)
    jsonl = write_chat_jsonl(tmp_path / "chats.jsonl", chats)
    pq.write_table(pa.table({"messages": chats}), tmp_path / "structs.parquet", row_group_size=16)
    pq.write_table(pa.table({"messages": [json.dumps(c) for c in chats]}), tmp_path / "strings.parquet")
    common = ["--tokenizer", tok_dir, "--chat", "--seq-len", 4096, "--overlong", "drop", "--heldout-fraction",
              0.2, "--tokens-per-shard", 500, "--name", "chats"]
    runs_ = {name: prepare(source, "--dest", tmp_path / name, "--workers", workers, *common)
             for name, source, workers in [("jsonl", jsonl, 1), ("jsonl2", jsonl, 2),
                                           ("structs", tmp_path / "structs.parquet", 1),
                                           ("strings", tmp_path / "strings.parquet", 2)]}
    assert all(r.rc == 0 for r in runs_.values()), [r.err for r in runs_.values()]
    assert len({r.summary["manifest_hash"] for r in runs_.values()}) == 1  # every object, byte for byte
    assert 0 < runs_["jsonl"].summary["documents"]["heldout"] < len(chats)
