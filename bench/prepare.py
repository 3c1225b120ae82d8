"""Benchmark: `retrainer prepare-data` tokens/s vs a plain `encode_batch` loop and Hugging Face `datasets.map`.

One generated JSONL corpus (Zipf-distributed pseudo-words, ~4-5 bytes per token like
English under a BPE), one byte-level BPE (8,192 ids) trained in-process on its first
2 MB. Each contender runs as a fresh process, timed from start to exit (imports
included), by bench/fair.py's method: in turn, the order rotated each round, `--rounds`
(>= 3) runs each, the median wall printed with min, max and the load at each run, a set
spread by more than 1.5x taken again; tokens/s = tokens (documents + one EOS each) /
median wall seconds, ratios printed. The token counts must agree. Every contender gets
the same cores: `--workers` tokenizing threads in all.

- `prepare-data`: the real verb, JSONL in, shards + manifest out (`--workers`, default 2,
  processes of one tokenizing thread each).
- `encode_batch loop`: one process reading JSONL in batches of 1,000 documents and
  calling `Tokenizer.encode_batch` (the library's own Rayon threads, RAYON_NUM_THREADS
  = `--workers`); writes nothing.
- `datasets.map`: `load_dataset("json")` then `.map(batched=True, num_proc=--workers)`
  with the same tokenizer (one thread each: TOKENIZERS_PARALLELISM=false), the recipe of
  nanoGPT-style prepare scripts; it writes its Arrow
  cache, not the final flat token file. `datasets` is not a project dependency: it lives
  in its own venv (/tmp/prepare-peers-venv, created on first use) with our tokenizers version.

    .venv/bin/python bench/prepare.py                 # 300 MB, 3 rounds
    .venv/bin/python bench/prepare.py --mb 50 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from fair import Sample, alternated, median, stats

ROOT = Path(__file__).resolve().parents[1]
EOS = "<|endoftext|>"

ENCODE_LOOP = """
import json, sys
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[2])
tokens = docs = 0
def flush(batch):
    global tokens, docs
    tokens += sum(len(e.ids) + 1 for e in tok.encode_batch(batch, add_special_tokens=False))
    docs += len(batch)
batch = []
with open(sys.argv[1], "rb") as fh:
    for line in fh:
        batch.append(json.loads(line)["text"])
        if len(batch) == 1000:
            flush(batch)
            batch = []
flush(batch)
print(json.dumps({"tokens": tokens, "documents": docs}))
"""

DATASETS_MAP = """
import json, sys
from datasets import load_dataset
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[2])
eos = tok.token_to_id(sys.argv[4])
def encode(batch):
    ids = [e.ids + [eos] for e in tok.encode_batch(batch["text"], add_special_tokens=False)]
    return {"ids": ids, "len": [len(x) for x in ids]}
ds = load_dataset("json", data_files=sys.argv[1], split="train", cache_dir=sys.argv[3])
out = ds.map(encode, batched=True, num_proc=int(sys.argv[5]), remove_columns=ds.column_names)
print(json.dumps({"tokens": int(sum(out["len"])), "documents": len(out)}))
"""


def make_corpus(path: Path, mb: int, seed: int = 0) -> None:
    """Documents of Zipf-distributed pseudo-words (a 30,000-word lexicon from syllables), 50-2,000 words each."""
    import numpy as np

    rng = np.random.default_rng(seed)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ai", "ou")]
    lexicon = np.array(["".join(rng.choice(syllables, rng.integers(1, 4))) for _ in range(30_000)])
    weights = 1.0 / np.arange(1, len(lexicon) + 1) ** 1.1
    cdf = np.cumsum(weights / weights.sum())
    punct = np.array(["", "", "", "", "", "", ",", ".", ".", "?"])
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as fh:
        while fh.tell() < mb << 20:
            for _ in range(100):
                n = int(rng.integers(50, 2000))
                words = lexicon[np.searchsorted(cdf, rng.random(n))]
                text = " ".join(np.char.add(words, punct[rng.integers(0, len(punct), n)]))
                fh.write(json.dumps({"text": text.capitalize()}) + "\n")
    tmp.rename(path)


def make_tokenizer(corpus: Path, directory: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    with open(corpus) as fh:
        sample = [json.loads(line)["text"] for line, _ in zip(fh, range(400), strict=False)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(sample, trainers.BpeTrainer(vocab_size=8192, special_tokens=[EOS], show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}))


def peer_python(venv: Path) -> Path:
    import tokenizers

    py = venv / "bin" / "python"
    if not py.exists() or subprocess.run([str(py), "-c", "import datasets"], capture_output=True).returncode:
        print(f"installing datasets into {venv} (separate venv) ...", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "datasets", f"tokenizers=={tokenizers.__version__}"],
                       check=True)
    return py


def run_tool(cmd: list[str], env: dict[str, str]) -> tuple[float, dict]:
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.monotonic() - t0
    if proc.returncode:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd[:4])} ...\n{proc.stderr[-2000:]}")
    return wall, json.loads(proc.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=300, help="corpus size (MiB of JSONL)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2, help="prepare-data --workers")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/prepare-bench"))
    ap.add_argument("--peers-venv", type=Path, default=Path("/tmp/prepare-peers-venv"))
    args = ap.parse_args()

    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    corpus, tok_dir = work / f"corpus-{args.mb}mb.jsonl", work / f"tok-{args.mb}mb"
    if not corpus.exists():
        print(f"generating {corpus} ...", file=sys.stderr, flush=True)
        make_corpus(corpus, args.mb)
    if not (tok_dir / "tokenizer.json").exists():
        make_tokenizer(corpus, tok_dir)
    peer = peer_python(args.peers_venv)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    out = work / "out"
    tools = {  # name -> (command, environment): `--workers` tokenizing threads each
        "prepare-data": ([sys.executable, "-m", "tasks.cli", "prepare-data", str(corpus), "--tokenizer", str(tok_dir),
                          "--dest", str(out), "--workers", str(args.workers)], env),
        "encode_batch loop": ([sys.executable, "-c", ENCODE_LOOP, str(corpus), str(tok_dir / "tokenizer.json")],
                              dict(env, RAYON_NUM_THREADS=str(args.workers))),
        "datasets.map": ([str(peer), "-c", DATASETS_MAP, str(corpus), str(tok_dir / "tokenizer.json"), str(out), EOS,
                          str(args.workers)], dict(env, TOKENIZERS_PARALLELISM="false")),
    }
    tokens: dict[str, int] = {}

    def side(name: str) -> Callable[[], Sample]:
        def run() -> Sample:
            shutil.rmtree(out, ignore_errors=True)
            load = os.getloadavg()[0]
            wall, result = run_tool(*tools[name])
            count = sum(result["tokens"].values()) if name == "prepare-data" else result["tokens"]
            tokens.setdefault(name, count)
            print(f"{name:18s} {wall:7.1f} s  {count / wall / 1e6:6.2f} M tokens/s  (load {load:.1f})", flush=True)
            return Sample(wall, load)

        return run

    load_before = os.getloadavg()
    walls = alternated("prepare", {name: side(name) for name in tools}, args.rounds)
    shutil.rmtree(out, ignore_errors=True)
    if len(set(tokens.values())) != 1:
        raise SystemExit(f"token counts differ: {tokens}")
    rate = {n: tokens[n] / median(w) for n, w in walls.items()}
    ours = rate["prepare-data"]
    for n, w in walls.items():
        print(f"{n:18s} wall {stats(w, fmt='.1f')}  {rate[n] / 1e6:6.2f} M tokens/s", flush=True)
    print(json.dumps({
        "corpus": f"{corpus.stat().st_size / 1e6:.0f} MB JSONL, {tokens['prepare-data']:,} tokens, "
                  f"{len(walls['prepare-data'])} rounds (medians), prepare-data --workers {args.workers}",
        "tokens_per_s": {n: round(r) for n, r in rate.items()},
        "median_wall_s": {n: round(median(w), 2) for n, w in walls.items()},
        "rounds_wall_s": {n: [round(s.value, 2) for s in w] for n, w in walls.items()},
        "load_at_each_run": {n: [round(s.load, 2) for s in w] for n, w in walls.items()},
        "ratio_vs_encode_batch_loop": round(ours / rate["encode_batch loop"], 3),
        "ratio_vs_datasets_map": round(ours / rate["datasets.map"], 3),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
    }, indent=2))


if __name__ == "__main__":
    main()
