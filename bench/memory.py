#!/usr/bin/env python3
"""The drafter step's memory, measured beside the memory model's prediction (not a CI test).

Each configuration runs in a fresh process: a tiny random Qwen3 target with a large vocabulary (so the
`[anchors x block, vocab]` logits matter, as they do for a 248K-vocabulary target), the trainer's own
`Trainer` (build, then 2 real steps: capture, drafter forward/backward, AdamW). Measured: the peak RSS
growth over the steps (`ru_maxrss` after them minus the RSS before the first; the gradients and
AdamW's moments are made by the first step, so they count). Predicted: the same parts of
trainer/layout/sizing.py for the same shapes on CPU (fp32, eager loss): gradients + moments +
activations + logits. Printed per configuration with measured/predicted, and the saving of
`train.loss_chunk_rows` as the ratio of the measured peaks, side by side in one run.

    .venv/bin/python bench/memory.py [--vocab 65536] [--tokens 2048] [--anchors 256] [--chunk 256]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

MIB = 2**20


def child(args) -> dict:
    import psutil
    import torch
    from online_overhead import make_dataset

    from trainer.config import config_from_dict
    from trainer.demo.synth import tiny_target
    from trainer.events import EventWriter
    from trainer.preflight.machine import estimate_memory
    from trainer.target import TargetInfo
    from trainer.training.distributed import setup_dist
    from trainer.training.loop import Trainer

    torch.set_num_threads(2)
    work = Path(args.work)
    target = tiny_target(work / "target", num_layers=4, hidden=64, vocab=args.vocab)
    data = make_dataset(work / "data", args.vocab, args.tokens)
    cfg = config_from_dict(
        {
            "target": {"path": str(target)},
            "data": {"path": str(data), "max_length": args.tokens},
            "drafter": {
                "num_layers": 1,
                "block_size": args.block,
                "aux_layer_ids": [1, 3],
                "mask_token_id": 5,
            },
            "train": {
                "max_steps": 100,
                "max_tokens_per_batch": args.tokens,
                "max_anchors": args.anchors,
                "loss_chunk_rows": args.loss_chunk_rows,
            },
            "out_dir": str(work / "out"),
        },
        work,
    )
    tr = Trainer(cfg, setup_dist(cfg), EventWriter(work / "out", "bench", enabled=False))
    tr.build()
    base = psutil.Process().memory_info().rss
    for _ in range(2):
        tr.train_step()
        tr.step += 1
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    parts = estimate_memory(cfg, TargetInfo.from_folder(target), cuda=False, world_size=1)
    p = tr.n_trainable
    predicted = {
        "gradients": p * 4,
        "optimizer": parts["drafter_optimizer"],
        "activations": parts["activations"],
        "logits": parts["logits"],
    }
    return {"measured": peak - base, "predicted": sum(predicted.values()), "parts": predicted}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=65536)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--anchors", type=int, default=256)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=256, help="the chunked configuration's loss_chunk_rows")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--loss-chunk-rows", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return 0
    rows = {}
    for chunk in (0, args.chunk):
        with tempfile.TemporaryDirectory() as work:
            cmd = [sys.executable, __file__, "--child", "--work", work, "--loss-chunk-rows", str(chunk)]
            cmd += [f"--{k}={getattr(args, k)}" for k in ("vocab", "tokens", "anchors", "block")]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            rows[chunk] = json.loads(out.strip().splitlines()[-1])
    q = args.anchors * args.block
    print(
        f"vocab {args.vocab}, {args.tokens} tokens, {args.anchors} anchors x block {args.block} "
        f"= {q} query rows"
    )
    print(
        f"{'configuration':24} {'measured MiB':>13} {'predicted MiB':>14} {'meas/pred':>10}"
        "   predicted parts (MiB)"
    )
    for chunk, r in rows.items():
        name = "unchunked" if chunk == 0 else f"loss_chunk_rows {chunk}"
        parts = ", ".join(f"{k} {v / MIB:.0f}" for k, v in r["parts"].items())
        print(
            f"{name:24} {r['measured'] / MIB:13.0f} {r['predicted'] / MIB:14.0f} "
            f"{r['measured'] / r['predicted']:10.2f}   {parts}"
        )
    saving = rows[0]["measured"] / rows[args.chunk]["measured"]
    print(
        f"\nchunked loss: the step's peak growth is {saving:.2f}x smaller (measured, same shapes, same run)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
