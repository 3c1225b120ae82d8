"""Weights at the speed of the disk (issue 27): our export, pull and cache copy against dd / cp -r + sync.

Run: `OMP_NUM_THREADS=1 .venv/bin/python bench/scale.py [--layers 20] [--repeat 3]` (BENCH_DIR: where the
scratch files go; default the system temp dir).

A random ~300M Llama (d 1024, 20 layers, vocab 32000) is built with transformers in the run (no download) and
saved as a Hugging Face directory in bf16 (shards of 200 MB). Side by side by bench/fair.py's method: the sides
in turn, order rotated each round, at least 3 samples a side (`--repeat`), each printed with its median, min, max
and the 1-minute load at every sample; a set whose samples on either side spread by more than 1.5x is taken again
(twice at most), not averaged. A compute peer (start, evaluate, resume) runs as many threads as our two ranks
have together:
- export: `tasks.train.export.export_stage` (the ranks' path) of the whole model as one stage, bf16, streamed
  into a local store's staging area (the stage's four files at once), fsynced; vs `dd bs=8M conv=fsync` of the
  same bytes (the four files joined into one). Ratio = dd's time /
  ours (goal >= 0.8). Twice: the model held in fp32 (a CPU rank: each piece converted to bf16 on the way),
  then held in bf16 (a GPU rank's weights: nothing to convert).
- pull: `ArtifactStore.pull` of the version's tree (what `retrainer registry pull` runs once it has read the
  record), every file verified; vs `cp -r` of the tree + `sync`. Goal >= 0.5. The whole `retrainer registry
  pull` command (a new process: imports, database) is timed too, for reference.
- cache copy: `warm_pretrained` of the directory into a fresh cache (what a run starting from
  `model.pretrained` does), every file hashed and checked (every weight finite, shapes, dtypes, tokenizer);
  vs `cp -r` + `sync`. Goal >= 0.5.
- start: `tasks.launch.train` of a fresh run from the directory (2 ranks, pp=2, ZeRO-1, fp32 on CPU),
  from the call to the moment rank 0 reports "training" (the engine built, the weights in, the first
  step about to run); vs a new process running transformers' `from_pretrained` (fp32) and reading every
  weight. Ratio = ours / theirs (goal <= 1.0).
- evaluate: `tasks.evaluate.evaluate` of that run's checkpoint (2 ranks, pp=2, the whole job: launch,
  warm, load, score) vs a new process scoring the same windows with transformers (load + forward), as many
  threads as our ranks together, in the same dtype (`--eval-dtypes`: `evaluate.dtype` bf16, the default, and
  fp32; the peer's `from_pretrained(dtype=...)` alike); the CPU seconds of both sides are printed too. Ratio =
  ours / theirs (goal <= 0.7, and no more CPU seconds than the peer).
- resume: a run (the same 2 ranks) trains 2 steps with a checkpoint each, then is made to look killed after
  step 1 (`latest` names step 1, step 2, the summary and the status gone) and launched again: from the
  `tasks.launch.train` call to the moment rank 0 reports "training" with the step-1 checkpoint loaded (its
  summary says resumed from step 1); vs a new process `torch.load`ing every file of that checkpoint (weights,
  optimizer states, the ranks' states), as many threads as our ranks together. Ratio = ours / theirs (goal
  <= 1.0).
- process memory: each training rank's peak RSS (measured by the rank, `ru_maxrss`, over the run above,
  which saves a checkpoint) against `retrainer plan`'s per-rank prediction, whose `process` terms are
  printed too (goal: within 15%).
The page cache is warm for both sides of each pair (the same source bytes were just read).
`--only start,evaluate,memory,resume` runs some sections.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fair import Sample, alternated, median, stats, timer

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


# The ranks run one OpenMP thread each (tasks/launch/torchrun.py RANK_ENV_DEFAULTS) and the bench's runs have two
# (pp=2): a compute peer gets as many threads in its one process, the same cores as our side.
OUR_RANKS = 2
PEER_THREADS = OUR_RANKS


def _pair(name: str, ours: Callable[[], object], theirs: Callable[[], object], reset: Callable[[], object],
          repeat: int, nbytes: int, theirs_name: str) -> None:
    """A copy-like pair: the ratio is their time / ours (>= 1: we are faster)."""
    got = alternated(name, {"ours": timer(ours, reset), "theirs": timer(theirs, reset)}, repeat)
    a, b = got["ours"], got["theirs"]
    ta, tb = median(a), median(b)
    mb = nbytes / 1e6
    print(f"{name:<11} ours {stats(a)} {mb / ta:5.0f} MB/s | {theirs_name} {stats(b)} {mb / tb:5.0f} MB/s | "
          f"ratio {tb / ta:.2f}", flush=True)


def _reset_out(root: Path) -> Callable[[], None]:
    def reset() -> None:
        for name in ("pulled", "copied", "models"):
            shutil.rmtree(root / name, ignore_errors=True)

    return reset


def _cp_sync(src: Path, dest: Path) -> None:
    subprocess.run(["cp", "-r", str(src), str(dest)], check=True)
    subprocess.run(["sync"], check=True)


def _bench_export(root: Path, store: Any, repeat: int) -> None:
    """The ranks' export of one stage holding the whole model (loaded as our model) vs dd of its shard: held in
    fp32 (a CPU rank: converted to bf16 on the way), then in bf16 (a GPU rank)."""
    import torch

    from tasks.config.model import ModelConfig
    from tasks.models.parallel import TPGroup
    from tasks.models.pretrained import sizes_from_pretrained
    from tasks.models.weights import load_reference
    from tasks.train.export import export_stage
    m = ModelConfig.model_validate(sizes_from_pretrained(ModelConfig(pretrained=str(root / "hf")), "bench"))
    module = load_reference(root / "hf", m)
    staged: list[dict] = []

    def export() -> None:
        staged.extend(export_stage(module, m, TPGroup(), output_dir=root / "run",
                                   tag="bench", spec={"store_url": store.url, "storage_options": {},
                                                      "staging": store.stage(), "dtype": "bf16"}))

    export()  # one untimed run: its files, joined into one, are what dd copies
    with open(root / "shard", "wb") as joined:
        for report in staged:
            with open(Path(report["staging"].removeprefix("file://")) / report["file"]["path"], "rb") as part:
                shutil.copyfileobj(part, joined, 16 << 20)

    def reset_export() -> None:
        for staging in {report["staging"] for report in staged}:
            store.discard(staging)
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


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_config(root: Path, hf: Path, name: str) -> Any:
    """A fresh 2-rank (pp=2, ZeRO-1) run starting from the directory, its own output directory."""
    from tasks.config.model import ModelConfig
    from tasks.config.schema import JobConfig
    from tasks.models.pretrained import sizes_from_pretrained

    model = sizes_from_pretrained(ModelConfig(pretrained=str(hf), seq_len=SEQ_LEN), "bench")
    return JobConfig.model_validate({
        "name": "bench-scale", "model": model,
        "data": {"source_url": str(root / "data"), "cache_dir": str(root / "cache")},
        "parallel": {"tp": 1, "pp": 2, "dp": 1, "zero_stage": 1, "micro_batches": 2},
        "train": {"output_dir": str(root / name), "steps": 1, "micro_batch_size": 2, "warmup_steps": 1},
        "evaluate": {"batches": EVAL_BATCHES, "batch_size": EVAL_BATCH_SIZE},
        "cluster": {"master_port": _free_port()},
        "publish": {"registry_url": "sqlite://", "store_url": str(root / "store"), "model_name": "bench"},
    })


SEQ_LEN, EVAL_BATCHES, EVAL_BATCH_SIZE = 256, 8, 2


def _train_watched(cfg: Any, dataset: Path, hf: Path) -> tuple[dict[str, Any], float]:
    """Train `cfg` through the launcher: its summary and the seconds from the call until rank 0's status first
    says "training" (the engine built, the weights or the checkpoint in, the next step about to run)."""
    import threading

    from tasks.base.job_status import STATUS_FILE, read_status
    from tasks.launch import train

    status = Path(cfg.train.output_dir) / STATUS_FILE
    started = time.perf_counter()
    seen: dict[str, float] = {}

    def watch() -> None:
        while "t" not in seen:  # the status file is replaced atomically: whole or absent
            got = read_status(status)
            if got is not None and got.state in ("training", "finished", "failed"):
                seen["t"] = time.perf_counter() - started
            time.sleep(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    summary = train(cfg, dataset, init_path=hf)
    watcher.join()
    return summary, seen["t"]


_PEER_START = """
import os, sys, torch
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
total = sum(float(p.detach().sum()) for p in model.parameters())
"""

_PEER_TORCH_LOAD = """
import os, sys, torch
from pathlib import Path
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
for path in sorted(Path(sys.argv[1]).iterdir()):
    if path.suffix == ".pt":
        torch.load(path, map_location="cpu", weights_only=False)
    elif path.suffix == ".safetensors":
        from safetensors.torch import load_file
        load_file(path)
"""

_PEER_EVAL = """
import math, os, sys, torch
import torch.nn.functional as F
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
from transformers import AutoModelForCausalLM
from tasks.evaluate.spec import window_order
from tasks.train.data import TokenWindows
hf, data, seq, batches, size, dtype = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6]), sys.argv[6]
model = AutoModelForCausalLM.from_pretrained(hf, dtype=getattr(torch, dtype)).eval()
windows = TokenWindows(data, "heldout", seq, model.config.vocab_size)
order = window_order(len(windows), batches, size)
nll = n = 0.0
with torch.no_grad():
    for b in range(batches):
        w = windows.get(order[b * size:(b + 1) * size])
        logits = model(input_ids=w[:, :-1]).logits
        nll += float(F.cross_entropy(logits.float().flatten(0, 1), w[:, 1:].flatten(), reduction="sum"))
        n += w[:, 1:].numel()
print(nll / n)
"""


def _peer(script: str, *args: object) -> None:
    """A peer process with as many threads as our ranks have together (PEER_THREADS)."""
    subprocess.run([sys.executable, "-c", script, *map(str, args)], check=True, capture_output=True, cwd=ROOT,
                   env=dict(os.environ, OMP_NUM_THREADS=str(PEER_THREADS), PYTHONPATH=str(ROOT)))


def _write_dataset(directory: Path, vocab: int, tokens: int) -> None:
    """Random tokens in the warm stage's format (train/ and heldout/ shards + manifest)."""
    import numpy as np

    from tasks.base.fsutil import sha256_bytes

    rng = np.random.default_rng(0)
    files = []
    for key, n in (("train/shard-00000.bin", tokens), ("heldout/shard-00000.bin", tokens)):
        data = rng.integers(0, vocab, n, dtype=np.uint16).astype("<u2").tobytes()
        (directory / key).parent.mkdir(parents=True, exist_ok=True)
        (directory / key).write_bytes(data)
        files.append({"key": key, "size": len(data), "sha256": sha256_bytes(data)})
    manifest = {"format": "retrainer-dataset/1", "name": "bench", "dtype": "uint16", "vocab_size": vocab,
                "files": files}
    (directory / "manifest.json").write_text(json.dumps(manifest))


def _bench_start_eval_memory(root: Path, hf: Path, repeat: int, sections: set[str], eval_dtypes: list[str]
                             ) -> None:
    """Start (launch -> training) and evaluation against transformers, and each rank's peak RSS against the plan."""
    from tasks.base.model_files import DTYPES
    from tasks.evaluate import evaluate
    from tasks.plan import plan
    from tasks.runs.identity import RunIdentity

    runs: list[dict[str, Any]] = []

    def start() -> None:
        cfg = _run_config(root, hf, f"run-{len(runs)}")
        summary, start_s = _train_watched(cfg, root / "data", hf)
        if runs:  # only the last run's checkpoint is evaluated: 16 B a parameter each
            shutil.rmtree(runs[-1]["cfg"].train.output_dir)
        runs.append({"cfg": cfg, "summary": summary, "start_s": start_s})

    def ours_start() -> Sample:
        load = os.getloadavg()[0]
        start()
        return Sample(runs[-1]["start_s"], load)

    if "start" in sections:
        got = alternated("start", {"ours": ours_start, "theirs": timer(lambda: _peer(_PEER_START, hf))}, repeat)
        a, b = got["ours"], got["theirs"]
        print(f"{'start':<11} ours {stats(a)} | from_pretrained + read ({PEER_THREADS} threads) {stats(b)} | "
              f"ratio ours/theirs {median(a) / median(b):.2f}", flush=True)
    elif "evaluate" in sections or "memory" in sections:
        start()
    if "memory" in sections:
        cfg, summary = runs[-1]["cfg"], runs[-1]["summary"]
        predicted = plan(cfg, device="cpu")
        for rank, measured in enumerate(summary["peak_rss_bytes"]):
            stage = predicted.stages[rank]  # pp=2, dp=1: rank r is stage r
            want = stage["process_total"]
            terms = ", ".join(f"{k} {stage[k] / 2**30:.2f}" for k in ("weights", "gradients", "optimizer_states",
                                                                      "activations", "comm_buffers") if stage[k])
            extra = ", ".join(f"{k} {v / 2**30:.2f}" for k, v in stage["process"].items())
            print(f"{'memory':<11} rank {rank}: measured peak RSS {measured / 2**30:.2f} GiB, planned "
                  f"{want / 2**30:.2f} GiB (ratio {want / measured:.3f}); tensors: {terms}; process: {extra}",
                  flush=True)
    if "evaluate" in sections:
        cfg, summary = runs[-1]["cfg"], runs[-1]["summary"]
        run = RunIdentity.from_dict(summary["run"])
        scored: list[Any] = []
        eval_dir = Path(summary["checkpoint_dir"]).parent.parent / "eval"

        for dtype in eval_dtypes:  # ours in `evaluate.dtype`, the peer in the same dtype
            eval_cfg = cfg.with_overrides({"evaluate.dtype": dtype})

            def ours_eval(eval_cfg: Any = eval_cfg) -> None:
                launched = eval_cfg.with_overrides({"cluster.master_port": _free_port()})
                scored.append(evaluate(launched, run, summary["checkpoint_dir"], root / "data"))

            got = alternated(f"evaluate {dtype}", {
                "ours": timer(ours_eval, lambda: shutil.rmtree(eval_dir, ignore_errors=True)),
                "theirs": timer(lambda dtype=dtype: _peer(_PEER_EVAL, hf, root / "data", SEQ_LEN, EVAL_BATCHES,
                                                          EVAL_BATCH_SIZE, DTYPES[dtype])),
            }, repeat)
            a, b = got["ours"], got["theirs"]
            print(f"{'evaluate':<11} {dtype}: ours {stats(a)} | transformers (1 process, {PEER_THREADS} threads, "
                  f"{dtype}) {stats(b)} | ratio ours/theirs {median(a) / median(b):.2f}; CPU seconds ours "
                  f"({OUR_RANKS} ranks + spawner + this process) {stats(a, what='cpu_s', load=False)} theirs "
                  f"{stats(b, what='cpu_s', load=False)}; {scored[-1].tokens} tokens, loss {scored[-1].loss:.4f}",
                  flush=True)


def _rewind(cfg: Any, step: int) -> None:
    """Leave the run as one killed right after committing `step`: `latest` names it, no newer checkpoint, no
    summary, no status (a killed rank 0's last status would read "training")."""
    from tasks.base.fsutil import atomic_write_bytes
    from tasks.base.job_status import STATUS_FILE
    from tasks.train import checkpoint as ck
    from tasks.train.commit import LATEST

    out = Path(cfg.train.output_dir)
    root = ck.ckpt_root(out)
    for path in root.iterdir():
        if ck.is_tag(path.name) and int(path.name.split("-")[1]) > step:
            shutil.rmtree(path)
    atomic_write_bytes(root / LATEST, (ck.tag_for(step) + "\n").encode())
    (out / "summary.json").unlink(missing_ok=True)
    (out / STATUS_FILE).unlink(missing_ok=True)


def _read_all(paths: list[Path]) -> None:
    """Read every byte (untimed): the page cache holds the checkpoint for either side."""
    for path in paths:
        with path.open("rb") as f:
            while f.read(8 << 20):
                pass


def _bench_resume(root: Path, hf: Path, repeat: int) -> None:
    """Launch -> first resumed step of a run killed after its step-1 checkpoint vs torch.load of that checkpoint."""
    from tasks.launch import train
    from tasks.train import checkpoint as ck

    cfg = _run_config(root, hf, "resume").with_overrides(
        {"train.steps": 2, "train.checkpoint_every": 1, "train.keep_last": 2})
    train(cfg, root / "data", init_path=hf)
    ckdir = ck.ckpt_root(cfg.train.output_dir) / ck.tag_for(1)
    files = sorted(p for p in ckdir.iterdir() if p.suffix in (".pt", ".safetensors"))
    nbytes = sum(p.stat().st_size for p in files)
    def ours_resume() -> Sample:
        _rewind(cfg, 1)
        _read_all(files)
        load = os.getloadavg()[0]
        summary, took = _train_watched(cfg.with_overrides({"cluster.master_port": _free_port()}), root / "data", hf)
        if summary["resumed_from_step"] != 1:
            raise RuntimeError(f"the relaunch resumed from step {summary['resumed_from_step']}, not 1")
        return Sample(took, load)

    got = alternated("resume", {"ours": ours_resume,
                                "theirs": timer(lambda: _peer(_PEER_TORCH_LOAD, ckdir), lambda: _read_all(files))},
                     repeat)
    a, b = got["ours"], got["theirs"]
    print(f"{'resume':<11} ours {stats(a)} | torch.load of the checkpoint ({nbytes / 1e9:.1f} GB, {len(files)} "
          f"files, {PEER_THREADS} threads) {stats(b)} | ratio ours/theirs {median(a) / median(b):.2f}", flush=True)
    shutil.rmtree(cfg.train.output_dir)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--eval-dtypes", default="bf16,fp32", help="evaluate.dtype values timed (peer alike)")
    parser.add_argument("--only", default="export,pull,cache,start,evaluate,memory,resume",
                        help="comma-separated sections")
    args = parser.parse_args()
    sections = set(args.only.split(","))

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
        if "export" in sections:
            _bench_export(root, store, args.repeat)
        _write_dataset(root / "data", 32000, 200_000)
        _bench_start_eval_memory(root, root / "hf", args.repeat, sections, args.eval_dtypes.split(","))
        if "resume" in sections:
            _bench_resume(root, root / "hf", args.repeat)

        # -- pull: a published tree version into a new directory --------------------------------------------
        if "pull" in sections:
            db = f"sqlite:///{root / 'registry.db'}"
            upgrade(db)
            ref = store.put_tree(root / "hf")
            with Registry(db) as reg:
                rec = reg.publish_version("bench", ref, Lineage("cfg", "data", "rev", "bench"), {"loss": 1.0}, "bench")
                reg.switch_alias("bench", "production", rec.version, actor="bench", reason="bench", action="publish")

            _pair("pull", lambda: ArtifactStore.of_version(rec).pull(rec, root / "pulled"),
                  lambda: _cp_sync(Path(store.tree_path(ref.digest)), root / "copied"), _reset_out(root),
                  args.repeat, ref.size, "cp -r + sync")

            def cli_pull() -> None:
                subprocess.run([sys.executable, "-m", "tasks.cli", "registry", "pull", "--model", "bench", "--db", db,
                                str(root / "pulled")], check=True, capture_output=True, cwd=ROOT)

            _pair("pull (CLI)", cli_pull, lambda: _cp_sync(Path(store.tree_path(ref.digest)), root / "copied"),
                  _reset_out(root), args.repeat, ref.size, "cp -r + sync")


        # -- cache copy: a pretrained directory warmed into a run's cache ------------------------------------
        if "cache" in sections:
            from tasks.config.model import ModelConfig
            from tasks.models.pretrained import sizes_from_pretrained

            m = ModelConfig.model_validate(sizes_from_pretrained(ModelConfig(pretrained=str(root / "hf")), "bench"))
            _pair("cache copy", lambda: warm_pretrained(str(root / "hf"), m, root / "models"),
                  lambda: _cp_sync(root / "hf", root / "copied"), _reset_out(root), args.repeat, hf_bytes,
                  "cp -r + sync")


if __name__ == "__main__":
    main()
