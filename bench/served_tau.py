#!/usr/bin/env python
"""Served tau against the harness's tau, and what the draft block's causality does to it (not a CI test).

For a trained run (default: the one `bench/quality_smollm2.py` leaves in --quality-out), three numbers on
the same held-out prompts in one run:

1. tau in this project's harness (`dflash eval`, the DFlash procedure: a non-causal draft block);
2. tau as vLLM counts it serving today's export (`dflash export` sets `sliding_window_non_causal`, so
   vLLM runs the block non-causal, as it was trained);
3. tau as vLLM counts it serving the same weights exported the old way (the flag false, which vLLM
   0.32 turns into a causal draft block for every layer).

Goal: |tau_vLLM(2) - tau_harness(1)| <= 0.1 (the served number is the one the harness predicts), and
(3) shows how much a causally served block costs.

    .venv/bin/python bench/served_tau.py --quality-out runs/quality-smollm2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quality-out", type=Path, default=ROOT / "runs" / "quality-smollm2")
    ap.add_argument("--out", type=Path, default=None, help="default: <quality-out>/served")
    ap.add_argument("--limit", type=int, default=24, help="held-out prompts")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()

    from trainer.demo.smollm import ensure_smollm2

    q = args.quality_out.resolve()
    out = (args.out or q / "served").resolve()
    out.mkdir(parents=True, exist_ok=True)
    target = ensure_smollm2()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    dflash = [sys.executable, "-m", "trainer.cli"]

    new = out / "export"
    if not new.exists():
        subprocess.run(
            [*dflash, "export", "--checkpoint", str(q / "run"), "--out", str(new)], env=env, check=True
        )
    old = out / "export-causal"
    if not old.exists():
        tmp = out / ".export-causal.tmp"
        subprocess.run(["cp", "-r", str(new), str(tmp)], check=True)
        cfg = json.loads((tmp / "config.json").read_text())
        cfg["sliding_window_non_causal"] = False  # as dflash export wrote it before
        (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
        tmp.rename(old)
    common = [
        "--target", str(target), "--prompts", str(q / "heldout.jsonl"), "--limit", str(args.limit),
        "--max-new-tokens", str(args.max_new_tokens), "--device", "cpu", "--check-lossless", "0",
    ]  # fmt: skip
    both = out / "both.json"
    subprocess.run(
        [*dflash, "eval", "--drafter", str(new), *common, "--engine", "both", "--out", str(both)], env=env
    )
    causal = out / "causal.json"
    subprocess.run(
        [*dflash, "eval", "--drafter", str(old), *common, "--engine", "vllm", "--out", str(causal)], env=env
    )
    rep, rep_c = json.loads(both.read_text()), json.loads(causal.read_text())
    h, s, c = rep["tau"], rep["served"]["tau"], rep_c["tau"]
    print(f"harness tau {h:.3f} over {rep['rounds']} rounds; slot 1 {rep['per_position_acceptance'][0]:.3f}")
    print(
        f"vLLM, non-causal block (today's export): tau {s:.3f} over {rep['served']['drafts']} drafts; "
        f"slot 1 {rep['served']['per_position_acceptance'][0]:.3f}"
    )
    print(
        f"vLLM, causal block (the old export): tau {c:.3f} over {rep_c['rounds']} drafts; "
        f"slot 1 {rep_c['per_position_acceptance'][0]:.3f}"
    )
    gap = abs(s - h)
    print(f"|served - harness| = {gap:.3f} (goal <= 0.1): {'OK' if gap <= 0.1 else 'MISSED'}")
    print(f"causal block costs {h - c:.3f} tau ({(h - c) / h:.1%} of the harness's)")
    (out / "summary.json").write_text(
        json.dumps(
            {
                "tau_harness": h,
                "tau_vllm": s,
                "tau_vllm_causal_block": c,
                "rounds_harness": rep["rounds"],
                "drafts_vllm": rep["served"]["drafts"],
                "per_position_harness": rep["per_position_acceptance"],
                "per_position_vllm": rep["served"]["per_position_acceptance"],
                "per_position_vllm_causal": rep_c["per_position_acceptance"],
                "prompts": args.limit,
                "max_new_tokens": args.max_new_tokens,
            },
            indent=1,
        )
    )
    return 0 if gap <= 0.1 else 1


if __name__ == "__main__":
    sys.exit(main())
