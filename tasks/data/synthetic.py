"""Synthetic datasets: `make-data` (a seeded English-like corpus, or given text files, byte-tokenized into shards
plus a manifest) and the demo producer's snapshots (dags/publish_dataset.py). Test and demo data only: real
datasets come from `prepare-data` or a producer's own ETL plus `retrainer manifest`."""

from __future__ import annotations

import hashlib
import logging
import random
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tasks.base.dataset_format import MANIFEST_KEY, TOKEN_DTYPES, shard_key
from tasks.base.errors import InvalidInputError
from tasks.base.fsutil import put_object
from tasks.config.schema import JobConfig
from tasks.data.manifest import Manifest, ManifestFile, object_path, prefix_fs

log = logging.getLogger(__name__)

_SUBJECTS = ["the model", "a small robot", "the old sailor", "my neighbour", "the river", "a curious cat",
             "the teacher", "every student", "the baker", "a quiet engineer", "the city", "our team"]
_VERBS = ["builds", "finds", "remembers", "carries", "watches", "paints", "learns", "counts", "follows",
          "answers", "opens", "repairs"]
_OBJECTS = ["a red boat", "the morning light", "three green apples", "the long road", "a broken clock",
            "the secret map", "warm bread", "the tall tower", "a new song", "the heavy door", "small stones"]
_PLACES = ["near the harbour", "in the garden", "after the rain", "before dawn", "under the bridge",
           "at the market", "on the hill", "inside the library"]
_LINKS = ["and then", "because", "while", "so", "but"]


def _sentence(rng: random.Random) -> str:
    s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
    if rng.random() < 0.6:
        s += f" {rng.choice(_PLACES)}"
    if rng.random() < 0.35:
        s += f", {rng.choice(_LINKS)} {rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
    return s[0].upper() + s[1:] + rng.choice([".", ".", ".", "!", "?"])


def synthetic_text(n_bytes: int, rng: random.Random) -> bytes:
    """English-like sentences from a seeded word grammar: learnable structure for a tiny byte-level GPT."""
    parts: list[str] = []
    size = 0
    while size < n_bytes:
        para = " ".join(_sentence(rng) for _ in range(rng.randint(2, 6))) + "\n"
        parts.append(para)
        size += len(para)
    return "".join(parts).encode("ascii")[:n_bytes]


_ASKS = ["Tell me about {s}.", "What does {s} do?", "Do you know anything about {s}?", "Any news of {s}?"]
_SYSTEMS = ["You are a helpful assistant.", "Answer in one sentence.", "Be brief."]
CHAT_EVAL_TASK = "tiny_chat_facts"  # the chat demo's generation check (`write_chat_eval`)


def chat_facts() -> dict[str, str]:
    """The chat demo's facts: one sentence per subject, the same every week (its own seed)."""
    rng = random.Random(0)
    return {s: f"{s[0].upper()}{s[1:]} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}." for s in _SUBJECTS}


def synthetic_conversations(n: int, seed: int) -> list[list[dict[str, str]]]:
    """`n` seeded conversations for the chat demo: sometimes a system line, one or two exchanges in which the user
    asks about a subject and the assistant states its fact (`chat_facts`)."""
    facts, rng = chat_facts(), random.Random(seed)
    out = []
    for _ in range(n):
        messages = [{"role": "system", "content": rng.choice(_SYSTEMS)}] if rng.random() < 0.3 else []
        for _ in range(rng.randint(1, 2)):
            subject = rng.choice(_SUBJECTS)
            messages += [{"role": "user", "content": rng.choice(_ASKS).format(s=subject)},
                         {"role": "assistant", "content": facts[subject]}]
        out.append(messages)
    return out


def write_chat_eval(folder: Path) -> Path:
    """The chat demo's generation check as an lm-evaluation-harness task folder: one question per subject,
    rendered with the model's chat template, the reply generated greedily and compared with the fact."""
    import json

    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"question": _ASKS[1].format(s=s), "answer": fact} for s, fact in chat_facts().items()]
    (folder / "facts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "facts.yaml").write_text(
        f"task: {CHAT_EVAL_TASK}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: facts.jsonl\n"
        "test_split: test\noutput_type: generate_until\ndoc_to_text: \"{{question}}\"\n"
        "doc_to_target: \"{{answer}}\"\ngeneration_kwargs:\n  until: [\"<|eot_id|>\"]\n  max_gen_toks: 24\n"
        "  do_sample: false\nmetric_list:\n  - metric: exact_match\n    aggregation: mean\n"
        "    higher_is_better: true\n    ignore_case: true\n    ignore_punctuation: true\n")
    return folder


def _tokens(data: bytes) -> bytes:
    import numpy as np

    return np.frombuffer(data, dtype=np.uint8).astype(TOKEN_DTYPES["uint16"]).tobytes()


def make_data(
    dest_url: str,
    *,
    name: str,
    n_train_shards: int = 4,
    n_heldout_shards: int = 1,
    tokens_per_shard: int = 65536,
    seed: int = 1234,
    text_files: list[str] | None = None,
    storage_options: dict[str, Any] | None = None,
) -> Manifest:
    """Write token shards and `manifest.json` under `dest_url`; the same seed gives the same bytes.

    With `text_files`, their bytes (concatenated, byte-level tokens) are cut into the
    shards (held-out shards from the end); otherwise a seeded synthetic corpus is used.
    The manifest is written last, so a reader never sees a manifest naming a missing shard.
    """
    if n_train_shards < 1 or n_heldout_shards < 0 or tokens_per_shard < 1:
        raise InvalidInputError("make-data: need >= 1 train shard, >= 0 heldout shards, >= 1 token per shard")
    n_total = n_train_shards + n_heldout_shards
    if text_files:
        corpus = b""
        for tf in text_files:
            try:
                corpus += Path(tf).read_bytes()
            except OSError as exc:
                raise InvalidInputError(f"{tf}: cannot read text file: {exc.strerror}") from None
        if not corpus:
            raise InvalidInputError(f"{', '.join(text_files)}: text files are empty")
        tokens_per_shard = min(tokens_per_shard, len(corpus) // n_total)
        if tokens_per_shard < 1:
            raise InvalidInputError(f"{', '.join(text_files)}: too little text for {n_total} shards")
        chunks = [corpus[i * tokens_per_shard:(i + 1) * tokens_per_shard] for i in range(n_total)]
    else:
        chunks = [synthetic_text(tokens_per_shard, random.Random(f"{seed}:{i}")) for i in range(n_total)]

    fs, root = prefix_fs(dest_url, storage_options)
    files: list[ManifestFile] = []
    for i, chunk in enumerate(chunks):
        split, idx = ("train", i) if i < n_train_shards else ("heldout", i - n_train_shards)
        key = shard_key(split, idx)
        blob = _tokens(chunk)
        put_object(fs, object_path(root, key), blob)
        files.append(ManifestFile(key=key, size=len(blob), sha256=hashlib.sha256(blob).hexdigest()))
    manifest = Manifest(name=name, vocab_size=256, files=files)
    put_object(fs, object_path(root, MANIFEST_KEY), manifest.to_bytes())
    log.info("make-data: %d shards (%d tokens each) + manifest %s under %s",
             len(files), tokens_per_shard, manifest.hash[:16], dest_url)
    return manifest


def write_snapshot(cfg: JobConfig, *, seed: int, dest_url: str | None) -> dict[str, Any]:
    """The demo producer: a synthetic dataset snapshot under a new prefix; returns the event's extra."""
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ")
    url = dest_url or f"{cfg.data.source_url.rstrip('/')}-snapshots/{stamp}"
    manifest = make_data(url, name=cfg.name, seed=seed, storage_options=cfg.data.storage_options)
    log.info("publish_dataset: snapshot %s (manifest %s, %d files)", url, manifest.hash[:12], len(manifest.files))
    return {"source_url": url, "manifest_hash": manifest.hash}
