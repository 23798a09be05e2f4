"""Named benchmark sets fetched from the Hugging Face Hub: `dflash eval --prompts gsm8k` (and regenerate).

The anchors (DFlash, EAGLE-3, SpecForge, speculators) report τ on MT-Bench, GSM8K, MATH-500, HumanEval
and Alpaca. HumanEval ships in a PyPI package (trainer/eval/prompts.py); the others are dataset
repos on the Hub. One table, `BENCHMARKS`, says for each name which repo, revision, file and column
become the prompts (docs/evaluate.md prints the same table):

- `mt-bench`: HuggingFaceH4/mt_bench_prompts @ main, raw/question.jsonl, column `prompt` (a list:
  the first of its two turns; `turns` in FastChat's copy);
- `gsm8k`: openai/gsm8k @ main, main/test-00000-of-00001.parquet, column `question`;
- `math500`: HuggingFaceH4/MATH-500 @ main, test.jsonl, column `problem`;
- `alpaca`: tatsu-lab/alpaca @ main, data/train-00000-of-00001-a09b74b3ef9c3b56.parquet, column
  `instruction` (+ `input` after a blank line when set).

Each row becomes a `{"prompt": ...}` line (a user turn through the chat template). The file is fetched
once with huggingface_hub's `hf_hub_download` into its cache (HF_HOME; `HF_ENDPOINT` names the Hub)
and read from there afterwards, also with `HF_HUB_OFFLINE=1` (the trainer's setting on a node). No
copy and no network: a clear error, exit 2. `describe` gives the report the file's sha256 and the
commit it came from. Light at import: huggingface_hub and pyarrow are imported when used.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from trainer.errors import DflashError


class BenchmarkError(DflashError, ValueError):
    """A named set that cannot be fetched or read; the message says what to do."""


@dataclass(frozen=True)
class Benchmark:
    repo: str  # a dataset repo on the Hub
    revision: str
    filename: str  # .jsonl or .parquet inside the repo
    column: str  # the prompt text (a list: its first element, the first turn)
    about: str
    fallback_column: str | None = None  # the same field under another name in other copies
    extra_column: str | None = None  # appended after a blank line when non-empty (Alpaca's `input`)

    @property
    def source(self) -> str:
        return f"hf://datasets/{self.repo}@{self.revision}/{self.filename}"


BENCHMARKS: dict[str, Benchmark] = {
    "mt-bench": Benchmark(
        "HuggingFaceH4/mt_bench_prompts",
        "main",
        "raw/question.jsonl",
        "prompt",
        "MT-Bench: 80 multi-turn questions in 8 categories; the first turn of each",
        fallback_column="turns",
    ),
    "gsm8k": Benchmark(
        "openai/gsm8k",
        "main",
        "main/test-00000-of-00001.parquet",
        "question",
        "GSM8K test split: 1,319 grade-school math word problems",
    ),
    "math500": Benchmark(
        "HuggingFaceH4/MATH-500",
        "main",
        "test.jsonl",
        "problem",
        "MATH-500: 500 competition math problems (the PRM800K subset of MATH)",
    ),
    "alpaca": Benchmark(
        "tatsu-lab/alpaca",
        "main",
        "data/train-00000-of-00001-a09b74b3ef9c3b56.parquet",
        "instruction",
        "Alpaca: 52,002 instructions (with their input when set); use --limit",
        extra_column="input",
    ),
}


@cache
def fetch(name: str) -> Path:
    """The set's file in huggingface_hub's cache, downloaded on first use (once per process)."""
    b = BENCHMARKS[name]
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return Path(hf_hub_download(b.repo, b.filename, repo_type="dataset", revision=b.revision))
    except LocalEntryNotFoundError:
        why = (
            "HF_HUB_OFFLINE is set"
            if constants.HF_HUB_OFFLINE
            else f"the Hub ({constants.ENDPOINT}) is unreachable"
        )
        raise BenchmarkError(
            f"--prompts {name}: {b.source} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and "
            f"{why}: run it once where the Hub is reachable (or copy that cache here), or give a prompt file"
        ) from None
    except (RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError) as exc:
        raise BenchmarkError(f"--prompts {name}: {b.source}: {type(exc).__name__}") from None
    except (HfHubHTTPError, OSError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise BenchmarkError(f"--prompts {name}: {b.source}: {first}") from None


def _rows(path: Path) -> list[dict[str, Any]]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    return [json.loads(raw) for raw in path.read_text(encoding="utf-8").splitlines() if raw.strip()]


def _text(value: Any) -> str | None:
    if isinstance(value, list):  # MT-Bench: the turns of a conversation; the first is the question
        value = value[0] if value else None
    return value if isinstance(value, str) and value.strip() else None


def prompt_lines(name: str) -> list[str]:
    """The set as prompt-file lines (`{"prompt": ...}`), in the file's order."""
    b = BENCHMARKS[name]
    path = fetch(name)
    try:
        rows = _rows(path)
    except Exception as exc:  # noqa: BLE001 - a damaged cache file: say which and how to refetch
        raise BenchmarkError(
            f"--prompts {name}: cannot read {path}: {exc} (delete it to fetch again)"
        ) from None
    out = []
    for i, row in enumerate(rows):
        column = b.column if b.column in row or not b.fallback_column else b.fallback_column
        if column not in row:
            raise BenchmarkError(
                f"--prompts {name}: row {i} of {b.source} has no column {b.column!r} (it has "
                f"{', '.join(sorted(row)) or 'none'}): the dataset changed; update BENCHMARKS"
            )
        text = _text(row[column])
        if text is None:
            continue
        extra = _text(row.get(b.extra_column)) if b.extra_column else None
        out.append(json.dumps({"prompt": f"{text}\n\n{extra}" if extra else text}))
    return out


def describe(name: str) -> dict[str, Any]:
    """{"name", "sha256", "source"}: the report's record of which bytes were the prompts."""
    path = fetch(name)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    parts = path.parts
    commit = parts[parts.index("snapshots") + 1] if "snapshots" in parts else BENCHMARKS[name].revision
    b = BENCHMARKS[name]
    return {"name": name, "sha256": digest, "source": f"hf://datasets/{b.repo}@{commit}/{b.filename}"}
