"""`dflash plan` (trainer/layout/plan.py): the seeds' layout cases and the offline storage arithmetic."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

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
    seeds = ("--gpu", "A100-40GB", "--gpu-count", 8, "--optimizer", "adamw")  # the seeds' AdamW
    p = plan(*seeds)
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
    q = plan(*seeds, "--anchors", fit[2])  # the hint is a real layout
    assert (q["gpus_per_copy"], q["data_parallel"]) == (2, 4) and q["fits"]
    assert "fewer than 2 GPUs per copy" in q["reason"]
    assert q["target"]["params_source"].startswith("model.safetensors.index.json")


def test_no_layout_fits_names_the_parts_and_the_anchors_that_would():
    p = plan("--gpu", "A100-40GB", "--gpu-count", 8, "--anchors", 1024, rc=2)
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
    p = plan("--facts", tmp_path / "recon.json", "--gpus-per-copy", 2, rc=2)  # forced, over the budget
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


def test_too_big_for_the_node_is_refused_with_the_reason(tmp_path):
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
    assert r.returncode == 2 and "dflash plan: no layout fits: even 8 GPUs per copy" in r.stderr, r.stderr
    p = json.loads(r.stdout)
    assert p["gpus_per_copy"] is None and p["apply"] == {}


SEEDS_RECIPE = ("--gpu", "A100-40GB", "--gpu-count", 8, "--draft-layers", 5, "--block-size", 16,
                "--anchors", 512, "--tokens-per-batch", 4096, "--optimizer", "adamw")  # fmt: skip


def test_the_seeds_recipe_on_8_a100_40gb_fits_with_vllm_serving_the_target():
    """The seeds' first node: no in-process layout holds Qwen3.6-27B with 5 draft layers, block 16 and 512
    anchors, even with every memory saving; with the target in a vLLM server (TP 2, 3 replicas on GPUs 2-7:
    25.7 GiB of weights each) two trainer ranks on GPUs 0-1 keep over 10 % of their memory free."""
    savings = ("--loss-chunk-rows", 1024, "--activation-checkpointing")
    hooked = plan(*SEEDS_RECIPE, *savings, "--source", "hooked", rc=2)
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
    one = plan("--gpu", "A100-40GB", "--gpu-count", 1, "--source", "vllm", rc=2)
    assert not one["fits"] and "at least 2 GPUs" in one["reason"]


def test_a_draft_vocabulary_and_muon_shrink_the_plan_by_their_own_terms():
    """--draft-vocab-size 32768 on the seeds' target: the logits and the frozen heads scale with it (two
    heads of 32,768 rows in bf16 instead of one of 248,320), which lets a layout the whole vocabulary
    does not fit (1 GPU per copy on A100-40GB) fit; --optimizer muon keeps one fp32 momentum per
    weight-matrix element instead of AdamW's two moments; a size at or above the vocabulary is refused."""
    full = plan("--gpu", "A100-40GB", "--gpu-count", 8, "--optimizer", "adamw")
    small = plan("--gpu", "A100-40GB", "--gpu-count", 8, "--optimizer", "adamw", "--draft-vocab-size", 32768)
    b, f = small["per_gpu_breakdown_gib"], full["per_gpu_breakdown_gib"]
    assert b["logits"] == pytest.approx(f["logits"] * 32768 / 248320, abs=0.01)
    assert b["drafter_frozen"] == pytest.approx((2 * 32768 * 5120 * 2 + 5120 * 4) / 2**30, abs=0.01)
    assert small["gpus_per_copy"] < full["gpus_per_copy"] and small["fits"]
    assert small["drafter"]["draft_vocab_size"] == 32768
    one = plan("--gpu", "B200", "--gpu-count", 1, "--optimizer", "adamw")["per_gpu_breakdown_gib"]
    muon = plan("--gpu", "B200", "--gpu-count", 1, "--optimizer", "muon")["per_gpu_breakdown_gib"]
    assert muon["drafter_optimizer"] == pytest.approx(one["drafter_optimizer"] / 2, abs=0.02)
    default = plan("--gpu", "B200", "--gpu-count", 1)["per_gpu_breakdown_gib"]
    assert default == muon, "the flag's default is the run config's (Muon)"
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
    assert r.returncode == 2 and "dflash plan: no layout fits: no split fits" in r.stderr, r.stderr
    assert "NONE FITS (tried vLLM TP 1 on 1 GPUs" in r.stdout and "shard optimizer" in r.stdout
    assert "None GiB" not in r.stdout and "server budget (85% = 34.0 GiB per GPU)" in r.stdout


# --- `dflash plan --config RUN.yaml`: the run config is the one home of the recipe

SEEDS_RUN = FIX / "runs" / "seeds-qwen36-27b.yaml"


def run_plan(*args, stdin=None):
    return subprocess.run(
        [sys.executable, "-m", "trainer.cli", "plan", *map(str, args)],
        input=stdin,
        capture_output=True,
        text=True,
        check=False,
    )


def plan_in_process(*args) -> dict:
    from trainer.cli import build_parser
    from trainer.layout.plan import make_plan

    return make_plan(build_parser().parse_args(["plan", *map(str, args)]))


def write_config(tmp_path, **sections) -> Path:
    """The seeds' run config with `sections` merged over it (target.path made absolute)."""
    raw = yaml.safe_load(SEEDS_RUN.read_text())
    raw["target"]["path"] = str(QWEN.parent)
    for name, keys in sections.items():
        raw[name] = {**raw.get(name, {}), **keys}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def doc_lines(page: str) -> set[str]:
    return {line.rstrip() for line in (FIX.parents[1] / "docs" / page).read_text().splitlines()}


def test_plan_config_on_the_seeds_recipe_prints_the_layout_the_docs_print():
    """The seeds' run config on 8 x A100-40GB: TP 2 x DP 3 on GPUs 2-7, two trainer ranks at ~28.5 GiB with
    train.shard full, the same as the recipe's flags say; docs/hardware.md prints these very lines."""
    r = run_plan("--config", SEEDS_RUN, "--gpu", "A100-40GB", "--gpu-count", 8)
    assert r.returncode == 0, r.stderr
    lines = {line.split()[0]: line for line in r.stdout.splitlines() if line[:1].strip()}
    assert (
        "TP 2, DP 3, ~29.7 GiB each), GPUs [0, 1] train (data-parallel 2, train.shard full)"
        in lines["layout"]
    )
    assert lines["memory"].startswith("memory   ~28.5 GiB per trainer GPU")
    documented = doc_lines("hardware.md")
    for key in ("layout", "memory", "why", "apply"):
        assert lines[key] in documented, f"docs/hardware.md does not print: {lines[key]}"
    by_config = plan_in_process("--config", SEEDS_RUN, "--gpu", "A100-40GB", "--gpu-count", 8)
    by_flags = plan_in_process(
        "--target-config", QWEN, *SEEDS_RECIPE, "--loss-chunk-rows", 1024, "--activation-checkpointing"
    )
    same = ("source", "vllm", "gpus_per_copy", "data_parallel", "shard", "per_gpu_breakdown_gib", "apply")
    assert {k: by_config[k] for k in same} == {k: by_flags[k] for k in same}
    assert by_config["apply"] == {
        "target": {
            "source": "vllm",
            "gpus_per_copy": 1,
            "vllm": {"tensor_parallel_size": 2, "data_parallel_size": 3, "gpus": [2, 3, 4, 5, 6, 7]},
        },
        "train": {"shard": "full", "device": "cuda"},
    }


# the seeds' run config in flags (tests/fixtures/runs/seeds-qwen36-27b.yaml)
SEEDS_FLAGS = {"draft-layers": 5, "aux-layers": 5, "block-size": 16, "anchors": 512, "tokens-per-batch": 4096,
               "loss-chunk-rows": 1024, "activation-checkpointing": True, "optimizer": "adamw"}  # fmt: skip
# (run-config section, key, value) -> the flag that says the same
KNOBS = [
    ("drafter", "num_layers", 2, {"draft-layers": 2}),
    ("drafter", "aux_layer_ids", [1, 31, 61], {"aux-layers": 3}),
    ("drafter", "block_size", 8, {"block-size": 8}),
    ("drafter", "draft_vocab_size", 32768, {"draft-vocab-size": 32768}),
    ("train", "max_anchors", 256, {"anchors": 256}),
    ("train", "max_tokens_per_batch", 8192, {"tokens-per-batch": 8192}),
    ("train", "loss_chunk_rows", 0, {"loss-chunk-rows": 0}),
    ("train", "activation_checkpointing", False, {"activation-checkpointing": False}),
    ("train", "shard", "optimizer", {"shard": "optimizer"}),
    ("train", "optimizer", "muon", {"optimizer": "muon"}),
    ("target", "source", "vllm", {"source": "vllm"}),
    ("target", "dtype", "float32", {"dtype": "float32"}),
    ("target", "gpus_per_copy", 4, {"gpus-per-copy": 4}),
]


def as_flags(knobs: dict) -> list:
    return [
        a for k, v in knobs.items() if v is not False for a in ([f"--{k}"] if v is True else [f"--{k}", v])
    ]


@pytest.mark.parametrize("section, key, value, flag", KNOBS, ids=[f"{s}.{k}" for s, k, *_ in KNOBS])
def test_plan_config_reads_every_knob_as_its_flag_would(tmp_path, section, key, value, flag):
    gpus = ("--gpu", "H100-80GB", "--gpu-count", 8)
    by_config = plan_in_process("--config", write_config(tmp_path, **{section: {key: value}}), *gpus)
    by_flags = plan_in_process("--target-config", QWEN, *gpus, *as_flags({**SEEDS_FLAGS, **flag}))
    same = ("source", "gpus_per_copy", "data_parallel", "shard", "per_gpu_breakdown_gib", "apply", "drafter")
    assert {k: by_config[k] for k in same} == {k: by_flags[k] for k in same}
    seeds = plan_in_process("--config", SEEDS_RUN, *gpus)
    assert {k: by_config[k] for k in same} != {k: seeds[k] for k in same}, "the knob changed nothing"


def test_plan_config_and_recipe_flags_do_not_mix_and_bad_configs_are_named(tmp_path):
    r = run_plan(
        "--config", SEEDS_RUN, "--gpu", "A100-40GB", "--gpu-count", 8, "--anchors", 64, "--shard", "full"
    )
    assert r.returncode == 2 and r.stdout == ""
    assert "--anchors, --shard with --config" in r.stderr and "train.max_anchors, train.shard" in r.stderr
    elsewhere = write_config(tmp_path, target={"path": "/opt/dflash/target"})
    r = run_plan("--config", elsewhere, "--gpu", "A100-40GB", "--gpu-count", 8)
    assert r.returncode == 2 and "not readable at target.path /opt/dflash/target" in r.stderr, r.stderr
    assert "--target-config" in r.stderr and "trainer_service_target_config" in r.stderr
    r = run_plan("--config", elsewhere, "--target-config", QWEN, "--gpu", "A100-40GB", "--gpu-count", 8)
    assert r.returncode == 0, r.stderr
    cpu = write_config(tmp_path, train={"device": "cpu"})
    r = run_plan("--config", cpu, "--gpu", "A100-40GB", "--gpu-count", 8)
    assert r.returncode == 2 and "train.device cpu" in r.stderr, r.stderr
    (tmp_path / "bad.yaml").write_text("target: {path: x}\ntrain: {shard: zero3}\n")
    r = run_plan("--config", tmp_path / "bad.yaml", "--gpu", "A100-40GB", "--gpu-count", 8)
    assert r.returncode == 2 and "train.shard" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = run_plan("--gpu", "A100-40GB", "--gpu-count", 8)
    assert r.returncode == 2 and "pass --config RUN.yaml" in r.stderr


def test_plan_config_reads_stdin():
    """`--config -`: the trainer_service role pipes the run config it renders, no file on the controller."""
    text = SEEDS_RUN.read_text().replace("../targets/qwen3.6-27b", str(QWEN.parent))
    r = run_plan("--config", "-", "--gpu", "A100-40GB", "--gpu-count", 8, "--json", stdin=text)
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)
    assert p["config"] == "-" and p["apply"]["train"] == {"shard": "full", "device": "cuda"}


def test_a_32b_target_gets_the_shard_level_it_was_planned_with_or_is_refused(tmp_path):
    """The 32B case of issue 31: on 8 x A100-40GB the plan lays a Qwen3-32B-shaped target out 4 per copy
    with FSDP2, while a run config without train.shard runs ZeRO-1 (37.1 GiB on a 36.8 GiB budget). Now the
    level is applied; a config that pins ZeRO-1 gets a layout that holds it, and one that pins 4 per copy
    as well is refused, exit 2, with the reason."""
    conf = {"model_type": "qwen3", "hidden_size": 5120, "num_hidden_layers": 64, "intermediate_size": 25600,
            "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
            "torch_dtype": "bfloat16"}  # fmt: skip
    target = tmp_path / "qwen3-32b"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(conf))
    gpus = ("--gpu", "A100-40GB", "--gpu-count", 8)
    # the role's old call: one draft layer, 8192 tokens, no loss chunks or activation checkpointing
    recipe = {"drafter": {"num_layers": 1}, "target": {"path": str(target)}}
    plain = {"loss_chunk_rows": 0, "activation_checkpointing": False, "max_tokens_per_batch": 8192}
    unpinned = write_config(tmp_path, **recipe, train=plain)
    p = plan_in_process("--config", unpinned, *gpus)
    assert (p["gpus_per_copy"], p["data_parallel"], p["shard"]) == (4, 2, "full")
    assert p["apply"]["train"]["shard"] == "full" and p["apply"]["target"]["gpus_per_copy"] == 4
    pinned = write_config(tmp_path, **recipe, train={**plain, "shard": "optimizer"})
    p = plan_in_process("--config", pinned, *gpus)
    assert p["fits"] and p["shard"] == "optimizer" and p["gpus_per_copy"] == 8
    recipe["target"]["gpus_per_copy"] = 4
    both = write_config(tmp_path, **recipe, train={**plain, "shard": "optimizer"})
    r = run_plan("--config", both, *gpus, "--json")
    assert r.returncode == 2, r.stderr
    assert "no layout fits" in r.stderr and "train.shard optimizer" in r.stderr and "DOES NOT FIT" in r.stderr
    assert json.loads(r.stdout)["apply"] == {}


def _eval_run(tmp_path, target: Path, aux: list[int], **eval_keys) -> Path:
    """The seeds' run config on another target, one draft layer, with an `eval:` section."""
    raw = yaml.safe_load(SEEDS_RUN.read_text())
    raw["target"] = {"path": str(target)}
    raw["drafter"] = {**raw["drafter"], "num_layers": 1, "aux_layer_ids": aux, "mask_token_id": 151669}
    raw["train"] = {**raw["train"], "loss_chunk_rows": 0, "activation_checkpointing": False,
                    "max_tokens_per_batch": 8192}  # fmt: skip
    raw["eval"] = {"prompts": "mt-bench", **eval_keys}
    path = tmp_path / f"run-{len(list(tmp_path.glob('run-*')))}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_the_eval_child_is_placed_and_counted(tmp_path):
    """Issue 46 item 7: Qwen3-32B on 8 x A100-40GB trains 4 per copy, DP 2 on every GPU; the `eval:` child
    (a second target and the fp32 drafter) fits nowhere beside it. The plan keeps the last 3 GPUs for it
    (the harness with the drafter needs 3), trains on the other 5 (5 per copy, DP 1) and writes
    eval.device under `apply`; pinned to `trainer` it is refused (exit 2) with the choices named; pinned
    to the last GPUs it is counted as given; GPUs the trainer takes are refused."""
    q32 = FIX / "targets" / "qwen3-32b"
    gpus = ("--gpu", "A100-40GB", "--gpu-count", 8)
    aux = [2, 18, 34, 50, 62]
    p = plan_in_process("--config", _eval_run(tmp_path, q32, aux), *gpus)
    c = p["eval_child"]
    assert c["fits"] and c["device"] == "cuda:5,6,7" and c["gpus"] == [5, 6, 7]
    assert p["apply"]["eval"] == {"device": "cuda:5,6,7"}
    assert (p["gpus_per_copy"], p["data_parallel"]) == (5, 1) and p["fits"]
    assert "the drafter 9.1 GiB on GPU 0" in c["reason"]
    # the text the docs print
    r = run_plan("--config", _eval_run(tmp_path, q32, aux), *gpus)
    assert r.returncode == 0, r.stderr
    shown = [
        line for line in r.stdout.splitlines() if line.startswith(("layout", "apply")) or "eval: (" in line
    ]
    assert len(shown) == 3 and set(shown) <= doc_lines("hardware.md"), "docs/hardware.md is stale"
    # eval.device trainer, set by hand: refused, the choices named
    r = run_plan("--config", _eval_run(tmp_path, q32, aux, device="trainer"), *gpus, "--json")
    assert r.returncode == 2
    assert "the evaluation while training (eval:) has no place" in r.stderr
    assert "eval.device: cuda:5,6,7 (the last 3 GPU(s); training on 5" in r.stderr
    assert "eval.device: cpu" in r.stderr and "no eval: section" in r.stderr
    # the last three, by hand: counted, nothing to apply; the first three: the trainer's
    p = plan_in_process("--config", _eval_run(tmp_path, q32, aux, device="cuda:5,6,7"), *gpus)
    assert p["eval_child"]["fits"] and "eval" not in p["apply"] and p["data_parallel"] == 1
    r = run_plan("--config", _eval_run(tmp_path, q32, aux, device="cuda:0,1,2"), *gpus)
    assert r.returncode == 2 and "must be the node's last 3 of 8: cuda:5,6,7" in r.stderr
    # two GPUs do not hold the harness with the drafter
    r = run_plan("--config", _eval_run(tmp_path, q32, aux, device="cuda:6,7"), *gpus)
    assert r.returncode == 2 and "2 GPU(s) do not hold the harness" in r.stderr
    # an 8B target: beside rank 0 on its 80 GB GPU, all 8 GPUs train
    q8 = FIX.parents[1] / "examples" / "qwen3-8b" / "target"
    p = plan_in_process(
        "--config", _eval_run(tmp_path, q8, [1, 9, 17, 25, 33]), "--gpu", "H100-80GB", "--gpu-count", 8
    )
    assert p["eval_child"]["device"] == "trainer" and p["data_parallel"] == 8 and "eval" not in p["apply"]


Q32 = FIX / "targets" / "qwen3-32b" / "config.json"
A100x8 = ("--gpu", "A100-40GB", "--gpu-count", 8)


def test_the_plan_answers_the_renting_question_from_the_users_samples():
    """Regeneration hours from the samples, mean tokens and the layout's engines (vLLM TP 4 on 8 x A100-40GB
    for Qwen3-32B: 2 engines), the memory-bound decode model recomputed here by hand; training's epochs
    count --regenerate-samples when --samples is not given; money = hours x price x nodes."""
    from trainer.layout.renting import HBM_EFFICIENCY, REGENERATE_CONCURRENCY

    p = plan_in_process(
        "--target-config", Q32, *A100x8, "--regenerate-samples", 100_000, "--price-per-hour", 14
    )
    g = p["regeneration"]
    assert (g["tensor_parallel_size"], g["engines"], g["concurrency"]) == (4, 2, REGENERATE_CONCURRENCY)
    # one decode step: each GPU reads its quarter of the bf16 weights and of 16 sequences' KV cache at
    # half the mean length (64 layers x 8 KV heads x 128 x K and V x 2 B = 256 KiB a token)
    params = p["target"]["params"]
    per_gpu = (params * 2 + 16 * 1000 * 64 * 8 * 128 * 2 * 2) / 4
    step_s = per_gpu / (1555e9 * HBM_EFFICIENCY)
    tok_s = 2 * 16 / step_s
    assert g["bound"] == "memory" and g["tokens_per_s"] == pytest.approx(tok_s, rel=1e-3)
    assert g["hours"] == pytest.approx(100_000 * 2000 / tok_s / 3600, abs=0.06)
    assert "1555 GB/s HBM (datasheet)" in g["source"] and "modelled, not measured" in g["source"]
    t = p["training"]
    assert t["samples"] == 100_000 and t["samples_source"].startswith("--regenerate-samples")
    a100 = next(h for h in p["offline_vs_online"]["per_hardware"] if h["gpu"] == "A100-40GB")
    assert t["tokens_per_s"] == a100["tokens_per_s"]
    assert t["hours"] == pytest.approx(100_000 * 2000 / a100["tokens_per_s"] / 3600, abs=0.06)
    c = p["cost"]
    assert [(s["step"], s["nodes"]) for s in c["steps"]] == [("regeneration", 1), ("training", 1)]
    assert c["total"] == pytest.approx((g["hours"] + t["hours"]) * 14, abs=0.01)
    # --samples wins over --regenerate-samples; without either, the seeds' 902K, said so
    q = plan_in_process("--target-config", Q32, *A100x8, "--regenerate-samples", 100_000, "--samples", 50_000)
    assert q["training"]["samples"] == 50_000 and q["training"]["samples_source"] == "--samples"
    assert q["cost"]["total"] is None and q["cost"]["node_hours"] > 0
    d = plan_in_process("--target-config", Q32, *A100x8)
    assert d["training"]["samples"] == 902_000 and "seeds' 902K" in d["training"]["samples_source"]
    assert d["regeneration"] is None and [s["step"] for s in d["cost"]["steps"]] == ["training"]
    # two nodes: training is paid twice over (hours halve with twice the GPUs), regeneration on one node
    two = plan_in_process(
        "--target-config", Q32, *A100x8, "--nodes", 2, "--regenerate-samples", 100_000, "--price-per-hour", 14
    )
    tr = next(s for s in two["cost"]["steps"] if s["step"] == "training")
    assert tr["nodes"] == 2 and tr["cost"] == pytest.approx(tr["hours"] * 14 * 2, abs=0.01)
    assert two["regeneration"]["hours"] == g["hours"]
    # the text says it, in words
    r = run_plan("--target-config", Q32, *A100x8, "--regenerate-samples", 100_000, "--price-per-hour", 14)
    assert r.returncode == 0, r.stderr
    lines = {line.split()[0]: line for line in r.stdout.splitlines() if line[:1].strip()}
    assert lines["regen"].startswith(f"regen    ~{g['hours']} h: 100,000 samples x 2000 tokens on 2 vLLM")
    assert lines["train"].startswith(f"train    ~{t['hours']} h: 1 epoch(s) of 100,000 samples")
    assert lines["cost"].startswith(f"cost     ~{c['total']:,.2f} at 14 per node-hour")


@pytest.mark.parametrize("price", ["-1", "nan", "inf", "ten"])
def test_a_bad_price_exits_2_before_any_plan(price):
    r = run_plan("--target-config", Q32, *A100x8, "--price-per-hour", price)
    assert r.returncode == 2 and "--price-per-hour" in r.stderr and "Traceback" not in r.stderr
    assert r.stdout == ""


def test_a_bad_price_given_in_process_is_refused_too():
    from trainer.layout.recipe import PlanError
    from trainer.layout.renting import plan_cost

    for bad in (-0.5, float("nan"), float("inf")):
        with pytest.raises(PlanError, match="--price-per-hour"):
            plan_cost(None, {"hours": 1.0}, 1, bad)


def test_a_target_config_saved_under_another_name_is_read_for_the_disk_figure(tmp_path):
    """--target-config FILE: the file given, not a config.json beside it (there is none here)."""
    saved = tmp_path / "qwen3-32b-config.json"
    saved.write_text(Q32.read_text())
    r = run_plan("--target-config", saved, *A100x8, "--json")
    assert r.returncode == 0, r.stderr
    target = next(d for d in json.loads(r.stdout)["disk"]["parts"] if d["name"] == "target")
    same = plan_in_process("--target-config", Q32, *A100x8)["disk"]["parts"][0]
    assert target["bytes"] == same["bytes"] == 32_762_123_264 * 2
    assert target["source"].startswith("qwen3-32b-config.json: 32,762,123,264 parameters")
