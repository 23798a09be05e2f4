#!/usr/bin/env python3
"""The trainer's memory, measured beside the memory model's prediction (not a CI test).

Each configuration runs in fresh processes (2 gloo ranks under torchrun where it says so) with the
trainer's own `Trainer` (build, then 2 real steps: capture, drafter forward/backward, AdamW) on a tiny
random Qwen3 target built on the spot. Two shapes:

- `vocab`: a large vocabulary (65536) and a one-layer drafter of width 64, so the
  `[anchors x block, vocab]` logits dominate: unchunked vs `train.loss_chunk_rows`;
- `layers`: a four-layer drafter of width 1024 and a small vocabulary, so the drafter's weights,
  gradients and moments dominate: `train.shard` none / optimizer / full over 2 ranks, and
  `train.activation_checkpointing` off / on;
- `acts`: a four-layer drafter of width 512 on 1024 tokens and 128 anchors, so the activations
  matter: `train.activation_checkpointing` off / on.

Measured, per rank, the largest over the ranks: the peak of live tensor bytes torch's CPU allocator
reported to the profiler (`profile_memory`) from `build()` through both steps, what
`torch.cuda.max_memory_allocated` is on a GPU; the peak RSS growth beside it (it also holds glibc's
heap, gloo's buffers and the touched pages of the memory-mapped target). Predicted: the sum of every
part of trainer/layout/sizing.py for the same shapes on CPU (fp32, eager loss, sdpa) and the same world
size, less `target_weights`: on CPU the target's weights are pages of its memory-mapped safetensors,
not allocator memory, so neither side holds them (that part is params x dtype, counted in
tests/unit/test_sizing.py). Printed per configuration with measured/predicted (the goal: each within
15 %), then each option's saving as the ratio of the measured peaks, side by side in one run.

    .venv/bin/python bench/memory.py [--only vocab|layers]
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
SHAPES = {
    "vocab": {"vocab": 65536, "hidden": 64, "draft_layers": 1, "tokens": 2048, "anchors": 256, "block": 8},
    "layers": {"vocab": 2048, "hidden": 1024, "draft_layers": 4, "tokens": 256, "anchors": 32, "block": 8},
    "acts": {"vocab": 2048, "hidden": 512, "draft_layers": 4, "tokens": 1024, "anchors": 128, "block": 8},
}
# (name, shape, ranks, train overrides)
CONFIGS = [
    ("unchunked", "vocab", 1, {}),
    ("loss_chunk_rows 256", "vocab", 1, {"loss_chunk_rows": 256}),
    ("shard none, 2 ranks", "layers", 2, {"shard": "none"}),
    ("shard optimizer, 2 ranks", "layers", 2, {"shard": "optimizer"}),
    ("shard full, 2 ranks", "layers", 2, {"shard": "full"}),
    ("1 rank", "layers", 1, {}),
    ("activation checkpointing", "layers", 1, {"activation_checkpointing": True}),
    ("1 rank, long batch", "acts", 1, {}),
    ("activation ckpt, long batch", "acts", 1, {"activation_checkpointing": True}),
]
SAVINGS = [
    ("train.loss_chunk_rows 256", "unchunked", "loss_chunk_rows 256"),
    ("train.shard optimizer vs none", "shard none, 2 ranks", "shard optimizer, 2 ranks"),
    ("train.shard full vs none", "shard none, 2 ranks", "shard full, 2 ranks"),
    ("train.activation_checkpointing", "1 rank", "activation checkpointing"),
    ("activation checkpointing, long", "1 rank, long batch", "activation ckpt, long batch"),
]


def child(args) -> None:
    import psutil
    import torch
    from online_overhead import make_dataset
    from torch.profiler import ProfilerActivity, profile

    import trainer.drafter.model  # noqa: F401  (imports before the baseline)
    from trainer.config.run import config_from_dict
    from trainer.demo.synth import tiny_target
    from trainer.preflight.machine import estimate_memory
    from trainer.store.events import EventWriter
    from trainer.target.info import TargetInfo
    from trainer.training.distributed import setup_dist
    from trainer.training.loop import Trainer

    torch.set_num_threads(1)
    shape = json.loads(args.shape)
    work = Path(args.work)
    rank = int(os.environ.get("RANK", "0"))
    target = work / "target"
    if rank == 0:
        tiny_target(work / "target.tmp", num_layers=4, hidden=shape["hidden"], vocab=shape["vocab"])
        make_dataset(work / "data.tmp", shape["vocab"], shape["tokens"])
        os.replace(work / "target.tmp", target)
        os.replace(work / "data.tmp", work / "data")
    cfg = config_from_dict(
        {
            "target": {"path": str(target)},
            "data": {"path": str(work / "data"), "max_length": shape["tokens"]},
            "drafter": {
                "num_layers": shape["draft_layers"],
                "block_size": shape["block"],
                "aux_layer_ids": [1, 3],
                "mask_token_id": 5,
            },
            "train": {
                "max_steps": 100,
                "max_tokens_per_batch": shape["tokens"],
                "max_anchors": shape["anchors"],
                **json.loads(args.train),
            },
            "out_dir": str(work / "out"),
        },
        work,
    )
    import torch.distributed as dist

    d = setup_dist(cfg)
    if d.enabled:
        dist.barrier()  # rank 0 has written the target and the data
    base = psutil.Process().memory_info().rss
    # torch's CPU allocator reports every allocation and free to the profiler (profile_memory): the
    # largest "Total Allocated" is the peak of live tensor bytes allocated since build() began, what
    # CUDA's max_memory_allocated is on a GPU (no glibc heap, gloo or library buffers)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        tr = Trainer(cfg, d, EventWriter(work / "out", "bench", enabled=False))
        tr.build()
        for _ in range(2):
            tr.train_step()
            tr.step += 1
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base  # ru_maxrss: KiB on Linux
    parts = estimate_memory(cfg, TargetInfo.from_folder(target), cuda=False, world_size=d.world_size)
    row = {
        "rank": d.rank,
        "measured": allocator_peak(prof, work / f"trace{d.rank}.json"),
        "rss": rss,
        "predicted": sum(v for k, v in parts.items() if k != "target_weights"),  # see the docstring
        "parts": parts,
    }
    with open(work / f"rank{d.rank}.json", "w") as fh:
        json.dump(row, fh)
    tr.close()
    if d.enabled:
        dist.barrier()
        dist.destroy_process_group()


def allocator_peak(prof, trace: Path) -> int:
    """The largest live-tensor total torch's CPU allocator reported during the profile."""
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    totals = [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"]
    if not totals:
        raise SystemExit("the profiler recorded no allocation: profile_memory did not take effect")
    return max(totals)


def run_config(shape: dict, ranks: int, train: dict) -> dict:
    """Measure one configuration in fresh processes: the row of the rank with the largest peak
    (measured, rss, predicted, parts; bytes). tests/integration/test_memory_model.py calls it too."""
    with tempfile.TemporaryDirectory() as work:
        me = [__file__, "--child", "--work", work, "--shape", json.dumps(shape), "--train", json.dumps(train)]
        if ranks == 1:
            cmd = [sys.executable, *me]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
            cmd += ["--nproc-per-node", str(ranks), *me]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        if res.returncode != 0:
            tail = res.stdout[-2000:] + res.stderr[-4000:]
            raise SystemExit(f"{shape} {train}: exit {res.returncode}\n{tail}")
        rows = [json.loads(p.read_text()) for p in sorted(Path(work).glob("rank*.json"))]
    return max(rows, key=lambda r: r["measured"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=sorted(SHAPES), help="run only this shape's configurations")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--shape", help=argparse.SUPPRESS)
    ap.add_argument("--train", default="{}", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return 0
    for name, s in SHAPES.items():
        if args.only in (None, name):
            print(
                f"shape {name}: vocab {s['vocab']}, drafter width {s['hidden']} x {s['draft_layers']} "
                f"layers, {s['tokens']} tokens, {s['anchors']} anchors x block {s['block']}"
            )
    print(
        f"{'configuration':28} {'shape':7} {'measured MiB':>13} {'predicted MiB':>14} {'meas/pred':>10}"
        f" {'RSS MiB':>8}   largest predicted parts (MiB)"
    )
    rows = {}
    for name, shape, ranks, train in CONFIGS:
        if args.only not in (None, shape):
            continue
        r = rows[name] = run_config(SHAPES[shape], ranks, train)
        big = sorted(((k, v) for k, v in r["parts"].items() if v), key=lambda kv: -kv[1])[:4]
        print(
            f"{name:28} {shape:7} {r['measured'] / MIB:13.0f} {r['predicted'] / MIB:14.0f} "
            f"{r['measured'] / r['predicted']:10.2f} {r['rss'] / MIB:8.0f}   "
            + ", ".join(f"{k} {v / MIB:.0f}" for k, v in big),
            flush=True,
        )
    print()
    for label, before, after in SAVINGS:
        if before in rows and after in rows:
            m = rows[before]["measured"] / rows[after]["measured"]
            p = rows[before]["predicted"] / rows[after]["predicted"]
            print(f"{label:32} peak {m:.2f}x smaller measured, {p:.2f}x predicted (same shapes, same run)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
