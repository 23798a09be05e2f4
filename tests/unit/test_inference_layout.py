"""How eval and regeneration hold a target larger than one GPU (trainer/layout/inference.py, #34 item 5):
vLLM's tensor-parallel size and the harness's device_map, planned by `dflash plan` and re-planned on the
GPUs eval/regenerate see; refusals before any model loads. The GPUs are given as (count, GiB): no GPU
runs here, so what vLLM and accelerate then do with these numbers is not exercised (the harness's
device_map path is loaded for real on the CPU in tests/integration/test_eval.py)."""

import json
from pathlib import Path

import pytest

from trainer.layout.inference import plan_harness, plan_inference, resolve_engine_tp, resolve_harness
from trainer.layout.recipe import PlanError, Recipe, read_target

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


def _drafter_folder(tmp_path, layers: int) -> Path:
    """A Qwen3-32B drafter's config.json as speculators writes it (the weights are not read)."""
    tl = json.loads((Q32 / "config.json").read_text())
    folder = tmp_path / f"drafter-{layers}"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(
        json.dumps(
            {
                "speculators_model_type": "dflash",
                "block_size": 16,
                "aux_hidden_state_layer_ids": [2, 18, 34, 50, 62],
                "draft_vocab_size": tl["vocab_size"],
                "transformer_layer_config": {**tl, "num_hidden_layers": layers},
            }
        )
    )
    return folder


def test_the_harness_counts_the_drafter_eval_loads_on_gpu_0(tmp_path):
    """Issue 46 item 6: a Qwen3-32B drafter on 2 x A100-40GB ran out of memory where the plan said ~34.9 of
    36.8 GiB. The drafter (fp32: two vocab x hidden matrices and its layers, ~8.1 GiB for one layer, its
    working set ~1 GiB) sits on GPU 0: 2 GPUs no longer fit, 3 do, GPU 0's max_memory is lowered by it."""
    t = read_target(Q32)
    r = Recipe(draft_layers=1, n_aux=5, block=16, anchors=512, tokens=8192, optimizer="adamw")
    bare = plan_harness(t, 40.0, 8)
    h = plan_inference(t, 40.0, 8, r)["harness"]
    assert bare["gpus"] == 2 and bare["per_gpu_gib"] == 34.9, "the old figure, without the drafter"
    assert h["gpus"] == 3 and h["fits"] and 8.0 < h["drafter"]["weights_gib"] < 8.3
    two = plan_harness(t, 40.0, 8, gpus=2, drafter=_drafter(t, r))
    assert not two["fits"], "2 GPUs with the drafter on GPU 0: the out-of-memory of the issue"
    # dflash eval plans the same from the drafter folder it is given (the largest of several)
    placed = resolve_harness(Q32, None, "cuda", A100_40, [_drafter_folder(tmp_path, 1)])
    caps = placed["load_kwargs"]["max_memory"]
    assert placed["gpus"] == 3 and int(caps[0][:-3]) < int(caps[1][:-3])
    both = [_drafter_folder(tmp_path, 1), _drafter_folder(tmp_path, 5)]
    five = resolve_harness(Q32, None, "cuda", A100_40, both)
    assert five["gpus"] == 3 and "the drafter 16." in five["reason"]
    # refused with the fix when the GPUs this process sees cannot hold target and drafter
    with pytest.raises(PlanError, match=r"drafter .*fp32, on GPU 0.*--engine vllm"):
        resolve_harness(Q32, None, "cuda", (2, 40.0), [_drafter_folder(tmp_path, 1)])


def _drafter(t, r):
    from trainer.layout.eval_memory import eval_drafter
    from trainer.layout.recipe import shapes

    return eval_drafter(shapes(t, r), 4096, r.block)


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
    h = p["inference"]["harness"]
    assert p["inference"]["engine"]["tensor_parallel_size"] == 4 and h["gpus"] == 3, "the drafter takes room"
    assert h["drafter"]["gpu"] == 0 and h["drafter"]["dtype"] == "float32" and h["drafter"]["layers"] == 1
    assert h["max_memory_gib"]["0"] < h["max_memory_gib"]["1"], "GPU 0 keeps room for the drafter"
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
