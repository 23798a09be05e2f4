"""Multi-turn conversations: every assistant turn is the target's.

The rule (speculators' `regenerate_conversation`, speculators/cli/regenerate_responses.py, and
SpecForge's regeneration do the same): the system and user turns of a conversation drive it, its
original assistant turns are dropped. Round r answers user turn r+1: the prompt is the conversation up
to that user turn through the chat template, with the target's own answers of rounds 0..r-1 as the
assistant turns before it (rendered by the template as history, which is how serving sees them: a
Qwen3 template drops the reasoning of turns before the last user turn, exactly as it does for a
served conversation). Each round's answer is one sample (loss mask over that answer only), so a
conversation of k user turns gives k samples. A conversation goes no further after an answer that
is empty or was cut at --max-new-tokens (speculators stops a conversation that ran out of tokens):
its later turns are counted as not reached. Light at import."""

from __future__ import annotations

from typing import Any


def rounds(line) -> int:
    """How many answers a prompt line asks for: its user turns (a `messages` line), else 1."""
    if line.kind != "messages":
        return 1
    return sum(1 for m in line.value if m["role"] == "user")


def round_messages(messages: list[dict[str, Any]], r: int, answers: list[str]) -> list[dict[str, Any]]:
    """The conversation up to its user turn r (0-based), the original assistant turns replaced by
    `answers` (the target's answers to user turns 0..r-1)."""
    out: list[dict[str, Any]] = []
    user = -1
    for m in messages:
        if m["role"] == "assistant":
            continue
        if m["role"] == "user":
            user += 1
            if user > r:
                break
            if user > 0:
                out.append({"role": "assistant", "content": answers[user - 1]})
        out.append(dict(m))
    return out


def answer_text(row: dict[str, Any], tokenizer) -> str:
    """The target's answer of a finished sample as the text a client sends back: the response tokens
    without the stop token, decoded with special tokens kept (the template decides what to show)."""
    plen = row["loss_mask"].index(1) if 1 in row["loss_mask"] else len(row["loss_mask"])
    resp = row["input_ids"][plen:]
    if row.get("stopped") and resp:
        resp = resp[:-1]
    return tokenizer.decode(resp, skip_special_tokens=False).strip()


def goes_on(row: dict[str, Any], stop_rule: bool = True) -> bool:
    """Whether the conversation continues after this answer: not empty, and ended by a stop token."""
    return (bool(row.get("stopped")) or not stop_rule) and not row.get("empty")
