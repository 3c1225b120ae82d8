"""Chat test material: a real BPE tokenizer with chat special tokens, two small chat templates (a Llama-3-style one
with `{% generation %}` markers, a Qwen-style one without) and seeded conversations."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

BOS, EOS = "<|begin_of_text|>", "<|endoftext|>"
SPECIALS = [EOS, BOS, "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|im_start|>", "<|im_end|>"]
WORDS = ["the", "model", "answers", "a", "short", "question", "about", "harbours", "and", "songs", "why", "how",
         "please", "thanks", "café", "東京", "🙂", "42", "tool", "result", "weather", "is", "sunny"]

LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}<|eot_id|>{% endgeneration %}"
    "{% else %}{{ message['content'] }}<|eot_id|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
QWEN = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# What ends an assistant span in each template (the span is the content and this).
SPAN_END = {"llama3": "<|eot_id|>", "qwen": "<|im_end|>\n"}


def sentence(rng: random.Random, most: int = 12) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, most)))


def conversations(n: int, seed: int, most: int = 12) -> list[list[dict[str, Any]]]:
    """Seeded conversations: an optional system turn, 1-3 user/assistant exchanges, sometimes a tool turn."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        messages = [{"role": "system", "content": sentence(rng, most)}] if rng.random() < 0.5 else []
        for _ in range(rng.randint(1, 3)):
            messages.append({"role": "user", "content": sentence(rng, most)})
            if rng.random() < 0.2:
                messages.append({"role": "tool", "content": sentence(rng, most)})
            messages.append({"role": "assistant", "content": sentence(rng, most)})
        out.append(messages)
    return out


def chat_tokenizer(directory: Path, template: str, *, jinja_file: bool = False) -> Path:
    """A byte-level BPE with the chat special tokens; the template in tokenizer_config.json or chat_template.jinja."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=[AddedToken(s, special=True) for s in SPECIALS],
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    rng = random.Random(0)
    tok.train_from_iterator([sentence(rng) for _ in range(300)], trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config: dict[str, Any] = {"eos_token": EOS, "bos_token": BOS}
    if jinja_file:
        (directory / "chat_template.jinja").write_text(template)
    else:
        config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def write_chat_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps({"messages": r}) + "\n" for r in rows))
    return path
