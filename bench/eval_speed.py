#!/usr/bin/env python3
"""Evaluation speed: the cached harness (`dflash eval`) vs the reference loop (`dflash eval
--reference`: no caches, speculators' training forward) on the same prompts, in one process,
alternating prompt by prompt. Goal: the harness commits tokens >= 5x faster, with identical tokens
and identical tau (the reference is the proof the harness is right; it is not meant to be fast).

Usage: .venv/bin/python bench/eval_speed.py [--drafter DIR --target DIR --prompts FILE]
       [--max-new-tokens 128] [--limit 8] [--prompt-len 64] [--block-size 8] [--threads 1]
Without --drafter/--target: a tiny random Qwen3 target (4 layers, hidden 64) and a drafter trained
on it for 150 steps by `dflash train`, built in a temp folder (~30 s). With SmolLM2, point --target at
~/.cache/dflash/smollm2-135m-instruct and --drafter at a run (e.g. bench/quality_smollm2.py's).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
GOAL = 5.0


def tiny_setup(root: Path) -> tuple[Path, Path]:
    import numpy as np
    import yaml

    from trainer.demo.synth import greedy_dataset, tiny_target

    target = tiny_target(root / "target")
    rng = np.random.default_rng(0)
    data = greedy_dataset(
        target, [rng.integers(3, 500, size=8).tolist() for _ in range(48)], 56, root / "data"
    )
    raw = {
        "target": {"path": str(target)},
        "data": {"path": str(data)},
        "out_dir": str(root / "run"),
        "drafter": {"num_layers": 1, "block_size": 8, "aux_layer_ids": [1, 2], "mask_token_id": 511},
        "train": {
            "max_steps": 150,
            "lr": 3e-3,
            "warmup_steps": 2,
            "max_tokens_per_batch": 256,
            "max_anchors": 32,
            "checkpoint_every": 1000,
        },
    }
    (root / "run.yaml").write_text(yaml.safe_dump(raw))
    subprocess.run(
        [sys.executable, "-m", "trainer.cli", "train", "--config", str(root / "run.yaml")],
        check=True,
        capture_output=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    return root / "run", target


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", type=Path)
    ap.add_argument("--target", type=Path)
    ap.add_argument(
        "--prompts", type=Path, help="prompt file (default: random ids, or docstrings with a tokenizer)"
    )
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64, help="length of the random prompts (no tokenizer)")
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    import numpy as np
    import torch

    from trainer.eval import prompts as P
    from trainer.eval.harness import speculate
    from trainer.eval.models import HookedTarget, aux_ids_of, load_drafter, speculators_folder
    from trainer.eval.reference import ReferenceTarget

    torch.set_num_threads(args.threads)
    tmp = tempfile.TemporaryDirectory(prefix="dflash-eval-speed-")
    if args.drafter is None or args.target is None:
        print("building a tiny target and training a drafter on it (150 steps)...", flush=True)
        args.drafter, args.target = tiny_setup(Path(tmp.name))
    cpu = torch.device("cpu")
    folder = speculators_folder(args.drafter, args.target)
    drafter = load_drafter(folder, args.target, cpu)
    target = HookedTarget(args.target, aux_ids_of(folder), cpu)
    reference = ReferenceTarget(target)
    B = args.block_size or int(drafter.config.block_size)
    tok = P.load_tokenizer(args.target)
    settings = P.resolve_settings(tok, None, None)
    if args.prompts:
        prompts = P.encode(P.read_prompt_file(args.prompts, args.limit), tok, settings)
    elif tok is None:
        rng = np.random.default_rng(1)
        prompts = [rng.integers(3, 500, size=args.prompt_len).tolist() for _ in range(args.limit)]
    else:
        from trainer.demo.synth import stdlib_docstrings

        prompts = P.encode(
            [P.PromptLine(i, "prompt", t) for i, t in enumerate(stdlib_docstrings(args.limit, seed=1))],
            tok,
            settings,
        )
    stop = set(P.stop_token_ids(args.target, tok))
    speculate(target, drafter, prompts[0], 8, B, stop)  # warm-up (lazy inits) for both paths
    speculate(reference, drafter, prompts[0], 8, B, stop)
    fast_t = slow_t = 0.0
    fast_n = slow_n = 0
    fast_acc: list[int] = []
    slow_acc: list[int] = []
    same = True
    for i, p in enumerate(prompts):
        t0 = time.perf_counter()
        a = speculate(target, drafter, p, args.max_new_tokens, B, stop)
        t1 = time.perf_counter()
        b = speculate(reference, drafter, p, args.max_new_tokens, B, stop)
        t2 = time.perf_counter()
        fast_t, slow_t = fast_t + t1 - t0, slow_t + t2 - t1
        fast_n, slow_n = fast_n + len(a.tokens), slow_n + len(b.tokens)
        fast_acc += a.accepted
        slow_acc += b.accepted
        same &= a.tokens == b.tokens and a.accepted == b.accepted
        print(
            f"prompt {i}: {len(p)} prompt tokens, {len(a.tokens)} new, tau {a.tau or 0:.3f}; "
            f"harness {t1 - t0:.2f}s, reference {t2 - t1:.2f}s",
            flush=True,
        )
    tau_fast = (sum(fast_acc) + len(fast_acc)) / max(1, len(fast_acc))
    tau_slow = (sum(slow_acc) + len(slow_acc)) / max(1, len(slow_acc))
    fast_tps, slow_tps = fast_n / fast_t, slow_n / slow_t
    ratio = fast_tps / slow_tps
    print(f"harness:   {fast_tps:8.1f} tokens/s, tau {tau_fast:.4f} ({len(fast_acc)} rounds)")
    print(f"reference: {slow_tps:8.1f} tokens/s, tau {tau_slow:.4f} ({len(slow_acc)} rounds)")
    print(
        f"identical tokens and accepted lengths: {same}; block {B}, {len(prompts)} prompts, "
        f"{args.max_new_tokens} new tokens, {args.threads} thread(s)"
    )
    print(f"ratio: {ratio:.2f} (goal: >= {GOAL}, tau identical)")
    return 0 if ratio >= GOAL and same and tau_fast == tau_slow else 1


if __name__ == "__main__":
    sys.exit(main())
