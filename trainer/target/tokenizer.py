"""What a model folder's tokenizer files say about token ids, read as JSON (no tokenizers/transformers):
how many ids the tokenizer produces, its added tokens, the ids of its pad/bos/eos/unk/mask tokens and
its chat template. trainer/target/info.py reads the folder's config.json and weights; this reads
tokenizer.json, tokenizer_config.json and chat_template.jinja / chat_template.json.

Used where the mask token is chosen (`dflash init`, trainer/run_init.py) and checked (`dflash
preflight`, trainer/preflight/drafter.py). Light side: stdlib only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROLES = ("pad", "bos", "eos", "unk", "mask")


def _load(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None


def _content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _template_text(folder: Path, conf: dict[str, Any]) -> str:
    parts: list[str] = []
    raw = conf.get("chat_template")
    if isinstance(raw, str):
        parts.append(raw)
    elif isinstance(raw, list):  # [{"name": ..., "template": ...}]
        parts.extend(t["template"] for t in raw if isinstance(t, dict) and isinstance(t.get("template"), str))
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        try:
            parts.append(jinja.read_text())
        except (OSError, UnicodeDecodeError):
            pass
    extra = _load(folder / "chat_template.json")
    if isinstance(extra, dict) and isinstance(extra.get("chat_template"), str):
        parts.append(extra["chat_template"])
    return "\n".join(parts)


@dataclass(frozen=True)
class TokenizerFiles:
    """The token-id facts of a tokenizer folder.

    `size`: one past the highest id it can produce (its base vocabulary and added tokens); None when
    the base vocabulary is not in tokenizer.json (a sentencepiece `tokenizer.model` only: where its ids
    end is unknown here). `added`: id -> (content, special) of its added tokens. `role_ids`:
    "pad"/"bos"/"eos"/"unk"/"mask" -> id, where the tokenizer names one. `chat_template`: every
    template text it ships (empty when none)."""

    size: int | None
    added: dict[int, tuple[str, bool]] = field(default_factory=dict)
    role_ids: dict[str, int] = field(default_factory=dict)
    chat_template: str = ""

    @classmethod
    def from_folder(cls, folder: Path) -> TokenizerFiles | None:
        """None when `folder` has no readable tokenizer.json or tokenizer_config.json."""
        folder = Path(folder)
        tok = _load(folder / "tokenizer.json")
        conf = _load(folder / "tokenizer_config.json")
        tok = tok if isinstance(tok, dict) else {}
        conf = conf if isinstance(conf, dict) else {}
        if not tok and not conf:
            return None
        ids: set[int] = set()
        model = tok.get("model")
        vocab = model.get("vocab") if isinstance(model, dict) else None
        if isinstance(vocab, dict):  # BPE, WordPiece, WordLevel: token -> id
            ids.update(int(i) for i in vocab.values() if isinstance(i, int))
        elif isinstance(vocab, list):  # Unigram: [[piece, score], ...], the id is the position
            ids.update(range(len(vocab)))
        added: dict[int, tuple[str, bool]] = {}
        for entry in tok.get("added_tokens") or []:
            if isinstance(entry, dict) and isinstance(entry.get("id"), int):
                added[entry["id"]] = (str(entry.get("content", "")), bool(entry.get("special", False)))
        for key, entry in (conf.get("added_tokens_decoder") or {}).items():
            if str(key).isdigit() and isinstance(entry, dict):
                added.setdefault(int(key), (str(entry.get("content", "")), bool(entry.get("special", False))))
        ids.update(added)
        by_content = {content: i for i, (content, _) in added.items()}
        if isinstance(vocab, dict):
            by_content = {**{t: i for t, i in vocab.items() if isinstance(i, int)}, **by_content}
        roles: dict[str, int] = {}
        for role in ROLES:
            name = _content(conf.get(f"{role}_token"))
            if name is not None and name in by_content:
                roles[role] = by_content[name]
        return cls(
            size=max(ids) + 1 if isinstance(vocab, (dict, list)) and ids else None,
            added=added,
            role_ids=roles,
            chat_template=_template_text(folder, conf),
        )

    def in_template(self, token_id: int) -> bool:
        """Whether the added token `token_id` is written by the chat template (then every chat sample
        holds it). Contents shorter than three characters or only whitespace are not looked for: they
        would match any template text."""
        content = self.added.get(token_id, ("", False))[0]
        return len(content.strip()) >= 3 and content in self.chat_template
