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
    # needs ~48 GiB even with FSDP2, 4 per copy fits with FSDP2 (thin; ZeRO-1 is just over the budget).
    p = plan("--gpu", "A100-40GB", "--gpu-count", 8)
    assert (p["gpus_per_copy"], p["data_parallel"], p["shard"]) == (4, 2, "full") and p["fits"]
    tried = {(t["gpus_per_copy"], t["shard"]): t["per_gpu_gib"] for t in p["tried"]}
    assert tried[1, "optimizer"] > 60 and tried[2, "optimizer"] > 45 and tried[2, "full"] > 45
    assert tried[2, "full"] < tried[2, "optimizer"], "auto tried FSDP2 before more GPUs per copy"
    assert tried[4, "optimizer"] > 0.92 * 40 > tried[4, "full"], "ZeRO-1 over the budget, FSDP2 under it"
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
    # one rank: fp32 weights + autocast's bf16 casts resident, the gradients freed every step (in the
    # step's part); DDP: the gradients are its bucket views, resident all run, no second copy
    assert eight["drafter_trainable"] == pytest.approx(
        one["drafter_trainable"] * (4 + 4 + 2) / (4 + 2), abs=0.02
    )
    full = plan("--gpu", "B200", "--gpu-count", 8, "--shard", "full")
    assert full["shard"] == "full"
    got = full["per_gpu_breakdown_gib"]
    assert got["drafter_trainable"] == pytest.approx(one["drafter_trainable"] * 4 / 6 / 8, abs=0.01)
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


def test_several_nodes_plan_one_layout_and_refuse_hosts_that_differ(tmp_path):
    """--facts once per node: the layout is per node, the ranks and the wall time are the group's; hosts
    with another GPU model, count or driver are refused with the field and each host's value."""
    smi = FIX / "nvidia-smi"
    a100 = build_facts(
        (smi / "a100-8x40gb.query.csv").read_text(), (smi / "a100-8x40gb.nvidia-smi.txt").read_text()
    )
    files = []
    for name, gpus in (("a", a100), ("b", a100), ("c", {**a100, "driver": "550.54.15"}),
                       ("d", {**a100, "count": 4})):  # fmt: skip
        (tmp_path / name).mkdir()
        (tmp_path / name / "recon.json").write_text(json.dumps({"host": f"node-{name}", "gpus": gpus}))
        files.append(tmp_path / name / "recon.json")
    one = plan("--facts", files[0], "--anchors", 32)
    two = plan("--facts", files[0], "--facts", files[1], "--anchors", 32)
    assert (two["nodes"], two["gpus_per_copy"], two["data_parallel"]) == (
        2,
        one["gpus_per_copy"],
        one["data_parallel"],
    )
    assert two["world_size"] == 2 * one["world_size"] == 2 * one["data_parallel"]
    w1 = {h["gpu"]: h["wall_hours"] for h in one["offline_vs_online"]["per_hardware"]}
    w2 = {h["gpu"]: h["wall_hours"] for h in two["offline_vs_online"]["per_hardware"]}
    assert w2["A100-40GB"] == pytest.approx(w1["A100-40GB"] / 2, abs=0.1)
    for other, field, value in ((files[2], "driver", "550.54.15"), (files[3], "count", "4")):
        r = subprocess.run(
            [sys.executable, "-m", "trainer.cli", "plan", "--target-config", QWEN, "--facts", str(files[0]),
             "--facts", str(other), "--json"],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        assert r.returncode == 2 and r.stdout == "", r.stderr
        assert f"{field}: node-a" in r.stderr and f"node-{other.parent.name} {value}" in r.stderr, r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "trainer.cli", "plan", "--target-config", QWEN, "--facts", str(files[0]),
         "--facts", str(files[1]), "--nodes", "3"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert r.returncode == 2 and "--nodes 3 with 2 --facts files" in r.stderr


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


SEEDS_RECIPE = ("--gpu", "A100-40GB", "--gpu-count", 8, "--draft-layers", 5, "--block-size", 16,
                "--anchors", 512, "--tokens-per-batch", 4096)  # fmt: skip


def test_the_seeds_recipe_on_8_a100_40gb_fits_with_vllm_serving_the_target():
    """The seeds' first node: no in-process layout holds Qwen3.6-27B with 5 draft layers, block 16 and 512
    anchors, even with every memory saving; with the target in a vLLM server (TP 2, 3 replicas on GPUs 2-7:
    25.7 GiB of weights each) two trainer ranks on GPUs 0-1 keep over 10 % of their memory free."""
    savings = ("--loss-chunk-rows", 1024, "--activation-checkpointing")
    hooked = plan(*SEEDS_RECIPE, *savings, "--source", "hooked", rc=1)
    assert hooked["source"] == "hooked" and not hooked["fits"]
    p = plan(*SEEDS_RECIPE, *savings)
    assert p["source"] == "vllm" and p["fits"] and "does not fit" in p["reason"]
    v = p["vllm"]
    assert (v["tensor_parallel_size"], v["data_parallel_size"]) == (2, 3)
    assert v["gpus"] == [2, 3, 4, 5, 6, 7] and v["trainer_gpus"] == [0, 1]
    assert v["per_gpu_breakdown_gib"]["target_weights"] == pytest.approx(55_116_000_000 / 2 / 2**30, abs=0.01)
    assert p["data_parallel"] == 2 and p["headroom_share"] >= 0.10 and v["headroom_share"] >= 0.10
    b = p["per_gpu_breakdown_gib"]
    assert b["target_weights"] == 0 and b["target_forward"] == 0, "a trainer rank holds no target"
    assert b["drafter_frozen"] == pytest.approx((248320 * 5120 * (4 + 2) + 5120 * 4) / 2**30, abs=0.01), (
        "its own fp32 embedding (no target copy to share) and the bf16 head"
    )
    served = plan(*SEEDS_RECIPE, *savings, "--source", "vllm")
    assert served["vllm"] == v, "--source vllm forces the split auto picked"


def test_auto_keeps_the_target_in_process_where_it_fits_and_vllm_needs_two_gpus():
    p = plan("--gpu", "B200", "--gpu-count", 8)
    assert p["source"] == "hooked" and p["vllm"] is None and p["gpus_per_copy"] == 1
    one = plan("--gpu", "A100-40GB", "--gpu-count", 1, "--source", "vllm", rc=1)
    assert not one["fits"] and "at least 2 GPUs" in one["reason"]


def test_a_draft_vocabulary_and_muon_shrink_the_plan_by_their_own_terms():
    """--draft-vocab-size 32768 on the seeds' target: the logits and the frozen heads scale with it (two
    heads of 32,768 rows in bf16 instead of one of 248,320), which lets a layout the whole vocabulary
    does not fit (1 GPU per copy on A100-40GB) fit; --optimizer muon keeps one fp32 momentum per
    weight-matrix element instead of AdamW's two moments; a size at or above the vocabulary is refused."""
    full = plan("--gpu", "A100-40GB", "--gpu-count", 8)
    small = plan("--gpu", "A100-40GB", "--gpu-count", 8, "--draft-vocab-size", 32768)
    b, f = small["per_gpu_breakdown_gib"], full["per_gpu_breakdown_gib"]
    assert b["logits"] == pytest.approx(f["logits"] * 32768 / 248320, abs=0.01)
    assert b["drafter_frozen"] == pytest.approx((2 * 32768 * 5120 * 2 + 5120 * 4) / 2**30, abs=0.01)
    assert small["gpus_per_copy"] < full["gpus_per_copy"] and small["fits"]
    assert small["drafter"]["draft_vocab_size"] == 32768
    one = plan("--gpu", "B200", "--gpu-count", 1)["per_gpu_breakdown_gib"]
    muon = plan("--gpu", "B200", "--gpu-count", 1, "--optimizer", "muon")["per_gpu_breakdown_gib"]
    assert muon["drafter_optimizer"] == pytest.approx(one["drafter_optimizer"] / 2, abs=0.02)
    r = subprocess.run(
        [sys.executable, "-m", "trainer.cli", "plan", "--target-config", QWEN, "--gpu", "B200"]
        + ["--gpu-count", "1", "--draft-vocab-size", "248320"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 2 and "--draft-vocab-size 248320" in r.stderr, r.stderr


def test_a_vllm_split_that_does_not_fit_is_reported_in_words():
    """The text report of `--source vllm` where no split fits names each split tried (it raised a
    KeyError on the in-process layouts' fields), and its budgets, with no figure printed as None."""
    r = subprocess.run(
        [sys.executable, "-m", "trainer.cli", "plan", "--target-config", QWEN, "--gpu", "A100-40GB"]
        + ["--gpu-count", "8", "--draft-layers", "5", "--block-size", "16", "--anchors", "512"]
        + ["--source", "vllm", "--shard", "optimizer"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 1, r.stderr
    assert "NONE FITS (tried vLLM TP 1 on 1 GPUs" in r.stdout and "shard optimizer" in r.stdout
    assert "None GiB" not in r.stdout and "server budget (85% = 34.0 GiB per GPU)" in r.stdout
