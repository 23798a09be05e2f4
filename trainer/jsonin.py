"""JSON a user hands `dflash` (prompts, manifests, GPU facts, recon reports): the one place it is parsed.

`json.loads` raises more than `ValueError` on hostile input: `[` * 100000 is a `RecursionError`, and a
lone surrogate (`"\\ud800"`) parses into a string that fails later, when it is written as UTF-8. `loads`
turns both into `BadJson`, a `json.JSONDecodeError` (so a `ValueError`): every reader that already
refuses "not valid JSON" refuses these too, with its own message naming the file. `load_file` and
`expect` add the missing-file and wrong-shape refusals for readers that have no error class of their
own. Light side: stdlib only."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from trainer.errors import DflashError

# a \\uD800-\\uDFFF escape: only then can a lone surrogate be in the result (fast path for the rest)
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_SURROGATE = re.compile("[\ud800-\udfff]")


class BadJson(json.JSONDecodeError):
    """Input that parses into no usable JSON value: nested too deeply, or a lone surrogate."""

    def __str__(self) -> str:  # no "line 1 column 1": the whole value is the trouble
        return self.msg


class JsonInputError(DflashError, ValueError):
    """A JSON input that cannot be used (missing, not UTF-8, not JSON, the wrong shape): exit 2."""


def loads(text: str | bytes) -> Any:
    """`json.loads`, with hostile nesting and lone surrogates refused as `BadJson` (a ValueError)."""
    if isinstance(text, bytes | bytearray):
        text = text.decode("utf-8")  # UnicodeDecodeError: a ValueError, as json.loads's own
    try:
        value = json.loads(text)
    except RecursionError:
        raise BadJson("nested too deeply", text[:0], 0) from None
    if _SURROGATE_ESCAPE.search(text):
        m = _SURROGATE.search(json.dumps(value, ensure_ascii=False))
        if m:
            raise BadJson(
                f"a lone surrogate \\u{ord(m.group()):04x}, half of a UTF-16 pair: not text",
                text[:0],
                0,
            )
    return value


def reason(exc: ValueError) -> str:
    """What was wrong, in a few words: the decoder's message without the line/column noise for ours."""
    if isinstance(exc, json.JSONDecodeError):
        return exc.msg if isinstance(exc, BadJson) else f"{exc.msg}: line {exc.lineno} column {exc.colno}"
    if isinstance(exc, UnicodeDecodeError):
        return f"not UTF-8 text (byte {exc.start})"
    return str(exc)


def parse(text: str | bytes, what: str) -> Any:
    """`loads`, refusing with `JsonInputError` that names `what` (an option, a file)."""
    try:
        return loads(text)
    except ValueError as exc:
        raise JsonInputError(f"{what}: not valid JSON ({reason(exc)})") from None


def load_file(path: str | Path, what: str | None = None) -> Any:
    """The JSON value in the file `path` (`what`: how messages name it; default the path)."""
    p = Path(path)
    what = what or str(p)
    if p.is_dir():
        raise JsonInputError(f"{what} is a folder, not a JSON file")
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise JsonInputError(f"{what} does not exist") from None
    except OSError as exc:
        raise JsonInputError(f"{what}: cannot read it: {exc.strerror}") from None
    return parse(raw, what)


def expect(value: Any, kind: type, what: str) -> Any:
    """`value` when it is a `kind` (dict: a JSON object, list: an array); else a clear refusal."""
    names = {dict: "a JSON object", list: "a JSON array", str: "a string"}
    if not isinstance(value, kind):
        got = {dict: "an object", list: "an array", str: "a string", type(None): "null"}.get(
            type(value), type(value).__name__
        )
        raise JsonInputError(f"{what}: expected {names.get(kind, kind.__name__)}, got {got}")
    return value
