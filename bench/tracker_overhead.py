#!/usr/bin/env python3
"""What `report_to` costs the training loop: trainer tokens/s with trackers following the run beside
the same loop with none, measured side by side in one process (not a CI test).

Variants, interleaved round by round on the same Trainer (so load from other processes hits all alike),
each tracker set in its own process as `dflash train` runs them (trainer/trackers/sidecar.py):
- none: no tracker;
- raising: a tracker that raises on every call and is never dropped (trackers.max_failures 10**9), so
  every step's event costs a caught exception (the default drops it after 3);
- slow: a tracker that sleeps 50 ms per call (slower than a step: it falls behind, the file is its buffer);
- real: the four real trackers (W&B offline, TensorBoard, trackio, MLflow's file store), when installed.
(The same four in threads of the trainer's own process, the design not taken, cannot be measured in
this loop: W&B and trackio leave threads behind that would slow every later round of every variant.)
Every step writes its event (train.log_every 1), the most a run sends. Each round starts the trackers on
a fresh out_dir and waits until they have started (their imports are not timed), then times the steps.

Goal: each variant's tokens/s >= 0.95 x none's (issue #35: "within a few percent"). Beside it, the
trainer process's own CPU time per token (none / variant): what the trackers cost the trainer itself,
which a busy shared machine's load does not move the way it moves wall time (on a GPU node the
trackers' process has cores of its own).
Usage: .venv/bin/python bench/tracker_overhead.py [--steps 30] [--rounds 8] [--hidden 64]
The target is the tests' tiny random Qwen3 built on the spot (the shortest step: the worst case for a
tracker's share of a step; a GPU step on a real target is far longer).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_SILENT", "true")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainer.trackers.clients import Tracker  # noqa: E402


class Raising(Tracker):
    name = "raising"

    def start(self, run):
        pass

    def log(self, step, metrics):
        raise RuntimeError("tracker down")

    def finish(self, status):
        raise RuntimeError("tracker down")


class Slow(Tracker):
    name = "slow"

    def start(self, run):
        pass

    def log(self, step, metrics):
        time.sleep(0.05)

    def finish(self, status):
        pass


REAL = ["wandb", "tensorboard", "trackio", "mlflow"]
STAND_INS = {"raising": "bench.tracker_overhead:Raising", "slow": "bench.tracker_overhead:Slow"}


def start_variant(variant: str, events, cfg) -> tuple[object | None, int]:
    """The variant's trackers following `events` in their own process, and how many start lines to
    wait for in train.log."""
    from trainer.trackers.sidecar import TrackerProcess

    if variant == "none":
        return None, 0
    names = REAL if variant == "real" else [STAND_INS[variant]]
    spec = {
        "out_dir": str(events.path.parent),
        "run_id": events.run_id,
        "offset": 0,
        "trackers": names,
        "project": "bench",
        "options": {"wandb": {"mode": "offline"}},
        "max_failures": 10**9 if variant == "raising" else 3,
        "close_timeout_s": 60.0,
    }
    return TrackerProcess(spec, events).start(), len(names)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30, help="timed steps per variant per round")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=64, help="the tiny target's hidden size")
    args = ap.parse_args()

    import numpy as np

    from trainer.config.run import config_from_dict
    from trainer.demo.synth import greedy_dataset, tiny_target
    from trainer.store.events import EventWriter, load_events
    from trainer.trackers import missing_packages
    from trainer.training.distributed import setup_dist
    from trainer.training.loop import Trainer

    work = Path(tempfile.mkdtemp(prefix="dflash-tracker-bench-"))
    target = tiny_target(work / "target", hidden=args.hidden)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, size=8).tolist() for _ in range(48)]
    data = greedy_dataset(target, prompts, 56, work / "data")
    cfg = config_from_dict(
        {
            "target": {"path": str(target)},
            "data": {"path": str(data)},
            "drafter": {"num_layers": 1, "block_size": 4, "aux_layer_ids": [1, 2], "mask_token_id": 511},
            "train": {"max_steps": 10**6, "max_tokens_per_batch": 256, "max_anchors": 32, "log_every": 1},
            "out_dir": str(work / "out"),
        },
        work,
    )
    tr = Trainer(cfg, setup_dist(cfg), EventWriter(work / "out", "bench", enabled=False))
    tr.build()
    for _ in range(3):  # warm-up (allocator, first-call paths)
        tr.train_step()
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])  # the stand-ins
    variants = ["none", "raising", "slow"]
    if not missing_packages(REAL):
        variants.append("real")
    else:
        print("real: skipped (requirements/trackers.txt not installed)")
    rates: dict[str, list[float]] = {v: [] for v in variants}
    warnings: dict[str, int] = {v: 0 for v in variants}
    cpu: dict[str, list[float]] = {v: [] for v in variants}  # the trainer process's CPU s per token
    order = random.Random(0)
    for r in range(args.rounds):
        for variant in order.sample(variants, len(variants)):  # no variant always first after another
            out = work / f"{variant}-{r}"
            events = EventWriter(out, f"{variant}{r}")  # the bench writes the loop's events itself
            events.emit(
                "run_start", config=cfg.to_dict(), layout={"bench": True}, totals={}, start_step=tr.step
            )
            handle, starts = start_variant(variant, events, cfg)
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline and starts:
                log = events.log_path.read_text() if events.log_path.is_file() else ""
                if log.count(" started: ") + log.count(" dropped after ") >= starts:
                    break
                time.sleep(0.1)
            tokens0, t0, c0 = tr.tokens, time.perf_counter(), time.process_time()
            for _ in range(args.steps):
                m = tr.train_step()
                tr.step += 1
                m.pop("problem", None)
                m.pop("finite", None)
                events.emit("step", step=tr.step, total_steps=10**6, tokens=tr.tokens, **m)
            rates[variant].append((tr.tokens - tokens0) / (time.perf_counter() - t0))
            cpu[variant].append((time.process_time() - c0) / (tr.tokens - tokens0))
            events.emit("run_end", status="completed", step=tr.step)
            if handle is not None:
                handle.close()
            warnings[variant] += sum(1 for e in load_events(events.path) if e["event"] == "warning")
    print(
        f"tokens/s, {args.rounds} rounds x {args.steps} steps (hidden {args.hidden}, log_every 1); ratio: "
        "the median over rounds of variant / none in the same round (the machine's load drifts):"
    )
    for variant in variants:
        ratio = statistics.median(x / n for x, n in zip(rates[variant], rates["none"], strict=True))
        verdict = "" if variant == "none" else ("  OK (>= 0.95)" if ratio >= 0.95 else "  MISSED (< 0.95)")
        each = ", ".join(f"{x:.0f}" for x in rates[variant])
        cpu_ratio = statistics.median(n / x for x, n in zip(cpu[variant], cpu["none"], strict=True))
        print(
            f"  {variant:11s} {statistics.median(rates[variant]):7.0f} tok/s  ratio {ratio:.3f}{verdict}  "
            f"trainer CPU per token: none / this {cpu_ratio:.3f}  "
            f"[rounds: {each}] warning events: {warnings[variant]}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
