"""A chat model's weekly retrain as a team serves it: conversations prepared with the model's own chat template,
trained on the assistant's turns, published, pulled, and rendered by transformers with the same template; the
served model answers in the trained format (a tiny overfit case: every assistant turn is one fixed reply, which
must be the greedy continuation of a prompt it never saw)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import yaml

from tasks.data.prepare.core import PrepareOptions, prepare
from tests.chat import LLAMA3, chat_tokenizer, sentence, write_chat_jsonl
from tests.models.test_hf_import_export import _config, make_hf_llama
from tests.test_weekly_retrain import retrainer, run

pytestmark = pytest.mark.multiproc

REPLY = "the model answers a short question"


def test_a_retrained_chat_model_answers_in_its_trained_format_when_served(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = make_hf_llama(tmp_path / "hf", vocab=512, layers=2, tokenizer=False)
    chat_tokenizer(base, LLAMA3)  # the team's tokenizer, its chat template beside it
    rng = random.Random(4)
    rows = [[{"role": "user", "content": sentence(rng, 6)}, {"role": "assistant", "content": REPLY}]
            for _ in range(96)]
    source = tmp_path / "store" / "chats"
    prepare(PrepareOptions(inputs=[str(write_chat_jsonl(tmp_path / "chats.jsonl", rows))], tokenizer=str(base),
                           dest=str(source), workers=1, heldout_fraction=0.2, chat=True, seq_len=128,
                           overlong="drop"))
    doc = _config(tmp_path, base)
    doc["parallel"] = {"tp": 1, "pp": 2, "dp": 1, "zero_stage": 1, "micro_batches": 2}
    doc["data"]["source_url"] = str(source)
    doc["train"].update(steps=60, checkpoint_every=60, lr=3e-3, warmup_steps=2, micro_batch_size=2)
    doc["model"]["seq_len"] = 128
    config = tmp_path / "chat.yaml"
    config.write_text(yaml.safe_dump(doc))
    db = doc["publish"]["registry_url"]
    assert retrainer("db", "upgrade", "--db", db, tmp=tmp_path).returncode == 0
    out = run(config, tmp_path)
    assert out["publish"]["version"] == 1 and out["train"]["final_loss"] < 0.1 * out["train"]["first_loss"]

    served = tmp_path / "serving"
    pulled = retrainer("registry", "pull", "--model", "team-llama", "--alias", "production", str(served),
                       "--db", db, tmp=tmp_path)
    assert pulled.returncode == 0, pulled.stderr[-2000:]
    tokenizer = AutoTokenizer.from_pretrained(served)
    model = AutoModelForCausalLM.from_pretrained(served).eval()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "why is the weather sunny"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    want = tokenizer(REPLY + "<|eot_id|>", add_special_tokens=False).input_ids
    with torch.no_grad():
        got = model.generate(**prompt, max_new_tokens=len(want), do_sample=False)
    assert tokenizer.decode(got[0, prompt["input_ids"].shape[1]:]) == REPLY + "<|eot_id|>"
