"""`regenerate`: the resumable command (plan, resume check, batches, dataset, data gate)."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from trainer.regenerate import turns
from trainer.regenerate.backends import GenerationBackend, make_backend
from trainer.regenerate.core import check_empty_share, is_empty_row, plan_batches, respond, save_dataset
from trainer.regenerate.meta import DATA_META, META_SCHEMA_VERSION, RegenerateError, read_data_meta
from trainer.regenerate.options import RegenOptions, check_options
from trainer.regenerate.progress import BatchPusher, RegenEvents
from trainer.store.fsutil import atomic_write_text

# --backend vllm: the engine's output, in the partial run's folder (kept beside its batches when it dies)
ENGINE_LOG = "vllm-engine.log"


def regenerate(opts: RegenOptions, backend: GenerationBackend | None = None) -> Path:
    from trainer.eval import prompts as P

    out = Path(opts.out)
    check_options(opts)
    complete = out.exists() and read_data_meta(out) is not None
    if out.exists() and not complete:
        raise RegenerateError(
            f"--out {out} exists and is not a finished regeneration: choose another path or delete it"
        )
    lines = P.read_prompt_file(opts.prompts, opts.limit)
    tok = P.load_tokenizer(opts.target)
    settings = P.resolve_settings(tok, opts.chat_template, opts.thinking)
    first = [  # round 0: a conversation up to its first user turn (turns.py: every answer is the target's)
        replace(line, value=turns.round_messages(line.value, 0, [])) if line.kind == "messages" else line
        for line in lines
    ]
    prompts = P.encode(first, tok, settings)
    stop_ids = [] if opts.ignore_eos else P.stop_token_ids(opts.target, tok)
    prompt_set = P.describe_prompts(opts.prompts)
    plan = {
        "target": str(Path(opts.target).resolve()),
        "prompts": prompt_set["name"],
        "prompts_sha256": prompt_set["sha256"],
        "limit": opts.limit,
        "num_prompts": len(prompts),
        "turns": sum(turns.rounds(line) for line in lines),
        "max_new_tokens": opts.max_new_tokens,
        "batch_size": opts.batch_size,
        "template": settings.to_dict(),
        "stop_token_ids": stop_ids,
        "backend": opts.backend,
        "dtype": opts.dtype,
    }
    run_id = "regen-" + hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()[:12]
    events = RegenEvents(opts.run_dir, run_id)
    pusher = BatchPusher(opts.push_to, opts.endpoint_url, opts.push_every_s, events) if opts.push_to else None
    work = out.parent / f".{out.name}.partial"
    if pusher is not None and not complete and not (work / "plan.json").exists():
        complete = pusher.restore(work, out)
    if complete:
        print(f"dflash regenerate: {out} is already complete (delete it to regenerate)", flush=True)
        if pusher is not None:
            pusher.push(out, "dataset", force=True)
        events.step = _planned_batches([turns.rounds(line) for line in lines], opts.batch_size)
        events.end("completed")
        return out
    work.mkdir(parents=True, exist_ok=True)
    plan_file = work / "plan.json"
    if plan_file.exists():
        old = json.loads(plan_file.read_text())
        changed = sorted(k for k in plan if old.get(k) != plan[k])
        if changed:
            raise RegenerateError(
                f"{work} holds a partial run with other settings ({', '.join(changed)}): "
                "rerun with the same arguments to continue it, or delete that folder"
            )
    else:
        atomic_write_text(plan_file, json.dumps(plan, indent=1))
    try:
        return _generate(
            opts, backend, out, work, lines, prompts, stop_ids, tok, settings, plan, events, pusher
        )
    except RegenerateError as exc:
        events.end("refused", error=str(exc))
        raise
    except BaseException as exc:
        events.end("failed", error=f"{type(exc).__name__}: {exc}")
        raise


def _planned_batches(n_rounds: list[int], batch_size: int) -> int:
    """Batches of every round as planned (a later round shrinks when a conversation stops early)."""
    return sum(-(-sum(1 for n in n_rounds if n > r) // batch_size) for r in range(max(n_rounds)))


def _batch_file(work: Path, r: int, b: int) -> Path:
    """Round 0 (every prompt's first answer) as before; later rounds of multi-turn conversations apart."""
    return work / (f"batch-{b:06d}.json" if r == 0 else f"batch-t{r + 1}-{b:06d}.json")


def _label(row: dict[str, Any]) -> str:
    """A sample's name in messages: the prompt index, with the turn for a later round (`7:t2`)."""
    return str(row["index"]) + (f":t{row['round'] + 1}" if row.get("round") else "")


def _generate(
    opts, backend, out, work, lines, prompts, stop_ids, tok, settings, plan, events, pusher
) -> Path:
    from tqdm import tqdm

    from trainer.eval import prompts as P

    n_rounds = [turns.rounds(line) for line in lines]
    bs = opts.batch_size
    total = _planned_batches(n_rounds, bs)
    finished: dict[str, list[dict[str, Any]]] = {
        f.name: json.loads(f.read_text()) for f in sorted(work.glob("batch-*.json"))
    }
    empty: list[str] = []
    tokens = samples = 0
    for rows in finished.values():  # what the finished batches hold (a resumed run's counts start from them)
        for row in rows:
            samples += 1
            tokens += sum(row["loss_mask"])
            if is_empty_row(row):
                empty.append(_label(row))
    if finished:
        print(f"dflash regenerate: resuming: {len(finished)} of {total} batches already done", flush=True)
    events.start(plan, total, len(finished), tokens)
    check_empty_share(empty, samples, opts.max_empty_share)
    t0, tokens0 = time.perf_counter(), tokens
    events.generation_started()
    bar = tqdm(
        total=total,
        initial=len(finished),
        desc="regenerate",
        unit="batch",
        file=sys.stderr,
        dynamic_ncols=True,
    )
    done_batches, generated = len(finished), False
    answers: dict[tuple[int, int], dict[str, Any]] = {}  # (prompt index, round) -> sample
    for r in range(max(n_rounds)):
        if r == 0:
            idx_r, prompts_r = list(range(len(lines))), prompts
        else:
            idx_r, prompts_r = [], []
            for i, line in enumerate(lines):
                if n_rounds[i] <= r:
                    continue
                prev = answers.get((i, r - 1))
                if prev is None or not turns.goes_on(prev, bool(stop_ids)):
                    continue
                said = [turns.answer_text(answers[(i, k)], tok) for k in range(r)]
                msgs = turns.round_messages(line.value, r, said)
                idx_r.append(i)
                prompts_r.append(P.encode_chat(tok, msgs, line.thinking or settings.thinking))
        for b, local in enumerate(plan_batches(prompts_r, bs)):
            f = _batch_file(work, r, b)
            rows = finished.get(f.name)
            if rows is None:
                if backend is None:
                    backend = _make_backend(opts, stop_ids, tok, work / ENGINE_LOG)
                rows = respond(backend, [prompts_r[k] for k in local], opts.max_new_tokens, set(stop_ids))
                for k, row in zip(local, rows):
                    row["index"], row["round"] = idx_r[k], r
                    tokens += sum(row["loss_mask"])
                    samples += 1
                    if row["empty"]:
                        empty.append(_label(row))
                atomic_write_text(f, json.dumps(rows))
                done_batches += 1
                generated = True
                bar.update(1)
                bar.set_postfix(tok_s=f"{(tokens - tokens0) / max(1e-9, time.perf_counter() - t0):.0f}")
                events.batch(done_batches, total, tokens, samples, len(empty))
                check_empty_share(empty, samples, opts.max_empty_share)
                if pusher is not None:
                    pusher.push(work, "partial")
            for row in rows:
                answers[(row["index"], row.get("round", 0))] = row
    bar.close()
    if pusher is not None and generated:
        pusher.push(work, "partial", force=True)
    check_empty_share(empty, samples, opts.max_empty_share, final=True)
    rows = [answers[k] for k in sorted(answers)]
    kept = [r for r in rows if not is_empty_row(r)]
    turn_ids = sorted({r.get("round", 0) for r in rows})
    if empty:
        events.warning(
            "empty_responses",
            f"{len(empty)} of {len(rows)} responses are empty (nothing before the stop token) and are left "
            f"out of the dataset (prompt indices {', '.join(map(str, sorted(empty)[:8]))})",
        )
    resp_lens = [sum(r["loss_mask"]) for r in kept]
    tmp = out.parent / f".{out.name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    save_dataset(kept, tmp)
    meta = {
        "schema_version": META_SCHEMA_VERSION,
        **plan,
        "samples": len(kept),
        "conversations": len(lines),
        "multi_turn_conversations": sum(1 for line in lines if turns.rounds(line) > 1),
        "samples_per_turn": {str(t + 1): sum(1 for r in kept if r.get("round", 0) == t) for t in turn_ids},
        "turns_not_reached": plan["turns"] - len(rows),
        "thinking_per_row": {v: sum(1 for line in lines if line.thinking == v) for v in ("on", "off")},
        "empty_left_out": len(empty),
        "max_empty_share": opts.max_empty_share,
        "stopped_by_stop_token": sum(1 for r in kept if r["stopped"]),
        "cut_at_max_new_tokens": sum(1 for r in kept if not r["stopped"]),
        "response_tokens_total": sum(resp_lens),
        "response_tokens_mean": sum(resp_lens) / max(1, len(kept)),
        "engine": getattr(backend, "version", None),  # of the backend that wrote the last batches
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    atomic_write_text(tmp / DATA_META, json.dumps(meta, indent=1))
    data_gate_or_refuse(tmp, Path(opts.target))
    tmp.rename(out)
    if pusher is not None:
        pusher.push(out, "dataset", force=True)
    shutil.rmtree(work, ignore_errors=True)
    cut = meta["cut_at_max_new_tokens"]
    print(
        f"dflash regenerate: {len(kept)} samples, {meta['response_tokens_total']} response tokens "
        f"({meta['response_tokens_mean']:.1f} per sample; {cut} cut at --max-new-tokens; {len(empty)} empty "
        f"left out) -> {out}" + (f", pushed to {opts.push_to}/dataset" if pusher is not None else ""),
        flush=True,
    )
    if cut and stop_ids and cut > len(kept) // 2:
        events.warning(
            "responses_cut",
            f"{cut} of {len(kept)} responses never reached a stop token {stop_ids}: raise --max-new-tokens "
            "or check the chat template",
        )
    events.end("completed")
    return out


def _make_backend(opts, stop_ids: list[int], tok, engine_log: Path) -> GenerationBackend:
    pad = tok.pad_token_id if tok is not None and tok.pad_token_id is not None else None
    return make_backend(
        opts.backend,
        opts.target,
        stop_ids,
        opts.device,
        pad,
        dtype=opts.dtype,
        tensor_parallel_size=opts.tensor_parallel_size,
        servers=tuple(opts.servers),
        server_options={
            "concurrency": opts.concurrency,
            "timeout_s": opts.request_timeout_s,
            "retries": opts.retries,
            "wait_s": opts.server_wait_s,
        },
        engine_log=engine_log,
    )


def data_gate_or_refuse(dataset: Path, target: Path) -> None:
    """The trainer's own data gate (trainer/preflight/data.py) on the dataset just written, with the
    target's vocabulary, before the final name. Only what no run could use is refused here (ids outside
    the vocabulary, mismatched lengths, samples without a supervised pair); the thresholds that depend
    on a run (data.max_length, preflight.min_supervised_tokens) are `dflash preflight`'s."""
    from trainer.config.run import config_from_dict
    from trainer.preflight.data import data_gate
    from trainer.preflight.report import PreflightReport
    from trainer.target.info import TargetInfo

    cfg = config_from_dict(
        {
            "target": {"path": str(target)},
            "data": {"path": str(dataset), "max_length": 2**31 - 1},
            "preflight": {"min_supervised_tokens": 2},
            "drafter": {"aux_layer_ids": [1], "mask_token_id": 0},
            "out_dir": str(dataset.parent),
        },
        dataset.parent,
    )
    report = PreflightReport()
    data_gate(cfg, TargetInfo.from_folder(target), report)
    if report.errors:
        raise RegenerateError(
            f"the regenerated dataset fails the data gate (kept at {dataset} for a look): "
            + "; ".join(f"[{e.code}] {e.message}" for e in report.errors)
        )
