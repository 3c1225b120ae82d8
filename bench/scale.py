"""Weights at the speed of the disk (issue 27): our export, pull and cache copy against dd / cp -r + sync.

Run: `OMP_NUM_THREADS=1 .venv/bin/python bench/scale.py [--layers 20] [--repeat 3]` (BENCH_DIR: where the
scratch files go; default the system temp dir).

A random ~300M Llama (d 1024, 20 layers, vocab 32000) is built with transformers in the run (no download) and
saved as a Hugging Face directory in bf16 (shards of 200 MB). Side by side, interleaved (ours, theirs, ours,
...), medians of `--repeat`:
- export: `tasks.train.export.export_stage` (the ranks' path) of the whole model as one stage, bf16, streamed
  into a local store's staging area, fsynced; vs `dd bs=8M conv=fsync` of the same shard. Ratio = dd's time /
  ours (goal >= 0.8). Twice: the model held in fp32 (a CPU rank: each piece converted to bf16 on the way),
  then held in bf16 (a GPU rank's weights: nothing to convert).
- pull: `ArtifactStore.pull` of the version's tree (what `retrainer registry pull` runs once it has read the
  record), every file verified; vs `cp -r` of the tree + `sync`. Goal >= 0.5. The whole `retrainer registry
  pull` command (a new process: imports, database) is timed too, for reference.
- cache copy: `warm_pretrained` of the directory into a fresh cache (what a run starting from
  `model.pretrained` does), every file hashed; vs `cp -r` + `sync`. Goal >= 0.5.
The page cache is warm for both sides of each pair (the same source bytes were just read).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _timed(fn: Callable[[], object], reset: Callable[[], object]) -> float:
    reset()
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def _pair(name: str, ours: Callable[[], object], theirs: Callable[[], object], reset: Callable[[], object],
          repeat: int, nbytes: int, theirs_name: str) -> None:
    a, b = [], []
    for _ in range(repeat):
        a.append(_timed(ours, reset))
        b.append(_timed(theirs, reset))
    ta, tb = statistics.median(a), statistics.median(b)
    mb = nbytes / 1e6
    print(f"{name:<11} ours {ta:6.2f}s ({mb / ta:5.0f} MB/s)  {theirs_name} {tb:6.2f}s ({mb / tb:5.0f} MB/s)  "
          f"ratio {tb / ta:.2f}   runs ours {[round(x, 2) for x in a]} theirs {[round(x, 2) for x in b]}",
          flush=True)


def _cp_sync(src: Path, dest: Path) -> None:
    subprocess.run(["cp", "-r", str(src), str(dest)], check=True)
    subprocess.run(["sync"], check=True)


def _bench_export(root: Path, store: Any, repeat: int) -> None:
    """The ranks' export of one stage holding the whole model (loaded as our model) vs dd of its shard: held in
    fp32 (a CPU rank: converted to bf16 on the way), then in bf16 (a GPU rank)."""
    import torch

    from tasks.config import ModelConfig
    from tasks.models.parallel import TPGroup
    from tasks.models.pretrained import sizes_from_pretrained
    from tasks.models.weights import load_reference
    from tasks.train.export import export_stage
    m = ModelConfig.model_validate(sizes_from_pretrained(ModelConfig(pretrained=str(root / "hf")), "bench"))
    module = load_reference(root / "hf", m)
    staged: list[dict] = []

    def export() -> None:
        report = export_stage(module, m, TPGroup(), stage=0, stages=1, dp_rank=0, output_dir=root / "run",
                              tag="bench", spec={"store_url": store.url, "storage_options": {},
                                                 "staging": store.stage(), "dtype": "bf16"})
        staged.append(report)

    export()  # one untimed run: the shard dd copies
    shard = Path(staged[0]["staging"].removeprefix("file://")) / staged[0]["file"]["path"]
    shutil.copyfile(shard, root / "shard")

    def reset_export() -> None:
        for report in staged:
            store.discard(report["staging"])
        staged.clear()
        Path(root / "dd").unlink(missing_ok=True)

    def dd() -> None:
        subprocess.run(["dd", f"if={root / 'shard'}", f"of={root / 'dd'}", "bs=8M", "conv=fsync"], check=True,
                       capture_output=True)

    nbytes = (root / "shard").stat().st_size
    _pair("export", export, dd, reset_export, repeat, nbytes, "dd conv=fsync")
    module.to(torch.bfloat16)  # as a GPU rank holds its weights: no conversion on the way out
    _pair("export bf16", export, dd, reset_export, repeat, nbytes, "dd conv=fsync")
    reset_export()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tasks.models.pretrained import warm_pretrained
    from tasks.registry import ArtifactStore, Lineage, Registry, upgrade

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="bench-scale-", dir=os.environ.get("BENCH_DIR")) as tmp:
        root = Path(tmp)
        config = LlamaConfig(hidden_size=1024, num_hidden_layers=args.layers, num_attention_heads=16,
                             num_key_value_heads=8, intermediate_size=2816, vocab_size=32000,
                             max_position_embeddings=2048, tie_word_embeddings=False)
        started = time.perf_counter()
        model = LlamaForCausalLM(config).to(torch.bfloat16)
        params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(root / "hf", max_shard_size="200MB")
        del model
        hf_bytes = sum(p.stat().st_size for p in (root / "hf").iterdir())
        print(f"model: llama {args.layers} layers, d 1024, vocab 32000: {params / 1e6:.0f}M params, "
              f"{hf_bytes / 1e6:.0f} MB bf16 in {len(list((root / 'hf').glob('*.safetensors')))} shards "
              f"(built in {time.perf_counter() - started:.0f}s); load average {os.getloadavg()[0]:.1f}, "
              f"{os.cpu_count()} CPUs", flush=True)

        store = ArtifactStore(str(root / "store"))
        _bench_export(root, store, args.repeat)

        # -- pull: a published tree version into a new directory --------------------------------------------
        db = f"sqlite:///{root / 'registry.db'}"
        upgrade(db)
        ref = store.put_tree(root / "hf")
        with Registry(db) as reg:
            rec = reg.publish_version("bench", ref, Lineage("cfg", "data", "rev", "bench"), {"loss": 1.0}, "bench")
            reg.switch_alias("bench", "production", rec.version, actor="bench", reason="bench", action="publish")

        def reset_out() -> None:
            for name in ("pulled", "copied", "cache"):
                shutil.rmtree(root / name, ignore_errors=True)

        _pair("pull", lambda: ArtifactStore.of_version(rec).pull(rec, root / "pulled"),
              lambda: _cp_sync(Path(store.tree_path(ref.digest)), root / "copied"), reset_out, args.repeat, ref.size,
              "cp -r + sync")

        def cli_pull() -> None:
            subprocess.run([sys.executable, "-m", "tasks.cli", "registry", "pull", "--model", "bench", "--db", db,
                            str(root / "pulled")], check=True, capture_output=True, cwd=ROOT)

        _pair("pull (CLI)", cli_pull, lambda: _cp_sync(Path(store.tree_path(ref.digest)), root / "copied"),
              reset_out, args.repeat, ref.size, "cp -r + sync")

        # -- cache copy: a pretrained directory warmed into a run's cache ------------------------------------
        _pair("cache copy", lambda: warm_pretrained(str(root / "hf"), {}, root / "cache"),
              lambda: _cp_sync(root / "hf", root / "copied"), reset_out, args.repeat, hf_bytes, "cp -r + sync")


if __name__ == "__main__":
    main()
