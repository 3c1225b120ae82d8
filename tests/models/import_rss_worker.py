"""One rank's import, alone in its process: build its stage's layers (tp slice), then load them from a
Hugging Face directory, and report the peak RSS the load added (`/proc/self/clear_refs` resets the peak
after the layers exist). Run by tests/models/test_hf_import_export.py."""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path


def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--stage", type=int, required=True)
    parser.add_argument("--stages", type=int, required=True)
    parser.add_argument("--tp-rank", type=int, required=True)
    parser.add_argument("--tp", type=int, required=True)
    args = parser.parse_args()

    import torch

    from tasks.base.layout import Coord, Layout
    from tasks.config.model import ModelConfig
    from tasks.models import get_family
    from tasks.models.parallel import TPGroup
    from tasks.models.pretrained import sizes_from_pretrained
    from tasks.models.shapes import pipeline_stages
    from tasks.models.weights import load_into

    m = ModelConfig.model_validate(sizes_from_pretrained(ModelConfig(pretrained=args.model_dir), "test"))
    family, tp = get_family(m.family), TPGroup(None, Layout(tp=args.tp), Coord(tp=args.tp_rank))
    st = pipeline_stages(m.n_layers, args.stages)[args.stage]
    first = sum(s.blocks for s in pipeline_stages(m.n_layers, args.stages)[: args.stage])
    layers: list[torch.nn.Module] = []
    if st.has_embedding:
        layers.append(family.Embedding(m, 0, tp))
    layers += [family.TransformerBlock(m, i, 0, tp) for i in range(first, first + st.blocks)]
    if st.has_head:
        layers.append(family.Head(m, 0, tp))
    stage = torch.nn.ModuleList(layers)
    held = [p.numel() * p.element_size() for p in stage.parameters()]
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak: only the load counts from here
    before = _kib("VmRSS")
    loaded = load_into(stage, args.model_dir, m, tp)
    peak = _kib("VmHWM")
    print(json.dumps({"loaded": loaded, "held_bytes": sum(held), "largest_bytes": max(held),
                      "peak_added_bytes": (peak - before) * 1024}))


if __name__ == "__main__":
    main()
