"""Write configs/tiny-chat/tokenizer/: the chat demo model's tokenizer (a byte-level BPE trained on the demo's own
synthetic conversations) and its Llama-3-style chat template, whose `{% generation %}` markers tell prepare-data
which tokens are the assistant's. Checked in; run again only to change it:
`.venv/bin/python scripts/tiny_chat_tokenizer.py`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from tasks.data.synthetic import synthetic_conversations  # noqa: E402

BOS, EOS, EOT = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"
SPECIALS = [BOS, EOS, "<|start_header_id|>", "<|end_header_id|>", EOT]
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}<|eot_id|>{% endgeneration %}"
    "{% else %}{{ message['content'] }}<|eot_id|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def main() -> None:
    dest = ROOT / "configs" / "tiny-chat" / "tokenizer"
    dest.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=[AddedToken(s, special=True) for s in SPECIALS],
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = [m["content"] for conv in synthetic_conversations(2000, seed=0) for m in conv]
    tok.train_from_iterator([*texts, "system", "user", "assistant"], trainer)
    tok.save(str(dest / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOT, "pad_token": EOS, "chat_template": TEMPLATE,
              "model_max_length": 256, "tokenizer_class": "PreTrainedTokenizerFast"}
    (dest / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"{dest}: {tok.get_vocab_size()} tokens")


if __name__ == "__main__":
    main()
