"""`dflash plan` (trainer/layout/plan.py): the seeds' layout cases and the offline storage arithmetic."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.layout.gpus import build_facts

FIX = Path(__file__).resolve().parents[1] / "fixtures"
QWEN = FIX / "targets" / "qwen3.6-27b" / "config.json"


def plan(*args, rc=0):
    r = subprocess.run(
        [sys.executable, "-m", "trainer.cli", "plan", "--target-config", QWEN, *map(str, args), "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == rc, r.stderr
    return json.loads(r.stdout)


def test_qwen_27b_on_8_a100_40gb_needs_four_gpus_per_copy_at_default_anchors():
    # The seeds' case. The old planner said 2 per copy (~35.5 GiB) by assuming ZeRO-sharded bf16+fp32
    # state, two bf16 frozen copies and a 512-position loss chunk. The trainer keeps fp32 weights and
    # grads on every rank, a bf16 head (its embedding is the target copy's own:
    # train.share_target_embedding), and speculators' forward materialises the full [512 x 16, 248320]
    # logits, targets and their gradient (11.4 GiB in bf16), all on the copy's first GPU: 2 per copy
    # needs ~48 GiB even with FSDP2, 4 per copy fits (thin).
    p = plan("--gpu", "A100-40GB", "--gpu-count", 8)
    assert (p["gpus_per_copy"], p["data_parallel"], p["shard"]) == (4, 2, "optimizer") and p["fits"]
    tried = {(t["gpus_per_copy"], t["shard"]): t["per_gpu_gib"] for t in p["tried"]}
    assert tried[1, "optimizer"] > 60 and tried[2, "optimizer"] > 45 and tried[2, "full"] > 45
    assert tried[2, "full"] < tried[2, "optimizer"], "auto tried FSDP2 before more GPUs per copy"
    assert p["thin_margin"] and "THIN MARGIN" in p["reason"] and "fewer than 4 GPUs per copy" in p["reason"]
    b = p["per_gpu_breakdown_gib"]
    assert b["logits"] == pytest.approx(512 * 16 * 248320 * 2 * 3 / 2**30, abs=0.01)
    assert b["drafter_frozen"] == pytest.approx((248320 * 5120 * 2 + 5120 * 4) / 2**30, abs=0.01)
    fit = {f["gpus_per_copy"]: f["anchors"] for f in p["fits_with_anchors"]}
    assert set(fit) == {2} and 0 < fit[2] < 512, "1 per copy fits at no anchors count"
    q = plan("--gpu", "A100-40GB", "--gpu-count", 8, "--anchors", fit[2])  # the hint is a real layout
    assert (q["gpus_per_copy"], q["data_parallel"]) == (2, 4) and q["fits"]
    assert "fewer than 2 GPUs per copy" in q["reason"]
    assert q["target"]["params_source"].startswith("model.safetensors.index.json")


def test_no_layout_fits_names_the_parts_and_the_anchors_that_would():
    p = plan("--gpu", "A100-40GB", "--gpu-count", 8, "--anchors", 1024, rc=1)
    assert p["gpus_per_copy"] is None and not p["fits"]
    assert "logits" in p["reason"] and "--anchors" in p["reason"]
    fit = {f["gpus_per_copy"]: f["anchors"] for f in p["fits_with_anchors"]}
    assert 0 < fit[2] < fit[4] < fit[8] < 1024 and 1 not in fit


def test_optimizer_moments_are_sharded_over_data_parallel_ranks():
    one = plan("--gpu", "B200", "--gpu-count", 1)["per_gpu_breakdown_gib"]
    eight = plan("--gpu", "B200", "--gpu-count", 8)["per_gpu_breakdown_gib"]
    assert eight["drafter_optimizer"] == pytest.approx(one["drafter_optimizer"] / 8, abs=0.01)
    # DDP's gradients are views into its buckets (gradient_as_bucket_view): nothing added per rank
    assert eight["drafter_trainable"] == one["drafter_trainable"]
    full = plan("--gpu", "B200", "--gpu-count", 8, "--shard", "full")
    assert full["shard"] == "full"
    got = full["per_gpu_breakdown_gib"]
    assert got["drafter_trainable"] == pytest.approx(one["drafter_trainable"] * 8 / 10 / 8, abs=0.01)
    assert got["drafter_gathered"] > 0
    assert (
        plan("--gpu", "B200", "--gpu-count", 8)["assumptions"]["memory_model"] == "trainer/layout/sizing.py"
    )


@pytest.mark.parametrize("gpu, count", [("RTX-PRO-6000-96GB", 4), ("B200", 8), ("B200", 7), ("H200", 1)])
def test_qwen_27b_fits_one_gpu_per_copy_on_big_gpus(gpu, count):
    p = plan("--gpu", gpu, "--gpu-count", count)
    assert (p["gpus_per_copy"], p["data_parallel"]) == (1, count)


def test_offline_storage_is_92_tb():
    p = plan("--gpu", "B200", "--gpu-count", 8, "--samples", 902_000, "--mean-tokens", 2000)
    assert p["offline_storage_bytes"] == 5 * 5120 * 2 * 2000 * 902_000
    assert round(p["offline_storage_bytes"] / 1e12) == 92
    hw = {h["gpu"]: h for h in p["offline_vs_online"]["per_hardware"]}
    # same model, same count: the B200 (2250 TFLOPS) is faster than the A100 (312) by the FLOPS ratio
    assert hw["B200"]["wall_hours"] < hw["A100-40GB"]["wall_hours"]
    assert hw["A100-40GB"]["tokens_per_s"] / hw["B200"]["tokens_per_s"] == pytest.approx(312 / 2250, rel=1e-3)


def test_from_recon_facts_and_inventory_override(tmp_path):
    smi = FIX / "nvidia-smi"
    facts = {
        "host": {"name": "a100-example"},
        "gpus": build_facts(
            (smi / "a100-8x40gb.query.csv").read_text(), (smi / "a100-8x40gb.nvidia-smi.txt").read_text()
        ),
    }
    (tmp_path / "recon.json").write_text(json.dumps(facts))
    p = plan("--facts", tmp_path / "recon.json", "--anchors", 32)
    assert (p["gpu"], p["gpu_count"], p["gpus_per_copy"]) == ("A100-40GB", 8, 2)
    p = plan("--facts", tmp_path / "recon.json", "--gpus-per-copy", 2)
    assert (p["gpus_per_copy"], p["data_parallel"]) == (2, 4) and "set by hand" in p["reason"]
    assert not p["fits"] and "DOES NOT FIT" in p["reason"]


def test_bad_input_is_named():
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer.cli",
            "plan",
            "--target-config",
            QWEN,
            "--gpu",
            "V100",
            "--gpu-count",
            "8",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 2 and "unknown GPU 'V100'" in r.stderr
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer.cli",
            "plan",
            "--target-config",
            "/nonexistent/config.json",
            "--gpu",
            "B200",
            "--gpu-count",
            "8",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 2 and "does not exist" in r.stderr
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer.cli",
            "plan",
            "--target-config",
            QWEN,
            "--gpu",
            "B200",
            "--gpu-count",
            "8",
            "--gpus-per-copy",
            "3",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 2 and "does not divide" in r.stderr


def test_too_big_for_the_node_exits_1(tmp_path):
    cfg = json.loads(QWEN.read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 1_500_000_000_000}})
    )
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer.cli",
            "plan",
            "--target-config",
            tmp_path / "config.json",
            "--gpu",
            "A100-40GB",
            "--gpu-count",
            "8",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 1
    assert json.loads(r.stdout)["gpus_per_copy"] is None
