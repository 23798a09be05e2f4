"""`dflash prompts`: chat datasets into the prompt lines `dflash regenerate` reads.

Formats: `sharegpt` (`conversations: [{from: human|gpt|system, value}]`), `ultrachat` (`messages:
[{role, content}]`, or its `data: [user, assistant, user, ...]` list), `messages` (OpenAI chat:
`messages: [{role, content}]`, content a string or a list of text parts) and `prompt` (`prompt`, or
`instruction` + `input`, or `question`: one user turn). Input: JSON lines, a folder written by
`datasets.save_to_disk` (a `DatasetDict` needs its split) or a parquet file.

Each kept row becomes `{"messages": [...]}`: system and user turns, the original assistant turns
between them (the history `dflash eval` shows; `dflash regenerate` replaces each with the target's own
answer, trainer/regenerate/turns.py), never an assistant turn after the last user turn (that is the
answer the target writes; it is dropped, so no row is "answered" twice). Empty turns are dropped and
turns of the same role that then follow each other are joined; a row left without a user turn is
dropped. `thinking` (`--thinking on|off`, or the row's own `enable_thinking`/`thinking`) is written per
row: it becomes the chat template's enable_thinking for that row. The report (JSON beside the output,
a summary printed) counts rows read, kept and dropped, per reason with a few examples.

Bad input (not JSON, a row that is not an object, a row without the format's field, a field of the
wrong type) is refused with the line or row named (exit 2); the output is written atomically. Light:
`datasets`/`pyarrow` only for a folder or a parquet file."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trainer import jsonin
from trainer.errors import DflashError
from trainer.store.fsutil import atomic_write_text

FORMATS = ("sharegpt", "ultrachat", "messages", "prompt")
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
    "system": "system",
}
CHAT_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
EXAMPLES = 3  # examples kept per drop reason in the report


class PromptsError(DflashError, ValueError):
    """An input that cannot be converted; the message names the file and the line or row."""


class Drop(Exception):
    """A row left out (not an error): the reason is counted in the report."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason)
        self.reason, self.detail = reason, detail


def read_rows(path: Path, split: str | None = None) -> Iterator[tuple[str, Any]]:
    """(where, row) for each row: `FILE:LINE` for JSON lines, `FILE row N` (1-based) otherwise."""
    path = Path(path)
    if path.is_dir():
        yield from _dataset_rows(path, split)
    elif not path.is_file():
        raise PromptsError(f"{path} does not exist (a .jsonl file, a parquet file or a save_to_disk folder)")
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(str(path))
        except Exception as exc:  # noqa: BLE001 - pyarrow's errors name the trouble
            raise PromptsError(f"{path}: not a readable parquet file ({exc})") from None
        for n, row in enumerate(table.to_pylist(), 1):
            yield f"{path} row {n}", row
    else:
        with path.open(encoding="utf-8") as fh:
            try:
                for lineno, raw in enumerate(fh, 1):
                    if not raw.strip():
                        continue
                    try:
                        yield f"{path}:{lineno}", jsonin.loads(raw)
                    except json.JSONDecodeError as exc:
                        raise PromptsError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            except UnicodeDecodeError as exc:
                raise PromptsError(f"{path}: not UTF-8 text (byte {exc.start})") from None


def _dataset_rows(path: Path, split: str | None) -> Iterator[tuple[str, Any]]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as exc:  # noqa: BLE001 - datasets' own message says what it found
        raise PromptsError(f"{path}: not a datasets.save_to_disk folder ({exc})") from None
    if isinstance(ds, datasets.DatasetDict):
        names = sorted(ds)
        if split is None and len(names) == 1:
            split = names[0]
        if split not in ds:
            raise PromptsError(
                f"{path}: a DatasetDict with splits {', '.join(names)}: choose one with --split"
            )
        ds = ds[split]
    for n, row in enumerate(ds, 1):
        yield f"{path} row {n}", row


def _text(where: str, value: Any, what: str) -> str:
    """A turn's text: a string, or OpenAI content parts of type text (joined); None is empty."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) for p in value):
        if any(p.get("type") not in ("text", None) for p in value):
            raise Drop(
                "non-text content", f"{what}: parts of type {sorted({str(p.get('type')) for p in value})}"
            )
        return "".join(str(p.get("text") or "") for p in value)
    raise PromptsError(f"{where}: {what} must be a string, not {type(value).__name__}")


def _field(where: str, row: Any, fmt: str, *names: str) -> tuple[str, Any]:
    if not isinstance(row, dict):
        raise PromptsError(f"{where}: each row must be a JSON object, not {type(row).__name__}")
    for name in names:
        if name in row and row[name] is not None:
            return name, row[name]
    raise PromptsError(
        f"{where}: --format {fmt} needs a {' or '.join(repr(n) for n in names)} field; this row has "
        f"{', '.join(sorted(map(str, row))) or 'no fields'} (is --format right?)"
    )


def turns_of(where: str, row: Any, fmt: str) -> list[dict[str, str]]:
    """The row's turns as {role, content} with role system|user|assistant; raises Drop or PromptsError."""
    if fmt == "prompt":
        name, value = _field(where, row, fmt, "prompt", "instruction", "question")
        text = _text(where, value, name)
        if name == "instruction" and row.get("input"):
            text = f"{text}\n\n{_text(where, row['input'], 'input')}"
        return [{"role": "user", "content": text}]
    if fmt == "sharegpt":
        _, conv = _field(where, row, fmt, "conversations")
        key_role, key_text, roles = "from", "value", SHAREGPT_ROLES
    else:
        name, conv = _field(where, row, fmt, *(("messages", "data") if fmt == "ultrachat" else ("messages",)))
        if name == "data":  # UltraChat's list form: user, assistant, user, ...
            if not isinstance(conv, list) or not all(isinstance(t, str) for t in conv):
                raise PromptsError(f"{where}: 'data' must be a list of strings (user, assistant, ...)")
            return [{"role": ("user", "assistant")[k % 2], "content": t} for k, t in enumerate(conv)]
        key_role, key_text, roles = "role", "content", CHAT_ROLES
    if not isinstance(conv, list):
        raise PromptsError(f"{where}: the turns must be a list, not {type(conv).__name__}")
    out = []
    for k, turn in enumerate(conv):
        if not isinstance(turn, dict) or key_role not in turn:
            raise PromptsError(f"{where}: turn {k + 1} must be an object with {key_role!r} and {key_text!r}")
        role = roles.get(str(turn[key_role]).lower())
        if role is None:
            raise Drop(f"unsupported role {turn[key_role]!r}", f"turn {k + 1}")
        out.append({"role": role, "content": _text(where, turn.get(key_text), f"turn {k + 1}")})
    return out


def clean(turns: list[dict[str, str]], counts: dict[str, int]) -> list[dict[str, str]]:
    """Empty turns out, same-role neighbours joined, assistant turns after the last user turn out."""
    kept: list[dict[str, str]] = []
    for t in turns:
        if not t["content"].strip():
            counts["empty turns dropped"] += 1
            continue
        if kept and kept[-1]["role"] == t["role"]:
            counts["same-role turns joined"] += 1
            kept[-1] = {"role": t["role"], "content": kept[-1]["content"] + "\n\n" + t["content"]}
            continue
        kept.append(dict(t))
    users = [i for i, t in enumerate(kept) if t["role"] == "user"]
    if not kept:
        raise Drop("empty row")
    if not users:
        raise Drop("no user turn")
    if users[-1] != len(kept) - 1:
        counts["rows ending on an assistant turn (that turn is regenerated, not answered)"] += 1
        kept = kept[: users[-1] + 1]
    return kept


def _thinking(where: str, row: Any, default: str | None) -> str | None:
    value = row.get("enable_thinking", row.get("thinking")) if isinstance(row, dict) else None
    if value is None:
        return default
    if value in (True, "on", "true"):
        return "on"
    if value in (False, "off", "false"):
        return "off"
    raise PromptsError(f"{where}: enable_thinking/thinking must be true/false or on/off, not {value!r}")


def convert(
    src: Path,
    fmt: str,
    out: Path,
    *,
    thinking: str | None = None,
    split: str | None = None,
    limit: int | None = None,
    report_path: Path | None = None,
) -> dict[str, Any]:
    """Write OUT (prompt lines) and the report; returns the report."""
    if fmt not in FORMATS:
        raise PromptsError(f"--format {fmt!r}: choose one of {', '.join(FORMATS)}")
    rows_out: list[str] = []
    read = 0
    dropped: dict[str, dict[str, Any]] = {}
    counts: dict[str, int] = {
        "empty turns dropped": 0,
        "same-role turns joined": 0,
        "rows ending on an assistant turn (that turn is regenerated, not answered)": 0,
    }
    user_turns = multi = 0
    for where, row in read_rows(src, split):
        if limit is not None and len(rows_out) >= limit:
            break
        read += 1
        try:
            msgs = clean(turns_of(where, row, fmt), counts)
        except Drop as d:
            entry = dropped.setdefault(d.reason, {"count": 0, "examples": []})
            entry["count"] += 1
            if len(entry["examples"]) < EXAMPLES:
                entry["examples"].append(f"{where}" + (f" ({d.detail})" if d.detail else ""))
            continue
        n_users = sum(1 for m in msgs if m["role"] == "user")
        user_turns += n_users
        multi += n_users > 1
        line: dict[str, Any] = {"messages": msgs}
        th = _thinking(where, row, thinking)
        if th is not None:
            line["thinking"] = th
        rows_out.append(json.dumps(line, ensure_ascii=False))
    if not rows_out:
        raise PromptsError(
            f"{src}: no row could be used ({read} read; dropped: "
            + (", ".join(f"{k} {v['count']}" for k, v in dropped.items()) or "none")
            + ")"
        )
    atomic_write_text(Path(out), "".join(r + "\n" for r in rows_out))
    report = {
        "input": str(src),
        "format": fmt,
        "out": str(out),
        "rows_read": read,
        "rows_kept": len(rows_out),
        "multi_turn_rows": multi,
        "answers_to_regenerate": user_turns,
        "thinking": thinking,
        "rows_dropped": sum(v["count"] for v in dropped.values()),
        "dropped": dropped,
        "turns": counts,
    }
    rp = Path(report_path) if report_path else Path(out).with_name(Path(out).name + ".report.json")
    atomic_write_text(rp, json.dumps(report, indent=1))
    report["report"] = str(rp)
    return report


def summary(report: dict[str, Any]) -> str:
    lines = [
        f"dflash prompts: {report['rows_kept']} of {report['rows_read']} rows kept "
        f"({report['multi_turn_rows']} multi-turn; {report['answers_to_regenerate']} answers for the target "
        f"to write) -> {report['out']}"
    ]
    for reason, v in report["dropped"].items():
        lines.append(f"  dropped {v['count']}: {reason} (e.g. {'; '.join(v['examples'])})")
    for what, n in report["turns"].items():
        if n:
            lines.append(f"  {what}: {n}")
    lines.append(f"  report: {report['report']}")
    return "\n".join(lines)
