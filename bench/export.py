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
  Ratio = theirs / ours (> 1: we are faster). Both in this process, one thread each (the same cores).
Each pair by bench/fair.py's method: alternated in rotated order, at least `--repeat` (>= 3) samples a side,
medians with min, max and the load at each sample, a set spread by more than 1.5x taken again.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from fair import alternated, median, stats, timer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    import shutil

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from tasks.config.model import ModelConfig
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

        def export() -> None:
            export_checkpoint(m, root / "ckpt", root / "export", stages=2, dtype="fp32")

        def reset() -> None:  # untimed before each sample: the last one's outputs gone
            shutil.rmtree(root / "export", ignore_errors=True)
            for path in root.glob("dd-*"):
                path.unlink()

        reset()
        export()  # one untimed run: its shards are what dd copies
        shards = [p.rename(root / f"shard-{i}") for i, p in enumerate(sorted((root / "export").glob("*.safetensors")))]
        nbytes = sum(p.stat().st_size for p in shards)

        def dd() -> None:
            for i, shard in enumerate(shards):
                subprocess.run(["dd", f"if={shard}", f"of={root / f'dd-{i}'}", "bs=8M", "conv=fsync"],
                               check=True, capture_output=True)

        mb = nbytes / 1e6
        print(f"model: llama {args.layers} layers, d 768, vocab 32000: {mb:.0f} MB of fp32 weights, 2 stages",
              flush=True)
        got = alternated("export", {"ours": timer(export, reset), "dd": timer(dd, reset)}, args.repeat)
        ours, theirs = got["ours"], got["dd"]
        print(f"export  ours {stats(ours)} ({mb / median(ours):.0f} MB/s) | dd {stats(theirs)} "
              f"({mb / median(theirs):.0f} MB/s) | ratio ours/dd throughput {median(theirs) / median(ours):.2f}",
              flush=True)

        def touched(model: torch.nn.Module) -> float:  # every weight read (transformers 5 maps lazily)
            return sum(float(p.detach().sum()) for p in model.parameters())

        got = alternated("import", {
            "ours": timer(lambda: touched(load_reference(root / "hf", m))),
            "theirs": timer(lambda: touched(AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32))),
        }, args.repeat)
        ours, theirs = got["ours"], got["theirs"]
        print(f"import  ours {stats(ours)} | transformers from_pretrained {stats(theirs)} | "
              f"ratio theirs/ours {median(theirs) / median(ours):.2f}", flush=True)


if __name__ == "__main__":
    main()
