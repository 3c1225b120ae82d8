"""`retrainer demo --chat`: a team's chat model retrained on two weeks of conversations, then served.

What such a team does, in order: its model (a Hugging Face directory with its tokenizer and chat template; here a
tiny random Llama with configs/tiny-chat/tokenizer) is where `model.pretrained` points; each week's conversations
are prepared with that tokenizer (`prepare-data --chat`) at `data.source_url`, and the same config retrains on the
assistant's turns only; the gate compares the held-out conversations' assistant-token loss and a generation check
(an lm-evaluation-harness task rendered with the chat template) with the live version; the published version,
pulled and rendered with its own template by transformers, answers a question in the trained format.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from tasks import REPO_ROOT

if TYPE_CHECKING:
    from tasks.config.schema import JobConfig

CONFIG = REPO_ROOT / "configs" / "tiny-chat" / "job.yaml"  # not configs/*.yaml: no DAG until the model exists
TOKENIZER = REPO_ROOT / "configs" / "tiny-chat" / "tokenizer"  # scripts/tiny_chat_tokenizer.py wrote it
QUESTION = "What does the baker do?"


def write_base_model(dest: Path) -> None:
    """The team's model for the demo: a tiny random Llama, saved by transformers, with the shipped tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if (dest / "config.json").is_file():
        return
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         tie_word_embeddings=False)
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    LlamaForCausalLM(config).save_pretrained(tmp)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(TOKENIZER / name, tmp / name)
    tmp.rename(dest)


def new_week_of_conversations(cfg: JobConfig, week: int) -> None:
    """This week's conversations (JSONL) prepared with the model's own tokenizer and chat template."""
    from tasks.data.prepare.core import PrepareOptions, prepare
    from tasks.data.synthetic import synthetic_conversations

    assert cfg.model.pretrained is not None
    rows = Path(cfg.data.cache_dir).parent / "incoming" / f"chats-week{week}.jsonl"
    rows.parent.mkdir(parents=True, exist_ok=True)
    rows.write_text("".join(json.dumps({"messages": c}) + "\n" for c in synthetic_conversations(600, seed=week)))
    prepare(PrepareOptions(inputs=[str(rows)], tokenizer=cfg.model.pretrained, dest=cfg.data.source_url,
                           workers=1, heldout_fraction=0.1, chat=True, seq_len=cfg.model.seq_len, overlong="drop",
                           overwrite=True, storage_options=cfg.data.storage_options))


def answer(cfg: JobConfig, directory: Path) -> str:
    """The live version's reply to `QUESTION`, as a server renders and generates it (transformers)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tasks.config.endpoints import registry_for
    from tasks.registry import ArtifactStore

    live = registry_for(cfg).live_version(cfg.publish.model_name, cfg.publish.alias)
    assert live is not None
    path = ArtifactStore(cfg.publish.store_url, cfg.publish.storage_options).get_tree(live.artifact_digest, directory)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=24, do_sample=False)
    return tokenizer.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)


def chat_demo(config: str | None) -> int:
    import tempfile

    from tasks.cli.demo_week import run_week
    from tasks.config.load import expand_vars, read_config_document
    from tasks.data.synthetic import chat_facts, write_chat_eval
    from tasks.models.resolve import load_config
    from tasks.registry import upgrade

    path = Path(config) if config else CONFIG
    document = expand_vars(read_config_document(path), str(path))
    write_base_model(Path(document["model"]["pretrained"]))  # the team's model, before the config reads it
    cfg = load_config(path)
    upgrade(cfg.publish.registry_url)
    for bench in cfg.evaluate.benchmarks:
        if bench.include_path is not None:
            write_chat_eval(Path(bench.include_path))
    for week in (1, 2):
        new_week_of_conversations(cfg, week)
        run_week(cfg, f"week {week}: new conversations at {cfg.data.source_url} (init_from: {cfg.train.init_from})")
    with tempfile.TemporaryDirectory(prefix="retrainer-serve-") as tmp:
        reply = answer(cfg, Path(tmp) / "live")
    print(f"== served: {cfg.publish.model_name} on {cfg.publish.alias}, rendered with its own chat template")
    print(f"   user: {QUESTION}\n   assistant: {reply}\n   (trained answer: {chat_facts()['the baker']})")
    return 0
