"""tasks.base.safetensors_stream: a streamed file is the very bytes `save_file` writes, and loads as such."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tasks.base.errors import InvalidInputError
from tasks.base.safetensors_stream import TensorEntry, write


def _tensors(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {"lm_head.weight": (7, 5), "model.embed_tokens.weight": (7, 5), "model.norm.weight": (5,),
              "model.layers.0.mlp.up_proj.weight": (3, 5), "scalar": ()}
    return {name: torch.randn(shape, generator=g).to(dtype) for name, shape in sorted(shapes.items())}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_streamed_file_equals_save_file_and_loads(tmp_path: Path, dtype: torch.dtype) -> None:
    tensors = _tensors(dtype)
    save_file(tensors, str(tmp_path / "theirs.safetensors"), metadata={"format": "pt"})
    entries = [TensorEntry(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]
    held = _tensors(torch.float32)  # as a rank holds them: converted to the file's dtype while written
    with open(tmp_path / "ours.safetensors", "wb") as fh:
        write(fh, entries, iter(held.items()), {"format": "pt"})

    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "theirs.safetensors").read_bytes()
    with safe_open(str(tmp_path / "ours.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
        for name, t in tensors.items():
            assert torch.equal(f.get_tensor(name), t)


def test_a_tensor_other_than_the_header_says_is_refused_naming_it() -> None:
    t = torch.zeros(2, 3)
    entries = [TensorEntry("a", torch.float32, (2, 3)), TensorEntry("b", torch.float32, (3,))]
    with pytest.raises(InvalidInputError, match=r"tensor 1 is \('b', \(2, 3\)\), the header says \('b', \(3,\)\)"):
        write(io.BytesIO(), entries, iter([("a", t), ("b", t)]))
    with pytest.raises(InvalidInputError, match="1 tensors written, the header lists 2"):
        write(io.BytesIO(), entries, iter([("a", t)]))
    with pytest.raises(InvalidInputError, match="listed twice"):
        write(io.BytesIO(), [entries[0], entries[0]], iter([]))
