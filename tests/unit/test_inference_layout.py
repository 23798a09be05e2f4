"""How eval and regeneration hold a target larger than one GPU (trainer/layout/inference.py, #34 item 5):
vLLM's tensor-parallel size and the harness's device_map, planned by `dflash plan` and re-planned on the
GPUs eval/regenerate see; refusals before any model loads. The GPUs are given as (count, GiB): no GPU
runs here, so what vLLM and accelerate then do with these numbers is not exercised (the harness's
device_map path is loaded for real on the CPU in tests/integration/test_eval.py)."""

import json
from pathlib import Path

import pytest

from trainer.layout.inference import plan_inference, resolve_engine_tp, resolve_harness
from trainer.layout.recipe import PlanError, read_target

ROOT = Path(__file__).resolve().parents[2]
Q32 = ROOT / "tests" / "fixtures" / "targets" / "qwen3-32b"  # Qwen3-32B's published config (64 heads, 8 KV)
Q8 = ROOT / "examples" / "qwen3-8b" / "target"  # Qwen3-8B's (32 heads, 8 KV)
A100_40 = (8, 40.0)


def test_qwen3_32b_on_8_a100_40gb_gets_tp_4_and_a_harness_over_2_gpus():
    p = plan_inference(read_target(Q32), 40.0, 8)
    e, h = p["engine"], p["harness"]
    # 61 GiB of bf16 weights: TP 2 leaves no room for 16 x 4096 tokens of KV cache in 0.92 x 40 GiB
    assert e["fits"] and e["tensor_parallel_size"] == 4
    assert [t["tensor_parallel_size"] for t in e["tried"]] == [1, 2, 4, 8]
    assert e["tried"][1]["per_gpu_gib"] > 0.92 * 40 > e["per_gpu_gib"]
    assert h["fits"] and h["gpus"] == 2 and h["device_map"] == "auto" and set(h["max_memory_gib"]) == {0, 1}
    assert 30.5 < h["max_memory_gib"][0] < 0.92 * 40, "each GPU's weight share (61/2 GiB) must fit its cap"
    assert resolve_engine_tp(Q32, None, "--tensor-parallel-size", A100_40)[0] == 4
    placed = resolve_harness(Q32, None, "cuda", A100_40)
    mib = int(h["max_memory_gib"][0] * 1024)
    assert placed["gpus"] == 2
    assert placed["load_kwargs"] == {"device_map": "auto", "max_memory": {0: f"{mib}MiB", 1: f"{mib}MiB"}}


def test_an_8b_target_stays_on_one_gpu_in_both():
    p = plan_inference(read_target(Q8), 40.0, 8)
    assert p["engine"]["tensor_parallel_size"] == 1 and p["harness"]["gpus"] == 1
    assert p["harness"]["device_map"] is None
    assert resolve_engine_tp(Q8, None, "--tensor-parallel-size", A100_40)[0] == 1
    assert resolve_harness(Q8, None, "cuda", A100_40)["load_kwargs"] == {}, "from_pretrained as before"
    # no GPU at all: the CPU, unsharded
    assert resolve_engine_tp(Q8, None, "--tensor-parallel-size", (0, 0.0))[0] == 1
    assert resolve_harness(Q8, None, "cpu", A100_40) == {"load_kwargs": {}, "gpus": 0, "reason": "the CPU"}


def test_a_flag_overrides_the_plan_and_what_cannot_work_is_refused():
    assert resolve_engine_tp(Q32, 8, "--tensor-parallel-size", A100_40) == (
        8,
        "--tensor-parallel-size 8, set by hand",
    )
    with pytest.raises(PlanError, match="cannot shard 64 attention heads .* 3 ways; use one of 1, 2, 4, 8"):
        resolve_engine_tp(Q32, 3, "--tensor-parallel-size", A100_40)
    with pytest.raises(PlanError, match="16: more than the 8 GPU"):
        resolve_engine_tp(Q32, 16, "--tensor-parallel-size", A100_40)
    with pytest.raises(PlanError, match="2: no GPU is in use"):
        resolve_engine_tp(Q8, 2, "--tensor-parallel-size", (0, 0.0))
    with pytest.raises(PlanError, match="no tensor-parallel size up to 1 GPU"):
        resolve_engine_tp(Q32, None, "--tensor-parallel-size", (1, 40.0))  # 61 GiB on one 40 GiB GPU
    assert resolve_harness(Q32, 4, "cuda", A100_40)["load_kwargs"]["max_memory"].keys() == {0, 1, 2, 3}
    with pytest.raises(PlanError, match="--harness-gpus 9: more than the 8"):
        resolve_harness(Q32, 9, "cuda", A100_40)
    with pytest.raises(PlanError, match="even 1 GPUs do not hold"):
        resolve_harness(Q32, None, "cuda", (1, 40.0))


def test_dflash_plan_reports_it_as_docs_hardware_prints_it(capsys):
    from trainer.cli import main

    args = ["plan", "--target-config", str(Q32), "--gpu", "A100-40GB", "--gpu-count", "8"]
    assert main([*args, "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["inference"]["engine"]["tensor_parallel_size"] == 4 and p["inference"]["harness"]["gpus"] == 2
    assert p["assumptions"]["offline_engine_gpu_memory_utilization"] == 0.92
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("eval "))
    documented = (ROOT / "docs" / "hardware.md").read_text().splitlines()
    assert lines[at : at + 2] == documented[documented.index(lines[at]) :][:2], "docs/hardware.md is stale"


def test_eval_and_regenerate_refuse_a_tensor_parallel_size_with_exit_2_before_any_load(tmp_path, capsys):
    from trainer.cli import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"input_ids": [5, 6, 7]}\n')
    drafter = tmp_path / "d"
    drafter.mkdir()
    (drafter / "config.json").write_text("{}")
    common = ["--target", str(Q8), "--prompts", str(prompts)]
    # this host has no GPU: vLLM's CPU engine runs unsharded; the refusal comes before vLLM is imported
    # or any model loads (the target folder holds only a config.json)
    rc = main(
        [
            "regenerate",
            *common,
            "--out",
            str(tmp_path / "o"),
            "--backend",
            "vllm",
            "--tensor-parallel-size",
            "2",
        ]
    )
    assert rc == 2 and "--tensor-parallel-size 2: no GPU is in use" in capsys.readouterr().err
    assert not (tmp_path / "o").exists() and not (tmp_path / ".o.partial").exists()
    out = tmp_path / "r" / "report.json"
    rc = main(["eval", "--drafter", str(drafter), *common, "--out", str(out), "--tensor-parallel-size", "2"])
    assert (
        rc == 2
        and "--tensor-parallel-size is vLLM's: use it with --engine vllm or both" in capsys.readouterr().err
    )
    rc = main(
        [
            "eval",
            "--drafter",
            str(drafter),
            *common,
            "--out",
            str(out),
            "--harness-gpus",
            "2",
            "--device",
            "cpu",
        ]
    )
    assert rc == 2 and "--harness-gpus 2: no GPU is in use" in capsys.readouterr().err
    assert not out.parent.exists()
