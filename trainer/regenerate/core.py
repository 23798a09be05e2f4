"""The one generation path: batches planned by length, responses cut at the stop token, the
empty-response check, the dataset saved. Light at import."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainer.regenerate.backends import GenerationBackend
from trainer.regenerate.meta import RegenerateError


def plan_batches(prompts: list[list[int]], batch_size: int) -> list[list[int]]:
    """Prompt indices per batch, similar lengths together (less padding); deterministic."""
    order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
    return [order[s : s + batch_size] for s in range(0, len(order), batch_size)]


def cut_response(new_tokens: list[int], stop_ids: set[int]) -> tuple[list[int], bool]:
    """The response up to and including the first stop token; (tokens, stopped)."""
    for i, t in enumerate(new_tokens):
        if t in stop_ids:
            return new_tokens[: i + 1], True
    return list(new_tokens), False


def respond(
    backend: GenerationBackend, prompts: list[list[int]], max_new_tokens: int, stop_ids: set[int]
) -> list[dict[str, Any]]:
    """One batch: rows with input_ids = prompt + response, loss_mask over the response only; `empty`
    when the response has no token before its stop token (or none at all)."""
    rows = []
    for p, new in zip(prompts, backend.generate(prompts, max_new_tokens)):
        resp, stopped = cut_response(new[:max_new_tokens], stop_ids)
        rows.append(
            {
                "input_ids": list(p) + resp,
                "loss_mask": [0] * len(p) + [1] * len(resp),
                "stopped": stopped,
                "empty": len(resp) - int(stopped) <= 0,
            }
        )
    return rows


EMPTY_CHECK_MIN_SAMPLES = (
    32  # the empty-share check waits for this many samples (one early batch says little)
)


def check_empty_share(empty: list[int] | list[str], done: int, max_share: float, final: bool = False) -> None:
    """Refuse the run when more than `max_share` of the responses so far are empty (`empty`: their
    prompt indices, or `index:tN` for turn N of a conversation)."""
    if done == 0 or (done < EMPTY_CHECK_MIN_SAMPLES and not final) or len(empty) <= max_share * done:
        return
    raise RegenerateError(
        f"{len(empty)} of {done} responses so far are empty (nothing before the stop token; "
        f"--max-empty-share {max_share}): the target ends its turn at once, which is what left 87 % of "
        "a dataset empty in the seeds. Check the chat template and thinking mode (--chat-template, "
        "--thinking), the stop ids and the prompts (e.g. prompt indices "
        f"{', '.join(map(str, sorted(empty)[:8]))}); the finished batches are kept in the .partial folder "
        "for a look, delete it to start over"
    )


def save_dataset(rows: list[dict[str, Any]], out_dir: Path) -> Path:
    import datasets

    ds = datasets.Dataset.from_dict(
        {"input_ids": [r["input_ids"] for r in rows], "loss_mask": [r["loss_mask"] for r in rows]}
    )
    ds.save_to_disk(str(out_dir))
    return Path(out_dir)


def is_empty_row(row: dict[str, Any]) -> bool:
    if "empty" in row:
        return bool(row["empty"])
    return sum(row["loss_mask"]) - int(bool(row.get("stopped"))) <= 0
