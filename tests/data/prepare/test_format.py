"""The token dtype table: uint16 while the vocabulary fits, uint32 beyond; manifests and readers agree."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tasks.base.dataset_format import MAX_VOCAB, dtype_for_vocab
from tasks.base.errors import InvalidInputError
from tasks.data.manifest import Manifest
from tasks.train.data import TokenWindows

FILE = {"key": "train/shard-00000.bin", "size": 4, "sha256": "a" * 64}


def _manifest(**fields: object) -> bytes:
    return json.dumps({"format": "retrainer-dataset/1", "name": "n", "files": [FILE], **fields}).encode()


def test_dtype_is_the_narrowest_that_holds_every_id() -> None:
    assert [dtype_for_vocab(v) for v in (256, 65536, 65537, 128256, 2**32)] == \
        ["uint16", "uint16", "uint32", "uint32", "uint32"]
    assert MAX_VOCAB == 2**32
    with pytest.raises(ValueError, match="exceeds"):
        dtype_for_vocab(2**32 + 1)


def test_manifest_accepts_uint32_and_refuses_a_vocab_its_dtype_cannot_hold() -> None:
    assert Manifest.parse(_manifest(dtype="uint32", vocab_size=128256), "m.json").dtype == "uint32"
    with pytest.raises(InvalidInputError, match=r"(?s)m\.json: .*vocab_size: .*70000 token ids do not fit uint16"):
        Manifest.parse(_manifest(dtype="uint16", vocab_size=70000), "m.json")
    with pytest.raises(InvalidInputError, match=r"(?s)dtype: .*must be one of \['uint16', 'uint32'\]"):
        Manifest.parse(_manifest(dtype="int64"), "m.json")
    # make-data's manifests stay byte-identical: the default dtype is still uint16.
    assert json.loads(Manifest(name="n", files=[]).to_bytes())["dtype"] == "uint16"


def test_token_windows_read_uint32_shards_and_refuse_torn_ones(tmp_path: Path) -> None:
    tokens = np.arange(70000, 70000 + 40, dtype="<u4")
    (tmp_path / "train").mkdir()
    (tmp_path / "train/shard-00000.bin").write_bytes(tokens.tobytes())
    entry = {**FILE, "size": tokens.nbytes}
    (tmp_path / "manifest.json").write_bytes(_manifest(dtype="uint32", vocab_size=70040, files=[entry]))
    windows = TokenWindows(tmp_path, "train", 9, 70040)
    assert windows.get([0, 1]).tolist() == [tokens[:10].tolist(), tokens[9:19].tolist()]
    (tmp_path / "train/shard-00000.bin").write_bytes(tokens.tobytes()[:-2])
    (tmp_path / "manifest.json").write_bytes(
        _manifest(dtype="uint32", vocab_size=70040, files=[{**entry, "size": tokens.nbytes - 2}]))
    with pytest.raises(InvalidInputError, match="not a whole number of uint32 tokens"):
        TokenWindows(tmp_path, "train", 9, 70040)
    (tmp_path / "manifest.json").write_bytes(_manifest(dtype="float32", files=[entry]))
    refused = r"(?s)manifest\.json: invalid manifest:.*dtype: .*must be one of \['uint16', 'uint32'\], got 'float32'"
    with pytest.raises(InvalidInputError, match=refused):
        TokenWindows(tmp_path, "train", 9, 70040)
