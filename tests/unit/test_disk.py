"""The disk budget (trainer/layout/disk.py): the figures `dflash plan`'s disk table prints and preflight's
disk gate (trainer/preflight/disk.py) checks, on a target folder of real safetensors files built here,
a config-only folder, the seeds' run config, and a real small tmpfs as the node's disk."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from tests.conftest import real_tmpfs
from tests.unit.test_plan import QWEN, SEEDS_RUN, doc_lines, plan_in_process, write_config
from trainer.config.run import load_config
from trainer.layout import disk
from trainer.layout.disk import GB
from trainer.layout.recipe import read_target, shapes
from trainer.preflight.disk import disk_gate
from trainer.preflight.report import PreflightReport
from trainer.target.info import TargetInfo

CONF = {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1000}  # fmt: skip


def folder(tmp_path: Path, name: str, **conf) -> Path:
    out = tmp_path / name
    out.mkdir()
    (out / "config.json").write_text(json.dumps({**CONF, **conf}))
    return out


def test_target_weights_from_real_safetensors_files_and_from_their_index(tmp_path):
    target = folder(tmp_path, "sharded", torch_dtype="bfloat16")
    save_file({"a": np.zeros((100, 64), np.float32)}, str(target / "model-00001-of-00002.safetensors"))
    save_file(
        {"b": np.zeros(10, np.float16), "c": np.zeros(3, np.int64)}, str(target / "model-00002.safetensors")
    )
    got, source = disk.target_bytes(target)
    assert got == 100 * 64 * 4 + 10 * 2 + 3 * 8 and "safetensors headers of 2 file(s)" in source
    assert disk.target_bytes(target / "config.json")[0] == got, "the config.json's folder"
    index = {"metadata": {"total_size": 123_456}, "weight_map": {"a": "model-00001-of-00002.safetensors"}}
    (target / "model.safetensors.index.json").write_text(json.dumps(index))
    assert disk.target_bytes(target) == (
        123_456,
        "model.safetensors.index.json metadata.total_size (123456 bytes)",
    )


def test_a_config_only_folder_is_its_parameter_count_times_its_dtype(tmp_path):
    params = TargetInfo.from_folder(folder(tmp_path, "probe")).config_params
    got, source = disk.target_bytes(folder(tmp_path, "fp32", torch_dtype="float32"))
    assert got == params * 4 and f"{params:,} parameters" in source and "(float32)" in source
    assert disk.target_bytes(folder(tmp_path, "bare"), "bfloat16")[0] == params * 2, "the run's dtype"
    # target.dtype "auto" (the default) on a config without torch_dtype (gpt-oss's): bf16, said; before,
    # preflight's disk check failed with KeyError: 'auto' (found on examples/gpt-oss-20b)
    got, source = disk.target_bytes(folder(tmp_path, "auto"), "auto")
    assert got == params * 2 and "bfloat16 assumed" in source


def test_checkpoints_spool_data_and_the_total():
    s = shapes(read_target(QWEN), read_target_recipe())
    one = s.drafter_trainable * 12 + disk.CHECKPOINT_OVERHEAD_BYTES
    assert disk.checkpoint_bytes(s) == one
    assert disk.checkpoints_part(s, keep=3).bytes == 4 * one, "the kept ones + the one being written"
    assert disk.spool_tokens(4, 4096, 4096) == 5 * 4096, "4 batches ahead + the one being read"
    assert disk.spool_tokens(4, 4096, 256) == 8 * 256, "REQUEST_THREADS short documents"
    assert disk.spool_bytes(2, 100, 6, 5120, 2) == 2 * 100 * 6 * 5120 * 2
    assert disk.dataset_bytes(1000, 2000) == 1000 * 2000 * 16
    parts = [disk.DiskPart("a", 5, ""), disk.DiskPart("shm", 7, "", counted=False), disk.reserve_part(1.0)]
    table = disk.budget(parts)
    assert table["total_bytes"] == 5 + 10**9 and table["total_gb"] == 1.0
    assert disk.render(table)[-1].split()[:2] == ["total", "1.00"]


def read_target_recipe():
    from trainer.layout.recipe import Recipe

    return Recipe(draft_layers=5, n_aux=5, block=16, anchors=512, tokens=4096)


def parts(table: dict) -> dict:
    return {p["name"]: p for p in table["parts"]}


def test_the_plan_states_the_disk_of_the_seeds_run(tmp_path):
    """The seeds' run config on 8 x A100-40GB: 55.1 GB of weights (the index), the CUDA venv estimate,
    4 checkpoints of the 5-layer drafter, the spool in /dev/shm (not disk) and the reserve; docs print it."""
    p = plan_in_process("--config", SEEDS_RUN, "--gpu", "A100-40GB", "--gpu-count", 8)
    d = parts(p["disk"])
    assert d["target"]["bytes"] == 55_116_000_000 and d["venv"]["bytes"] == disk.VENV_BYTES["cuda+engine"]
    cfg = load_config(SEEDS_RUN)
    s = TargetInfo.from_folder(QWEN.parent).shapes(cfg)
    assert d["checkpoints"]["bytes"] == pytest.approx(4 * disk.checkpoint_bytes(s), rel=1e-3)
    assert not d["spool"]["counted"] and "/dev/shm" in d["spool"]["source"]
    assert d["spool"]["bytes"] == 2 * 5 * 4096 * 6 * 5120 * 2, "2 trainer ranks, 6 tapped layers, bf16"
    assert "data" not in d and d["reserve"]["bytes"] == 2 * GB
    total = sum(v["bytes"] for k, v in d.items() if k != "spool")
    assert p["disk"]["total_bytes"] == total
    # the spool on disk and a planned regeneration join the total
    run = write_config(tmp_path, target={"vllm": {"storage_dir": "/scratch/spool"}})
    q = plan_in_process("--config", run, "--gpu", "A100-40GB", "--gpu-count", 8, "--regenerate-samples", 1000)
    e = parts(q["disk"])
    assert e["spool"]["counted"] and e["data"]["bytes"] == 1000 * 2000 * 16
    assert q["disk"]["total_bytes"] == total + e["spool"]["bytes"] + e["data"]["bytes"]
    text = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer.cli",
            "plan",
            "--config",
            SEEDS_RUN,
            "--gpu",
            "A100-40GB",
            "--gpu-count",
            "8",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    lines = [line.rstrip() for line in text.splitlines()]
    start = next(i for i, line in enumerate(lines) if line.startswith("disk "))
    table = lines[
        start : next(i for i in range(start, len(lines)) if lines[i].lstrip().startswith("total")) + 1
    ]
    assert len(table) == 7 and set(table) <= doc_lines("hardware.md"), "docs/hardware.md prints this table"


def test_preflight_refuses_a_node_whose_disk_lacks_the_run_naming_each_part(make_config, tmp_path):
    with real_tmpfs(tmp_path / "small", "1m") as small:
        cfg = load_config(make_config(), [f"out_dir={small / 'out'}"])
        target = TargetInfo.from_folder(cfg.target.path)
        report = PreflightReport()
        disk_gate(cfg, target, report)
        problem = next(p for p in report.errors if p.code == "machine.disk_space")
        for word in (
            "checkpoints",
            "train.keep_checkpoints",
            "reserve",
            "preflight.disk_reserve_gb",
            "Already on disk",
        ):
            assert word in problem.message, problem.message
        assert "dflash plan" in problem.fix and "out_dir" in problem.fix
        assert {p["name"] for p in report.machine["disk"]["budget"]["parts"]} == {
            "target", "venv", "checkpoints", "reserve"
        }  # fmt: skip
        # a vLLM spool on the small disk, out_dir on a large one: that filesystem is checked on its own
        spooled = load_config(
            make_config(),
            [
                "target.source=vllm",
                f"target.vllm.storage_dir={small / 'spool'}",
                "preflight.disk_reserve_gb=0",
            ],
        )
        report = PreflightReport()
        disk_gate(spooled, target, report, shm=tmp_path / "no-shm")
        (problem,) = [p for p in report.errors if p.code == "machine.disk_space"]
        assert str(small) in problem.message and "spool" in problem.message and "storage_dir" in problem.fix
        # the command: exit 2 before any training
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "trainer.cli",
                "preflight",
                "--config",
                str(make_config()),
                "--set",
                f"out_dir={small / 'out'}",
            ],
            capture_output=True,
            text=True,
        )
    assert r.returncode == 2 and "machine.disk_space" in r.stdout + r.stderr, r.stdout + r.stderr


def test_the_docs_rent_table_is_what_the_plan_prints():
    """docs/hardware.md's "How much disk to rent": each row's figures, as `dflash plan` computes them."""
    recipe = ("--draft-layers", 5, "--block-size", 16, "--anchors", 512, "--tokens-per-batch", 4096,
              "--loss-chunk-rows", 1024, "--activation-checkpointing")  # fmt: skip
    root = QWEN.parents[4]
    rows = {
        "Qwen3-8B": root / "examples" / "qwen3-8b" / "target",
        "Qwen3-32B": QWEN.parents[1] / "qwen3-32b",
        "Qwen3.6-27B": QWEN.parent,
    }
    page = (root / "docs" / "hardware.md").read_text()
    for name, target in rows.items():
        gpus = ("--target-config", target, "--gpu", "H100-80GB", "--gpu-count", 8)
        seeds = plan_in_process(*gpus, *recipe)["disk"]
        one_layer = plan_in_process(*gpus)["disk"]
        d = parts(seeds)
        cells = [d["target"]["bytes"], d["venv"]["bytes"], d["checkpoints"]["bytes"]]
        row = " | ".join(f"{b / GB:.2f} GB" for b in cells)
        row += f" | **{seeds['total_gb']:.2f} GB** | {one_layer['total_gb']:.2f} GB |"
        line = next(line for line in page.splitlines() if line.startswith(f"| {name}"))
        assert line.endswith(row), f"docs/hardware.md: {line!r} should end {row!r}"


def test_the_plan_sets_a_hosts_recon_disk_beside_the_total(tmp_path):
    """recon.json's disk_total_gib (the gpu_facts role) beside the table: a 100 GiB root cannot hold the
    seeds' 153.87 GB; the plan says so (preflight refuses on the node, by free space)."""
    from tests.unit.test_plan import FIX
    from trainer.layout.gpus import build_facts

    smi = FIX / "nvidia-smi"
    gpus = build_facts(
        (smi / "a100-8x40gb.query.csv").read_text(), (smi / "a100-8x40gb.nvidia-smi.txt").read_text()
    )
    for name, gib in (("small", 100), ("big", 500)):
        facts = {"host": {"name": name}, "gpus": gpus, "disk_total_gib": gib, "disk_path": "/opt/dflash"}
        (tmp_path / f"{name}.json").write_text(json.dumps(facts))
    small = plan_in_process("--config", SEEDS_RUN, "--facts", tmp_path / "small.json")
    assert small["disk"]["nodes"] == [
        {"host": "small", "path": "/opt/dflash", "size_gb": round(100 * 2**30 / GB, 2), "short": True}
    ]
    big = plan_in_process("--config", SEEDS_RUN, "--facts", tmp_path / "big.json")
    assert big["disk"]["nodes"][0]["short"] is False
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer.cli",
            "plan",
            "--config",
            SEEDS_RUN,
            "--facts",
            tmp_path / "small.json",
        ],
        capture_output=True,
        text=True,
    )
    assert "small: 107.37 GB filesystem at /opt/dflash (recon): TOO SMALL for the total" in r.stdout, r.stdout
