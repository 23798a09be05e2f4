#!/usr/bin/env python3
"""The vLLM hidden-state source against the hooked one, side by side in one run, on SmolLM2-135M.

(a) Same numbers: `dflash capture` of the first samples through the hooked target and through a vLLM
    server (the run's own), fp32 and bf16: the largest relative difference per feature.
(b) Throughput: the same `dflash train` run (1 draft layer, block 8, the SmolLM2 aux layers) with
    `target.source: hooked` and with `target.source: vllm` against one server started for it:
    trainer tokens/s (median over the steps after the warm-up), the share of step time spent waiting
    for hidden states once the queue is warm (goal <= 10 %), and the hidden-state bytes moved per
    token. On this 2-core CPU the server and the trainer share the cores; on a GPU node they do not.

Usage: .venv/bin/python bench/vllm_source.py [--steps 30] [--tokens 512] [--samples 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

AUX = [2, 9, 16, 23, 29]  # DFLASH.md's SmolLM2 baseline (speculators convention)
DFLASH = [sys.executable, "-m", "trainer.cli"]


def make_config(work: Path, target: Path, data: Path, name: str, args, **target_keys) -> Path:
    import yaml

    raw = {
        "target": {"path": str(target), **target_keys},
        "data": {"path": str(data), "max_length": args.tokens},
        "drafter": {"num_layers": 1, "block_size": 8, "aux_layer_ids": AUX, "mask_token_id": 16},
        "train": {
            "max_steps": args.steps,
            "lr": 3e-4,
            "warmup_steps": 2,
            "max_tokens_per_batch": args.tokens * 2,
            "max_anchors": 64,
            "checkpoint_every": 10_000,
            "log_every": 1,
        },
        "out_dir": str(work / name),
    }
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def dflash(*args) -> subprocess.CompletedProcess:
    res = subprocess.run([*DFLASH, *map(str, args)], capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise SystemExit(f"dflash {args[0]} failed:\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}")
    return res


def part_a(work: Path, target: Path, data: Path, args) -> dict:
    from trainer.sources.capture import compare_captures

    out = {}
    for dtype in ("float32", "bfloat16"):
        cfg = make_config(work, target, data, f"capture-{dtype}", args, dtype=dtype)
        files = {}
        for source in ("hooked", "vllm"):
            files[source] = work / f"{source}-{dtype}.safetensors"
            dflash(
                "capture",
                "--config",
                cfg,
                "--source",
                source,
                "--samples",
                args.samples,
                "--out",
                files[source],
            )
        diff = compare_captures(files["hooked"], files["vllm"])
        out[dtype] = {"tokens": diff.tokens, "max_rel": diff.max_rel, "max_abs": diff.max_abs}
    return out


def steps_of(out_dir: Path) -> list[dict]:
    from trainer.store.events import load_events

    return [e for e in load_events(out_dir / "events.jsonl") if e["event"] == "step"]


def summarize(steps: list[dict], warm: int) -> dict:
    rest = steps[warm:]
    res = {"tokens_per_s": statistics.median(s["tokens_per_s"] for s in rest)}
    if "hs_wait_s" in rest[0]:
        res["wait_share"] = sum(s["hs_wait_s"] for s in rest) / sum(s["step_s"] for s in rest)
        res["bytes_per_token"] = sum(s["hs_bytes"] for s in steps) / sum(s["hs_tokens"] for s in steps)
    return res


def part_b(work: Path, target: Path, data: Path, args) -> dict:
    from trainer.config.run import load_config
    from trainer.sources.vllm_server import OwnedServer, free_port

    hooked = make_config(work, target, data, "train-hooked", args)
    dflash("train", "--config", hooked)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    served = make_config(work, target, data, "train-vllm", args, source="vllm", vllm={"url": url})
    load_config(served)  # a bad config fails here, not as a server that never comes up
    cmd = [*DFLASH, "serve-target", "--config", str(served), "--port", str(port)]
    with OwnedServer(cmd, url, work / "server.log") as server:
        server.wait_ready(600)
        dflash("train", "--config", served)
    warm = min(5, args.steps // 3)
    return {
        "hooked": summarize(steps_of(work / "train-hooked"), warm),
        "vllm": summarize(steps_of(work / "train-vllm"), warm),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--tokens", type=int, default=512, help="tokens per sample (2 samples a batch)")
    ap.add_argument("--samples", type=int, default=4, help="samples captured in (a)")
    ap.add_argument("--skip-capture", action="store_true", help="only (b)")
    args = ap.parse_args()
    from online_overhead import make_dataset

    from trainer.demo.smollm import ensure_smollm2

    target = ensure_smollm2()
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    with tempfile.TemporaryDirectory(prefix="bench-vllm-source-") as tmp:
        work = Path(tmp)
        data = make_dataset(work / "data", vocab, args.tokens)
        if not args.skip_capture:
            a = part_a(work, target, data, args)
            print(f"(a) SmolLM2-135M, aux {AUX} + last, {args.samples} samples: max relative |hooked - vllm|")
            for dtype, r in a.items():
                cells = "  ".join(f"{k} {v:.2e}" for k, v in r["max_rel"].items())
                print(f"    {dtype:9} ({r['tokens']} tokens): {cells}")
        b = part_b(work, target, data, args)
        h, v = b["hooked"], b["vllm"]
        print(f"(b) dflash train, {args.steps} steps of {2 * args.tokens} tokens (median after warm-up)")
        print(f"    hooked: {h['tokens_per_s']:8.0f} tokens/s")
        ratio = v["tokens_per_s"] / h["tokens_per_s"]
        print(
            f"    vllm:   {v['tokens_per_s']:8.0f} tokens/s  ({ratio:.2f}x hooked), "
            f"waiting {v['wait_share']:.1%} of step time (goal <= 10 %), "
            f"{v['bytes_per_token']:.0f} bytes/token moved"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
