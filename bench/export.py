"""Export and import benchmark: our Hugging Face export and import against `dd` and transformers, side by side.

Run: `.venv/bin/python bench/export.py [--layers N]`.

A random Llama of a few hundred MB (fp32) is built in code and saved with `save_pretrained`; its
weights are laid out as a training checkpoint's layer files (tp=1, as DeepSpeed writes them).
- Export: `export_checkpoint` (2 stages, one process each, fp32, fsynced) writes the Hugging Face
  directory; `dd bs=8M conv=fsync` copies the same number of bytes (the exported shards) on the same
  disk. Ratio = our MB/s / dd's MB/s (goal >= 0.8).
- Import: `load_reference` (our loader: safetensors, tensor by tensor) vs
  `AutoModelForCausalLM.from_pretrained` of the same directory, both into fp32 on CPU, page cache warm,
  each followed by a sum over every weight (transformers 5 maps the files lazily; this reads them all).
  Ratio = theirs / ours (> 1: we are faster).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    import shutil

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from tasks.config import ModelConfig
    from tasks.models.export import export_checkpoint
    from tasks.models.pretrained import sizes_from_pretrained
    from tasks.models.weights import load_reference
    from tests.checkpoints import write_layer_files

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="bench-export-", dir=os.environ.get("BENCH_DIR")) as tmp:
        root = Path(tmp)
        config = LlamaConfig(hidden_size=768, num_hidden_layers=args.layers, num_attention_heads=12,
                             num_key_value_heads=4, intermediate_size=2048, vocab_size=32000,
                             max_position_embeddings=2048)
        LlamaForCausalLM(config).save_pretrained(root / "hf", max_shard_size="200MB")
        m = ModelConfig.model_validate(sizes_from_pretrained(ModelConfig(pretrained=str(root / "hf")), "bench"))
        state = load_reference(root / "hf", m).state_dict()
        write_layer_files(root / "ckpt", m, state)
        del state

        def ours() -> None:
            shutil.rmtree(root / "export", ignore_errors=True)
            export_checkpoint(m, root / "ckpt", root / "export", stages=2, dtype="fp32")

        export_s = _best(ours, args.repeat)
        shards = sorted((root / "export").glob("*.safetensors"))
        nbytes = sum(p.stat().st_size for p in shards)

        def dd() -> None:
            for i, shard in enumerate(shards):
                subprocess.run(["dd", f"if={shard}", f"of={root / f'dd-{i}'}", "bs=8M", "conv=fsync"],
                               check=True, capture_output=True)

        dd_s = _best(dd, args.repeat)
        def touched(model: torch.nn.Module) -> float:  # every weight read (transformers 5 maps lazily)
            return sum(float(p.detach().sum()) for p in model.parameters())

        ours_import = _best(lambda: touched(load_reference(root / "hf", m)), args.repeat)
        theirs_import = _best(lambda: touched(AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32)),
                              args.repeat)

    mb = nbytes / 1e6
    print(f"model: llama {args.layers} layers, d 768, vocab 32000: {mb:.0f} MB of fp32 weights, 2 stages")
    print(f"export  ours {export_s:.2f}s ({mb / export_s:.0f} MB/s)  dd {dd_s:.2f}s ({mb / dd_s:.0f} MB/s)  "
          f"ratio ours/dd throughput {dd_s / export_s:.2f}")
    print(f"import  ours {ours_import:.2f}s  transformers from_pretrained {theirs_import:.2f}s  "
          f"ratio theirs/ours {theirs_import / ours_import:.2f}")


if __name__ == "__main__":
    main()
