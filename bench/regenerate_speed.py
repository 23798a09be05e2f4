#!/usr/bin/env python3
"""`dflash regenerate` with the vLLM backend against the transformers backend, side by side in one run
(not a CI test). The same prompts (stdlib-docstring questions, chat template) through both, greedy, the
same stop rule, on SmolLM2-135M (trainer.demo.smollm): response tokens per second of each backend over
its whole `dflash regenerate` (engine start-up included: use enough prompts), their ratio (goal:
vLLM >= 2x), and the share of responses that agree token for token.

Usage: .venv/bin/python bench/regenerate_speed.py [--prompts 256] [--max-new-tokens 96] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def regenerate(target: Path, prompts: Path, out: Path, backend: str, args) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "trainer.cli",
        "regenerate",
        "--target",
        str(target),
        "--prompts",
        str(prompts),
    ]
    cmd += [
        "--out",
        str(out),
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--batch-size",
        str(args.batch_size),
    ]
    cmd += ["--backend", backend, "--device", "cpu"]
    if backend == "vllm":
        cmd += ["--dtype", args.dtype]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"{backend} failed:\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}")
    meta = json.loads((out / "dflash_data.json").read_text())
    return {
        "wall_s": wall,
        "tokens": meta["response_tokens_total"],
        "tokens_per_s": meta["response_tokens_total"] / wall,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument(
        "--dtype", default="float32", help="the vLLM engine's (the transformers backend runs fp32 on CPU)"
    )
    args = ap.parse_args()

    import datasets

    from trainer.demo import synth
    from trainer.demo.smollm import ensure_smollm2
    from trainer.eval.prompts import write_prompt_file

    target = ensure_smollm2()
    with tempfile.TemporaryDirectory(prefix="dflash-regen-speed-") as tmp:
        work = Path(tmp)
        prompts = write_prompt_file(
            work / "p.jsonl", [{"prompt": t} for t in synth.stdlib_docstrings(args.prompts)]
        )
        runs = {b: regenerate(target, prompts, work / b, b, args) for b in ("vllm", "transformers")}
        got = datasets.load_from_disk(str(work / "vllm"))["input_ids"]
        want = datasets.load_from_disk(str(work / "transformers"))["input_ids"]
    same = sum(a == b for a, b in zip(got, want))
    ratio = runs["vllm"]["tokens_per_s"] / runs["transformers"]["tokens_per_s"]
    print(f"SmolLM2-135M, {len(want)} prompts, <= {args.max_new_tokens} new tokens, vLLM dtype {args.dtype}")
    for b, r in runs.items():
        rate = f"{r['tokens_per_s']:7.1f} tok/s"
        print(f"  {b:12} {r['tokens']:7d} response tokens in {r['wall_s']:6.1f} s = {rate}")
    print(f"  vLLM / transformers tokens/s = {ratio:.2f}   goal >= 2.0  {'OK' if ratio >= 2.0 else 'MISSED'}")
    print(f"  responses identical token for token: {same} of {len(want)} ({same / len(want):.0%})")
    print(json.dumps({"runs": runs, "ratio": ratio, "identical": same, "prompts": len(want)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
