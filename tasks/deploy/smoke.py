"""The deploy smoke test's own process: `python -m tasks.deploy.smoke SPEC.json RESULT.json` (tasks/deploy/check.py).

It loads the pulled export with transformers as a server would (`device_map="auto"`: the layers spread over
every GPU of the serving host, then its CPU memory; transformers builds the model on the meta device and streams
each safetensors shard in, so no second full copy sits in host memory), scores the windows the version was
evaluated on (one window per forward, the log-softmax in float32 a chunk of positions at a time: no
`[batch, seq, vocab]` float32 logits) and greedily generates `generate_tokens` new tokens, each with finite logits.
It writes `{"loss", "tokens", "generated", "text", "devices", "load_s"}`, or `{"error": ...}` naming the step
that failed. A crash or an out-of-memory kill ends this process only; the caller reports it.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

_CHUNK = 1024  # positions whose float32 log-softmax is taken at once
_PROMPT_TOKENS = 16  # of the first evaluated window, when no text prompt is configured

DTYPES = {"auto": "auto", "fp32": "float32", "bf16": "bfloat16"}


class Failed(Exception):
    """A check failed; the message is the reason."""


def _step(what: str, fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except Failed:
        raise
    except Exception as exc:
        first = next(iter(str(exc).strip().splitlines()), "")
        raise Failed(f"{what}: {type(exc).__name__}: {first}") from exc


def load(spec: dict[str, Any]) -> Any:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar line per shard is noise in a task log
    dtype = DTYPES[spec["dtype"]]
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], device_map="auto",
                                                 dtype=dtype if dtype == "auto" else getattr(torch, dtype))
    return model.eval()


def held_out_loss(model: Any, windows: Any) -> tuple[float, int]:
    """Mean next-token NLL over the windows, summed in float64."""
    import torch
    import torch.nn.functional as F

    total, count = 0.0, 0
    device = model.device
    with torch.no_grad():
        for row in torch.from_numpy(windows):
            tokens = row.to(device)[None]
            logits = model(input_ids=tokens[:, :-1]).logits[0]
            targets = tokens[0, 1:]
            for at in range(0, targets.numel(), _CHUNK):
                part = logits[at:at + _CHUNK].float()
                total += F.cross_entropy(part, targets[at:at + _CHUNK].to(part.device), reduction="sum").double().item()
            count += targets.numel()
    loss = total / count
    if not math.isfinite(loss):
        raise Failed(f"held-out loss is not finite ({loss})")
    return loss, count


def prompt_ids(spec: dict[str, Any], windows: Any, model: Any) -> tuple[list[int], Any]:
    """The prompt's token ids (and the tokenizer, when there is one to decode with)."""
    model_dir = Path(spec["model_dir"])
    tokenizer = None
    if (model_dir / "tokenizer.json").is_file() or (model_dir / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if spec["prompt"] is not None:
        if tokenizer is None:
            raise Failed("deploy.smoke_test.prompt is set but the export has no tokenizer to encode it")
        ids = tokenizer(spec["prompt"], add_special_tokens=True)["input_ids"]
    elif windows is not None:
        ids = [int(t) for t in windows[0][:_PROMPT_TOKENS]]
    else:
        bos = model.config.bos_token_id
        ids = [int(bos) if bos is not None else 0]
    if not ids:
        raise Failed("the prompt encodes to no tokens")
    return ids, tokenizer


def generate(model: Any, ids: list[int], n: int) -> list[int]:
    import torch

    prompt = torch.tensor([ids], device=model.device)
    with torch.no_grad():
        out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n,
                             min_new_tokens=n, do_sample=False, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=model.config.eos_token_id if model.config.eos_token_id is not None else 0)
    new = out.sequences[0, len(ids):].tolist()
    if len(new) != n:
        raise Failed(f"generated {len(new)} tokens, asked for {n}")
    bad = [i for i, step in enumerate(out.logits) if not torch.isfinite(step).all()]
    if bad:
        raise Failed(f"non-finite logits while generating token {bad[0] + 1} of {n}")
    return new


def run(spec: dict[str, Any]) -> dict[str, Any]:
    import numpy as np

    started = time.monotonic()
    model = _step("loading the export with transformers", load, spec)
    load_s = time.monotonic() - started
    devices = sorted({str(d) for d in getattr(model, "hf_device_map", {}).values()} or {str(model.device)})
    windows = np.load(spec["windows"]) if spec["windows"] else None
    result: dict[str, Any] = {"loss": None, "tokens": 0, "devices": devices, "load_s": round(load_s, 3)}
    if windows is not None:
        result["loss"], result["tokens"] = _step("scoring the held-out windows", held_out_loss, model, windows)
    ids, tokenizer = _step("encoding the prompt", prompt_ids, spec, windows, model)
    result["generated"] = _step("generating", generate, model, ids, spec["generate_tokens"])
    result["text"] = tokenizer.decode(result["generated"]) if tokenizer is not None else None
    return result


def main(argv: list[str]) -> int:
    spec_path, out_path = argv
    spec = json.loads(Path(spec_path).read_text())
    try:
        result = run(spec)
    except Failed as exc:
        Path(out_path).write_text(json.dumps({"error": str(exc)}))
        print(f"failed: {exc}", file=sys.stderr)
        return 1
    Path(out_path).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
