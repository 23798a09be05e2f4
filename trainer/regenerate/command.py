"""`regenerate`: the resumable command (plan, resume check, batches, dataset, data gate)."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from pathlib import Path

from trainer.fsutil import atomic_write_text
from trainer.regenerate.backends import GenerationBackend, make_backend
from trainer.regenerate.core import check_empty_share, is_empty_row, plan_batches, respond, save_dataset
from trainer.regenerate.meta import DATA_META, META_SCHEMA_VERSION, RegenerateError, read_data_meta
from trainer.regenerate.options import RegenOptions, check_options
from trainer.regenerate.progress import BatchPusher, RegenEvents


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
    prompts = P.encode(lines, tok, settings)
    stop_ids = [] if opts.ignore_eos else P.stop_token_ids(opts.target, tok)
    batches = plan_batches(prompts, opts.batch_size)
    prompt_set = P.describe_prompts(opts.prompts)
    plan = {
        "target": str(Path(opts.target).resolve()),
        "prompts": prompt_set["name"],
        "prompts_sha256": prompt_set["sha256"],
        "limit": opts.limit,
        "num_prompts": len(prompts),
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
        events.step = len(batches)
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
        return _generate(opts, backend, out, work, prompts, batches, stop_ids, tok, plan, events, pusher)
    except RegenerateError as exc:
        events.end("refused", error=str(exc))
        raise
    except BaseException as exc:
        events.end("failed", error=f"{type(exc).__name__}: {exc}")
        raise


def _generate(opts, backend, out, work, prompts, batches, stop_ids, tok, plan, events, pusher) -> Path:
    from tqdm import tqdm

    batch_file = [work / f"batch-{b:06d}.json" for b in range(len(batches))]
    done = [b for b in range(len(batches)) if batch_file[b].exists()]
    empty: list[int] = []
    tokens = samples = 0
    for b in done:  # what the finished batches hold (a resumed run's counts start from them)
        for r in json.loads(batch_file[b].read_text()):
            samples += 1
            tokens += sum(r["loss_mask"])
            if is_empty_row(r):
                empty.append(r["index"])
    if done:
        print(f"dflash regenerate: resuming: {len(done)} of {len(batches)} batches already done", flush=True)
    events.start(plan, len(batches), len(done), tokens)
    check_empty_share(empty, samples, opts.max_empty_share)
    finished_before = set(done)
    todo = [b for b in range(len(batches)) if b not in finished_before]
    if todo and backend is None:
        pad = tok.pad_token_id if tok is not None and tok.pad_token_id is not None else None
        backend = make_backend(
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
        )
    t0, tokens0 = time.perf_counter(), tokens
    events.generation_started()
    bar = tqdm(
        total=len(batches),
        initial=len(done),
        desc="regenerate",
        unit="batch",
        file=sys.stderr,
        dynamic_ncols=True,
    )
    finished = len(done)
    for b in todo:
        idx = batches[b]
        rows = respond(backend, [prompts[i] for i in idx], opts.max_new_tokens, set(stop_ids))
        for i, r in zip(idx, rows):
            r["index"] = i
            tokens += sum(r["loss_mask"])
            samples += 1
            if r["empty"]:
                empty.append(i)
        atomic_write_text(batch_file[b], json.dumps(rows))
        finished += 1
        bar.update(1)
        bar.set_postfix(tok_s=f"{(tokens - tokens0) / max(1e-9, time.perf_counter() - t0):.0f}")
        events.batch(finished, len(batches), tokens, samples, len(empty))
        check_empty_share(empty, samples, opts.max_empty_share)
        if pusher is not None:
            pusher.push(work, "partial")
    bar.close()
    if pusher is not None and todo:
        pusher.push(work, "partial", force=True)
    check_empty_share(empty, samples, opts.max_empty_share, final=True)
    rows = [None] * len(prompts)
    for b in range(len(batches)):
        for r in json.loads(batch_file[b].read_text()):
            rows[r["index"]] = r
    kept = [r for r in rows if not is_empty_row(r)]
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


def data_gate_or_refuse(dataset: Path, target: Path) -> None:
    """The trainer's own data gate (trainer/preflight/data.py) on the dataset just written, with the
    target's vocabulary, before the final name. Only what no run could use is refused here (ids outside
    the vocabulary, mismatched lengths, samples without a supervised pair); the thresholds that depend
    on a run (data.max_length, preflight.min_supervised_tokens) are `dflash preflight`'s."""
    from trainer.config import config_from_dict
    from trainer.preflight.data import data_gate
    from trainer.preflight.report import PreflightReport
    from trainer.target import TargetInfo

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
