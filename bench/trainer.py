"""Trainer benchmark: our DeepSpeed engine vs a plain PyTorch loop on the same model and data.

Run: `.venv/bin/python bench/trainer.py [--steps N] [--gpu]`.

CPU (always): median step time of our engine with DP=1 (tasks.base.spawn, one rank,
PipelineModule + ZeRO-1 + telemetry) vs `tasks.train.reference.train_reference`
(the plain loop: forward, backward, clip, AdamW, scheduler) on the same model,
batches and initial weights, one thread each (our one rank at OMP_NUM_THREADS=1,
the loop in this process at torch.set_num_threads(1): the same cores). Goal: ratio <= 1.15.
Checkpoint commit throughput (GB/s, the engine run's last save) vs `dd` writing
the same bytes with fsync to the same disk. The three sides (engine run, plain
loop, dd) by bench/fair.py's method: in turn, the order rotated each round,
`--repeat` (>= 3) samples each (one sample = a fresh run's median step after
warm-up, or one dd), medians with min, max and the load at each sample, a set
spread by more than 1.5x taken again. Asynchronous checkpoints (`--async-only` runs just this): for a
~100M GPT, the seconds training is blocked per save (snapshot to host memory, and
a CPU rank's wait for the write before the next optimizer step) vs the whole save
(snapshot, write, fsync, commit), which is what a synchronous save would block.
Goal: stall <= 20% of the save.

GPU (`--gpu`, only when CUDA is present): bf16 throughput and MFU of a ~1.1B
GPT on one GPU (goal: MFU >= 45% of the dense bf16 peak in cluster.peak_tflops),
plus the same checkpoint-vs-dd comparison for its ~18 GB checkpoint (one run,
dd sampled 3 times: the run is too long to repeat).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from fair import Sample, alternated, median, stats, timed

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tasks.base.fsutil import sha256_bytes
from tasks.config.schema import JobConfig


def write_dataset(root: Path, vocab: int, tokens: int, seed: int = 0) -> Path:
    """Random tokens in the warm stage's format (train/ and heldout/ shards + manifest)."""
    rng = np.random.default_rng(seed)
    files = []
    for key, n in (("train/shard-00000.bin", tokens), ("heldout/shard-00000.bin", tokens // 8)):
        data = rng.integers(0, vocab, n, dtype=np.uint16).astype("<u2").tobytes()
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(data)
        files.append({"key": key, "size": len(data), "sha256": sha256_bytes(data)})
    manifest = {"format": "retrainer-dataset/1", "name": "tiny", "dtype": "uint16", "vocab_size": vocab, "files": files}
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


def job(root: Path, model: dict, train: dict, port: int) -> JobConfig:
    return JobConfig.model_validate({
        "name": "bench-trainer",
        "model": model,
        "data": {"source_url": str(root / "src"), "cache_dir": str(root / "cache")},
        "parallel": {"tp": 1, "pp": 1, "dp": 1, "zero_stage": 1},
        "train": {"output_dir": str(root / "run"), "warmup_steps": 2, "seed": 1, **train},
        "cluster": {"master_port": port},
        "publish": {"registry_url": "sqlite://", "store_url": str(root / "store"), "model_name": "bench"},
    })


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dd_write(directory: Path, nbytes: int) -> Sample:
    """`dd` writing nbytes (rounded to 1 MiB blocks; `extra["bytes"]`) with a final fsync to a file in directory."""
    target = directory / "dd.bin"
    count = max(1, nbytes // (1 << 20))
    took = timed(lambda: subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=1M", f"count={count}",
                                         "conv=fsync"], check=True, capture_output=True))
    target.unlink()
    return Sample(took.value, took.load, took.cpu_s, {"bytes": count << 20})


def engine_run(cfg: JobConfig, dataset: Path) -> tuple[list[dict], list[dict]]:
    from tasks.launch import train

    train(cfg, dataset)
    out = Path(cfg.train.output_dir)
    steps = [json.loads(x) for x in (out / "telemetry.jsonl").read_text().splitlines()]
    ckpts = [json.loads(x) for x in (out / "checkpoints.jsonl").read_text().splitlines()]
    return steps, ckpts


def cpu_bench(steps: int, repeat: int) -> None:
    import torch

    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    from tasks.train.reference import train_reference

    model = {"family": "gpt",
             "vocab_size": 512, "seq_len": 128, "n_layers": 4, "d_model": 256, "n_heads": 8, "d_ff": 1024}
    with tempfile.TemporaryDirectory(prefix="bench-trainer-") as tmp:
        root = Path(tmp)
        dataset = write_dataset(root / "data", 512, 200_000)
        cfg = job(root, model, {"steps": steps, "micro_batch_size": 8, "checkpoint_every": steps}, free_port())
        skip = 3  # warm-up steps (allocator, first-touch)
        saved: list[int] = []  # the bytes of each engine run's last checkpoint: what dd writes

        def ours() -> Sample:
            shutil.rmtree(cfg.train.output_dir, ignore_errors=True)  # a fresh run each time, not a resume
            load = os.getloadavg()[0]
            rows, ckpts = engine_run(cfg.with_overrides({"cluster.master_port": free_port()}), dataset)
            saved.append(ckpts[-1]["bytes"])
            return Sample(statistics.median(r["step_s"] for r in rows[skip:]), load, extra={
                "comm_s": statistics.median(r["comm_s"] for r in rows[skip:]), "ckpt_s": ckpts[-1]["seconds"]})

        def plain() -> Sample:
            load = os.getloadavg()[0]
            return Sample(statistics.median(train_reference(cfg, dataset).step_seconds[skip:]), load)

        # Round 1 starts with the engine run: dd always has its checkpoint's size.
        got = alternated("trainer", {"ours": ours, "plain": plain, "dd": lambda: dd_write(root, saved[-1])}, repeat)
        a, b, d = got["ours"], got["plain"], got["dd"]
        ours_s, ref_s = median(a), median(b)
        print(f"CPU model L4 d256 h8 V512 s128, micro-batch 8, {steps} steps, 1 thread, fp32; {len(a)} runs a side")
        print(f"  ours (DeepSpeed engine, DP=1): median step {ours_s * 1e3:.1f} ms (comm "
              f"{median(a, 'comm_s') * 1e3:.2f} ms); step s {stats(a, fmt='.4f')}")
        print(f"  plain PyTorch loop           : median step {ref_s * 1e3:.1f} ms; step s {stats(b, fmt='.4f')}")
        print(f"  ratio ours/plain             : {ours_s / ref_s:.3f}  (goal <= 1.15)")
        nbytes, ckpt_s, dd_s = saved[-1], median(a, "ckpt_s"), median(d)
        ours_gbps, peer = nbytes / ckpt_s / 1e9, d[-1].extra["bytes"] / dd_s / 1e9
        print(f"  checkpoint commit: {nbytes / 1e6:.1f} MB in {stats(a, what='ckpt_s', fmt='.3f', load=False)} = "
              f"{ours_gbps:.3f} GB/s; dd+fsync same bytes: {stats(d, fmt='.3f')} = {peer:.3f} GB/s; "
              f"ratio {ours_gbps / peer:.2f}")


def async_bench() -> None:
    """Stall per save vs the whole save for a ~100M model (saves at steps 2 and 4 while training goes on)."""
    import torch

    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    from tasks.models import get_family

    model = {"family": "gpt", "vocab_size": 8192, "seq_len": 64, "n_layers": 12, "d_model": 768, "n_heads": 12,
             "d_ff": 3072}
    with tempfile.TemporaryDirectory(prefix="bench-async-", dir=os.environ.get("BENCH_DIR")) as tmp:
        root = Path(tmp)
        dataset = write_dataset(root / "data", 8192, 50_000)
        cfg = job(root, model, {"steps": 6, "micro_batch_size": 1, "checkpoint_every": 2}, free_port())
        rows, ckpts = engine_run(cfg, dataset)
        n = get_family(cfg.model.family).total_params(cfg.model)
        print(f"async checkpoints: GPT {n / 1e6:.0f}M params, CPU, 1 thread, fp32 + AdamW (ZeRO-1)")
        for save, after in itertools.pairwise(ckpts):  # the last save ends the run: waited for, not overlapped
            # A CPU rank also waits for the write before the optimizer steps that follow the save (telemetry).
            waited = sum(r.get("snapshot_wait_s", 0.0) for r in rows if save["step"] < r["step"] <= after["step"])
            blocked = save["stall_s"] + waited
            print(f"  {save['tag']}: {save['bytes'] / 1e9:.2f} GB, training blocked {blocked:.2f} s ("
                  f"{save['stall_s']:.2f} s snapshot + {waited:.2f} s waiting for the write) of a "
                  f"{save['seconds']:.2f} s save = {blocked / save['seconds'] * 100:.0f}% (goal <= 20%)")


def gpu_bench(steps: int) -> None:
    import torch

    if not torch.cuda.is_available():
        print("GPU: not measured: no GPU lent (torch.cuda.is_available() is False)")
        return
    model = {"family": "gpt",
             "vocab_size": 32000, "seq_len": 2048, "n_layers": 20, "d_model": 2048, "n_heads": 16, "d_ff": 8192}
    with tempfile.TemporaryDirectory(prefix="bench-trainer-gpu-", dir=os.environ.get("BENCH_DIR")) as tmp:
        root = Path(tmp)
        dataset = write_dataset(root / "data", 32000, 4_000_000)
        cfg = job(root, model, {"steps": steps, "micro_batch_size": 8, "checkpoint_every": steps,
                                "precision": "bf16", "lr": 3e-4}, free_port())
        from tasks.models import get_family

        rows, ckpts = engine_run(cfg, dataset)
        tail = rows[3:]
        tps = statistics.median(r["tokens_per_s"] for r in tail)
        mfu = statistics.median(r["mfu"] for r in tail)
        n = get_family(cfg.model.family).total_params(cfg.model)
        print(f"GPU {torch.cuda.get_device_name()}: GPT {n / 1e9:.2f}B, bf16, mbs 8 x 2048")
        print(f"  tokens/s {tps:,.0f}  MFU {mfu * 100:.1f}% of {cfg.cluster.peak_tflops} TFLOPS (goal >= 45%)")
        print(f"  peak memory {max(r['peak_mem_bytes'] for r in rows) / 2**30:.1f} GiB")
        last = ckpts[-1]
        ours_gbps = last["bytes"] / last["seconds"] / 1e9
        d = [dd_write(root, last["bytes"]) for _ in range(3)]
        peer = d[-1].extra["bytes"] / median(d) / 1e9
        print(f"  checkpoint commit: {last['bytes'] / 1e9:.2f} GB in {last['seconds']:.1f} s = {ours_gbps:.2f} GB/s;"
              f" dd+fsync: {stats(d, fmt='.1f')} = {peer:.2f} GB/s; ratio {ours_gbps / peer:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=3, help="runs of each side on CPU (at least 3)")
    parser.add_argument("--gpu", action="store_true", help="also run the ~1B bf16 MFU benchmark (needs CUDA)")
    parser.add_argument("--async-only", action="store_true", help="only the asynchronous checkpoint benchmark")
    args = parser.parse_args()
    async_bench()
    if args.async_only:
        return
    cpu_bench(args.steps, args.repeat)
    if args.gpu:
        gpu_bench(args.steps)


if __name__ == "__main__":
    main()
