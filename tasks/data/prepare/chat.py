"""Conversations -> tokens + a per-token loss mask, rendered with the model's own chat template.

Why the model's template: a model trained on text rendered any other way learns a format its server never
sends. The template is the tokenizer directory's `chat_template.jinja`, else `tokenizer_config.json`'s
`chat_template` (the default one of a list), as transformers loads it; it is rendered by transformers' own
Jinja renderer, so the text is the bytes `apply_chat_template` gives, and tokenized with the same tokenizer
(no special-token template: the chat template writes its own).

The mask (1 = an assistant token, trained on) marks every token overlapping an assistant span of the text
(transformers' `return_assistant_tokens_mask` rule). The spans come from the template's `{% generation %}`
markers where it has them (mask rule "generation"), else from rendered prefixes (mask rule "prefix"): the
span of assistant message i runs from the end of render(messages[:i], add_generation_prompt=True) to the end
of render(messages[:i + 1]), both of which must be prefixes of the whole conversation's text.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.base.errors import InvalidInputError
from tasks.data.manifest import MaskRule
from tasks.data.prepare.tokenizer import configured_token

TEMPLATE_FILE, CONFIG_FILE = "chat_template.jinja", "tokenizer_config.json"
ROLES = ("system", "user", "assistant", "tool")
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


class BadConversation(ValueError):
    """A row that cannot be rendered (a bad row, counted and skipped)."""


@dataclass(frozen=True)
class ChatTemplate:
    text: str
    sha256: str  # of the template's UTF-8 text: the manifest records it
    mask_rule: MaskRule
    variables: tuple[tuple[str, str], ...]  # bos_token / eos_token as the template sees them


def load_template(tokenizer_dir: Path) -> ChatTemplate:
    """The tokenizer directory's chat template; none is an error (a chat dataset needs the model's own)."""
    file = tokenizer_dir / TEMPLATE_FILE
    text: Any = file.read_text() if file.is_file() else None
    if text is None and (config := tokenizer_dir / CONFIG_FILE).is_file():
        try:
            text = json.loads(config.read_text()).get("chat_template")
        except (OSError, ValueError, AttributeError) as exc:
            raise InvalidInputError(f"{config}: cannot read chat_template: {exc}") from None
        if isinstance(text, list):  # named templates: [{"name": "default", "template": "..."}, ...]
            text = next((t.get("template") for t in text if isinstance(t, dict) and t.get("name") == "default"), None)
    if not isinstance(text, str) or not text:
        raise InvalidInputError(f"{tokenizer_dir}: no chat template ({TEMPLATE_FILE}, or chat_template in "
                                f"{CONFIG_FILE}): a chat dataset is rendered with the model's own")
    variables = tuple((key, value) for key in ("bos_token", "eos_token")
                      if (value := configured_token(tokenizer_dir, key)) is not None)
    return ChatTemplate(text=text, sha256=hashlib.sha256(text.encode()).hexdigest(),
                        mask_rule="generation" if _GENERATION.search(text) else "prefix", variables=variables)


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI-style messages: a non-empty list of objects, each with a known `role`."""
    if not isinstance(messages, list) or not messages:
        raise BadConversation(f"messages is not a non-empty list (got {type(messages).__name__})")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadConversation(f"message {i} is not an object")
        if message.get("role") not in ROLES:
            raise BadConversation(f"message {i} has role {message.get('role')!r}, not one of {', '.join(ROLES)}")
    return messages


def has_assistant(messages: list[dict[str, Any]]) -> bool:
    return any(m["role"] == "assistant" for m in messages)


def render(template: ChatTemplate, messages: list[dict[str, Any]]) -> tuple[str, list[tuple[int, int]]]:
    """The conversation's text and its assistant spans [start, end) in characters."""
    from jinja2 import TemplateError
    from transformers.utils.chat_template_utils import render_jinja_template

    def text_of(part: list[dict[str, Any]], prompt: bool = False, spans: bool = False) -> tuple[str, Any]:
        out, indices = render_jinja_template([part], chat_template=template.text, add_generation_prompt=prompt,
                                             return_assistant_tokens_mask=spans, **dict(template.variables))
        return out[0], indices[0] if indices else []

    try:
        if template.mask_rule == "generation":
            text, spans = text_of(messages, spans=True)
            return text, [(int(a), int(b)) for a, b in spans]
        text, _ = text_of(messages)
        found = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before, _ = text_of(messages[:i], prompt=True)
            through, _ = text_of(messages[:i + 1])
            if not (through.startswith(before) and text.startswith(through)):
                raise BadConversation(f"the template does not render assistant message {i} as an extension of "
                                      "the conversation before it (mask rule 'prefix' needs that)")
            found.append((len(before), len(through)))
        return text, found
    except TemplateError as exc:
        raise BadConversation(f"the chat template refused it: {exc}") from None


def assistant_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for every token whose character range overlaps a span (spans and tokens both in order)."""
    mask, span = [0] * len(offsets), 0
    for token, (start, end) in enumerate(offsets):
        while span < len(spans) and start >= spans[span][1]:
            span += 1
        if span == len(spans):
            break
        if end > spans[span][0]:
            mask[token] = 1
    return mask
