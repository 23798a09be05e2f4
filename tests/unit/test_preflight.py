"""Preflight gates: each bad input gets its own test naming the problem code and the fix."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import datasets
import pytest

from tests.conftest import real_tmpfs
from trainer.config.run import load_config
from trainer.preflight import PreflightReport, run_preflight
from trainer.preflight.drafter import suggest_aux_ids
from trainer.preflight.report import Problem
from trainer.target.info import SafetensorsError, TargetInfo, read_config, read_safetensors_header

# ---------------------------------------------------------------- helpers


def preflight(
    make_config, target: dict | None = None, data: dict | None = None, out_dir: str | None = None, **sections
) -> PreflightReport:
    """run_preflight on conftest's run config with `sections` merged in. target, data and out_dir go
    through load_config's overrides (conftest's write_config takes those names as its own arguments)."""
    overrides = [
        f"{name}.{key}={json.dumps(value)}"
        for name, section in (("target", target or {}), ("data", data or {}))
        for key, value in section.items()
    ]
    if out_dir is not None:
        overrides.append(f"out_dir={json.dumps(out_dir)}")
    return run_preflight(load_config(make_config(**sections), overrides))


def find(report: PreflightReport, code: str, *, warning: bool = False) -> Problem:
    pool = report.warnings if warning else report.errors
    found = [p for p in pool if p.code == code]
    assert found, (
        f"{code} not in {'warnings' if warning else 'errors'}: {report.codes()}\n{report.render_text()}"
    )
    return found[0]


def assert_problem(report: PreflightReport, code: str, *words: str, warning: bool = False) -> Problem:
    """The problem is listed, and its message or fix names each of `words`."""
    problem = find(report, code, warning=warning)
    text = f"{problem.message} {problem.fix}"
    for word in words:
        assert word in text, f"{word!r} not in {code}: {text}"
    assert problem.fix
    return problem


def save_dataset(path: Path, input_ids: list[list[int]], loss_mask: list[list[int]], **extra) -> Path:
    datasets.Dataset.from_dict({"input_ids": input_ids, "loss_mask": loss_mask, **extra}).save_to_disk(
        str(path)
    )
    return path


def sample(prompt: int, supervised: int, tokens: int = 5) -> tuple[list[int], list[int]]:
    """A sample of `prompt` unsupervised then `supervised` supervised tokens (ids from `tokens`)."""
    n = prompt + supervised
    return [tokens + (i % 400) for i in range(n)], [0] * prompt + [1] * supervised


def build(path: Path, samples: list[tuple[list[int], list[int]]]) -> Path:
    return save_dataset(path, [s[0] for s in samples], [s[1] for s in samples])


def fake_target(src: Path, dst: Path, **config) -> Path:
    """A copy of the tiny target whose config.json is patched (weights unchanged unless replaced)."""
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    raw.update(config)
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


def warm_start(path: Path, aux_ids: list[int], fc_inputs: int, hidden: int = 64) -> Path:
    """A speculators DFlash checkpoint folder: config.json + model.safetensors with fc.weight."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    config = {
        "speculators_model_type": "dflash",
        "aux_hidden_state_layer_ids": aux_ids,
        "block_size": 4,
        "mask_token_id": 511,
        "transformer_layer_config": {"model_type": "qwen3", "hidden_size": hidden, "num_hidden_layers": 1},
    }
    (path / "config.json").write_text(json.dumps(config))
    tensors = {"fc.weight": torch.zeros(hidden, fc_inputs), "norm.weight": torch.ones(hidden)}
    save_file(tensors, str(path / "model.safetensors"))
    return path


# ---------------------------------------------------------------- good inputs


def test_good_config_passes(make_config):
    report = preflight(make_config)
    assert report.ok and report.errors == []
    assert report.data["num_samples"] == 48 and report.data["usable"] == 48 and report.data["short"] == 0
    assert report.target["aux_ids"] == [1, 2] and report.target["num_layers"] == 4
    assert report.machine["disk"]["free_gb"] > report.machine["disk"]["need_gb"]
    assert report.machine["memory"]["available_gib"] > report.machine["memory"]["need_gib"]
    text = report.render_text()
    assert text.startswith("dflash preflight: OK") and "supervised tokens per sample" in text
    assert json.loads(json.dumps(report.to_dict()))["ok"] is True


def test_good_warm_start_passes(make_config, tmp_path):
    ckpt = warm_start(tmp_path / "ckpt", [1, 2], 2 * 64)
    report = preflight(make_config, drafter={"warm_start": str(ckpt)})
    assert report.ok, report.render_text()
    assert not [c for c in report.codes() if c.startswith("config.warm_start")]


def test_sharded_target_passes_and_counts_all_shards(tiny_target, make_config, tmp_path):
    from safetensors.torch import load_file, save_file

    target = fake_target(tiny_target, tmp_path / "sharded")
    tensors = load_file(str(target / "model.safetensors"))
    (target / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, str(target / shard))
    weight_map = {k: shard for shard, keys in halves.items() for k in keys}
    (target / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    report = preflight(make_config, target={"path": str(target)})
    assert report.ok, report.render_text()
    assert report.target["params"] == sum(t.numel() for t in tensors.values())


def test_specforge_convention_is_converted(make_config):
    report = preflight(make_config, drafter={"aux_layer_ids": [0, 1], "layer_id_convention": "specforge"})
    assert report.ok and report.target["aux_ids"] == [1, 2]
    top = preflight(make_config, drafter={"aux_layer_ids": [3], "layer_id_convention": "specforge"})
    assert top.ok and top.target["aux_ids"] == [4]
    assert "config.deep_layer_gap" not in top.codes()


def test_suggested_aux_ids_follow_specforge_spacing():
    assert suggest_aux_ids(36, 5) == [2, 10, 18, 26, 34]  # z-lab's [1, 9, 17, 25, 33]
    assert suggest_aux_ids(64, 5) == [2, 17, 32, 47, 62]  # SpecForge Qwen3.6-27B [1, 16, 31, 46, 61]
    assert suggest_aux_ids(4, 2) == [1, 4]  # too shallow for that spacing: spread over [1, L]


# ---------------------------------------------------------------- data gate


def test_short_responses_87_percent_refused(make_config, tmp_path):
    """The motivating disaster: most responses empty, exactly 6 supervised tokens each."""
    data = build(tmp_path / "ds", [sample(20, 6)] * 87 + [sample(20, 60)] * 13)
    report = preflight(make_config, data={"path": str(data)})
    problem = assert_problem(report, "data.short_responses", "87 of 100", "87.0%", "dflash regenerate")
    assert "most common count is 6" in problem.message
    assert "data.no_supervised_pair" not in report.codes()  # 6 tokens do form pairs: only this gate sees it
    assert {"supervised_tokens": "6", "samples": 87} in report.data["histogram"]


def test_greedy_empty_responses_refused(tiny_target, make_config, tmp_path):
    from trainer.demo.synth import greedy_dataset

    prompts = [[3 + i, 4 + i, 5 + i, 6 + i] for i in range(8)]
    data = greedy_dataset(tiny_target, prompts, 20, tmp_path / "ds", empty_fraction=0.87, seed=1)
    report = preflight(make_config, data={"path": str(data)})
    assert_problem(report, "data.short_responses", "dflash regenerate")
    assert_problem(report, "data.no_supervised_pair", "dflash regenerate")


def test_no_supervised_pair_refused(make_config, tmp_path):
    data = build(tmp_path / "ds", [sample(10, 1)] * 3 + [sample(10, 30)] * 7)
    report = preflight(make_config, data={"path": str(data)})
    assert_problem(report, "data.no_supervised_pair", "3 of 10", "dflash regenerate", "above")


def test_too_long_refused(make_config):
    report = preflight(make_config, data={"max_length": 32})
    assert_problem(report, "data.too_long", "48 of 48", "data.max_length", "longest sample: 64 tokens")
    assert report.data["usable"] == 0


def test_length_mismatch_refused(make_config, tmp_path):
    good = [sample(10, 30)] * 6
    bad = [(ids, mask[:-3]) for ids, mask in [sample(10, 30)] * 4]
    report = preflight(make_config, data={"path": str(build(tmp_path / "ds", good + bad))})
    assert_problem(report, "data.length_mismatch", "4 of 10", "one loss_mask entry per input id")


def test_token_ids_outside_vocab_refused(make_config, tmp_path):
    ids, mask = sample(10, 30)
    data = save_dataset(tmp_path / "ds", [ids, ids[:-1] + [700]], [mask, mask])
    report = preflight(make_config, data={"path": str(data)})
    assert_problem(report, "data.token_out_of_vocab", "[5, 700]", "512", "target's own tokenizer")


def test_missing_data_path_refused(make_config, tmp_path):
    report = preflight(make_config, data={"path": str(tmp_path / "nowhere")})
    assert_problem(
        report, "data.missing", "does not exist", "point data.path at a datasets.save_to_disk folder"
    )


def test_not_a_dataset_folder_refused(make_config, tmp_path):
    (tmp_path / "loose").mkdir()
    (tmp_path / "loose" / "train.jsonl").write_text("{}\n")
    report = preflight(make_config, data={"path": str(tmp_path / "loose")})
    assert_problem(report, "data.not_a_dataset", "no state.json", "save_to_disk")


def test_missing_columns_refused(make_config, tmp_path):
    data = datasets.Dataset.from_dict({"input_ids": [[5, 6, 7]], "labels": [[5, 6, 7]]})
    data.save_to_disk(str(tmp_path / "ds"))
    report = preflight(make_config, data={"path": str(tmp_path / "ds")})
    assert_problem(report, "data.missing_columns", "loss_mask", "input_ids and loss_mask per sample")


@pytest.mark.parametrize("how", ["no_shards", "zero_rows"])
def test_empty_dataset_refused(make_config, tmp_path, how):
    if how == "no_shards":
        features = datasets.Features(
            {c: datasets.Sequence(datasets.Value("int64")) for c in ("input_ids", "loss_mask")}
        )
        datasets.Dataset.from_dict({"input_ids": [], "loss_mask": []}, features=features).save_to_disk(
            str(tmp_path / "ds")
        )
    else:
        ds = datasets.Dataset.from_dict({"input_ids": [[5, 6]], "loss_mask": [[1, 1]]}).select([])
        ds.save_to_disk(str(tmp_path / "ds"))
    report = preflight(make_config, data={"path": str(tmp_path / "ds")})
    assert_problem(report, "data.empty", "no samples", "dflash regenerate")


def test_histogram_and_drop_counts_on_known_mix(make_config, tmp_path):
    mix = (
        [sample(10, 40)] * 10  # good
        + [sample(10, 6)] * 4  # short but trainable
        + [sample(10, 1)] * 2
        + [sample(12, 0)]  # no supervised pair
        + [sample(60, 40)] * 2  # too long for max_length 64 (100 tokens)
        + [(sample(10, 40)[0], sample(10, 40)[1][:-1])]  # length mismatch
    )
    data = build(tmp_path / "ds", mix)
    report = preflight(make_config, data={"path": str(data), "max_length": 64})
    d = report.data
    assert d["num_samples"] == 20 and d["usable"] == 14 and d["dropped"] == 6
    assert d["dropped_by_reason"] == {"no_supervised_pair": 3, "too_long": 2, "length_mismatch": 1}
    assert d["short"] == 7 and d["short_fraction"] == pytest.approx(0.35)
    hist = {row["supervised_tokens"]: row["samples"] for row in d["histogram"]}
    assert hist["0"] == 1 and hist["1"] == 2 and hist["6"] == 4 and hist["32-63"] == 13
    assert sum(hist.values()) == 20
    for code in ("data.no_supervised_pair", "data.too_long", "data.length_mismatch", "data.short_responses"):
        find(report, code)
    text = report.render_text()
    assert "20 samples, 14 usable, 6 dropped" in text and "no supervised pair 3" in text

    lenient = preflight(
        make_config, data={"path": str(data), "max_length": 64}, preflight={"max_bad_fraction": 0.5}
    )
    assert lenient.ok, lenient.render_text()
    assert_problem(lenient, "data.too_long", "within", warning=True)


# ---------------------------------------------------------------- config gate


def test_target_missing_refused(make_config, tmp_path):
    report = preflight(make_config, target={"path": str(tmp_path / "no-model")})
    assert_problem(report, "config.target_missing", "does not exist", "hf download")


def test_target_without_weights_refused(tiny_target, make_config, tmp_path):
    target = fake_target(tiny_target, tmp_path / "t")
    (target / "model.safetensors").unlink()
    report = preflight(make_config, target={"path": str(target)})
    assert_problem(report, "config.target_no_weights", "no *.safetensors", "hf download")


def test_target_without_config_refused(tiny_target, make_config, tmp_path):
    target = fake_target(tiny_target, tmp_path / "t")
    (target / "config.json").unlink()
    report = preflight(make_config, target={"path": str(target)})
    assert_problem(report, "config.target_no_config", "config.json", "hf download")


def test_target_config_incomplete_refused(tiny_target, make_config, tmp_path):
    target = fake_target(tiny_target, tmp_path / "t")
    raw = json.loads((target / "config.json").read_text())
    del raw["num_hidden_layers"]
    (target / "config.json").write_text(json.dumps(raw))
    report = preflight(make_config, target={"path": str(target)})
    assert_problem(report, "config.target_config_invalid", "num_hidden_layers", "target.path")


def test_sharded_target_missing_shard_refused(tiny_target, make_config, tmp_path):
    target = fake_target(tiny_target, tmp_path / "t")
    weight_map = {
        "lm_head.weight": "model.safetensors",
        "model.norm.weight": "model-00002-of-00002.safetensors",
    }
    (target / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    report = preflight(make_config, target={"path": str(target)})
    assert_problem(report, "config.target_missing_shards", "model-00002-of-00002.safetensors", "hf download")


def test_aux_ids_unsorted_refused(make_config):
    report = preflight(make_config, drafter={"aux_layer_ids": [2, 1]})
    assert_problem(report, "config.aux_ids_unsorted", "[2, 1]", "set drafter.aux_layer_ids to [1, 2]")


def test_aux_ids_duplicate_refused(make_config):
    report = preflight(make_config, drafter={"aux_layer_ids": [1, 2, 2]})
    assert_problem(report, "config.aux_ids_duplicate", "repeats [2]", "set drafter.aux_layer_ids to [1, 2]")


def test_aux_ids_empty_refused(make_config):
    report = preflight(make_config, drafter={"aux_layer_ids": []})
    assert_problem(report, "config.aux_ids_empty", "set drafter.aux_layer_ids")


def test_aux_ids_out_of_depth_refused(make_config):
    report = preflight(make_config, drafter={"aux_layer_ids": [1, 5]})
    assert_problem(report, "config.aux_ids_out_of_depth", "[5]", "4 layers", "ids in [1, 4]")


def test_aux_id_zero_is_out_of_depth_in_speculators_convention(make_config):
    report = preflight(make_config, drafter={"aux_layer_ids": [0, 2]})
    assert_problem(report, "config.aux_ids_out_of_depth", "[0]", "drafter.layer_id_convention")


def test_specforge_id_past_the_top_refused(make_config):
    report = preflight(make_config, drafter={"aux_layer_ids": [4], "layer_id_convention": "specforge"})
    assert_problem(report, "config.aux_ids_out_of_depth", "speculators ids [5]", "ids in [0, 3]")


def test_deep_layer_gap_is_a_warning(make_config):
    report = preflight(make_config)  # aux [1, 2] of 4 layers: half the depth unused
    assert report.ok
    assert_problem(report, "config.deep_layer_gap", "50%", "add a layer near the top", warning=True)
    assert "config.deep_layer_gap" not in preflight(make_config, drafter={"aux_layer_ids": [1, 4]}).codes()


def test_mask_token_outside_vocab_refused(make_config):
    report = preflight(make_config, drafter={"mask_token_id": 512})
    assert_problem(report, "config.mask_token_out_of_vocab", "0..511", "drafter.mask_token_id")


def test_mask_token_is_pad_refused(make_config):
    report = preflight(make_config, drafter={"mask_token_id": 0})
    assert_problem(report, "config.mask_token_special", "pad", "drafter.mask_token_id")


def test_mask_token_in_eos_list_refused(tiny_target, make_config, tmp_path):
    target = fake_target(tiny_target, tmp_path / "t", eos_token_id=[2, 7])
    report = preflight(make_config, target={"path": str(target)}, drafter={"mask_token_id": 7})
    assert_problem(report, "config.mask_token_special", "eos", "never pad/eos/bos")


def test_block_size_too_small_refused(make_config):
    report = preflight(make_config, drafter={"block_size": 1})
    assert_problem(report, "config.block_size_too_small", "drafter.block_size", "at least 2")


def test_full_attention_layer_out_of_range_refused(make_config):
    report = preflight(make_config, drafter={"sliding_window": 64, "full_attention_layers": [1]})
    assert_problem(report, "config.full_attention_layers_out_of_range", "[1]", "[0, 0]")


def test_warm_start_fc_wired_to_4_of_5_layers_refused(tiny_target, make_config, tmp_path):
    """The "drafter wired to 4 of 5 target layers" bug: config lists 5 layers, fc was built for 4."""
    target = fake_target(tiny_target, tmp_path / "t", num_hidden_layers=6)
    ckpt = warm_start(tmp_path / "ckpt", [1, 2, 3, 4, 5], fc_inputs=4 * 64)
    report = preflight(
        make_config,
        target={"path": str(target)},
        drafter={"aux_layer_ids": [1, 2, 3, 4, 5], "warm_start": str(ckpt)},
    )
    problem = assert_problem(report, "config.warm_start_fc_mismatch", "256 inputs", "4 target layers", "320")
    assert "retrain it" in problem.fix
    assert "config.warm_start_aux_mismatch" not in report.codes()


def test_warm_start_with_fewer_layers_refused(tiny_target, make_config, tmp_path):
    target = fake_target(tiny_target, tmp_path / "t", num_hidden_layers=6)
    ckpt = warm_start(tmp_path / "ckpt", [1, 2, 3, 5], fc_inputs=4 * 64)
    report = preflight(
        make_config,
        target={"path": str(target)},
        drafter={"aux_layer_ids": [1, 2, 3, 4, 5], "warm_start": str(ckpt)},
    )
    assert_problem(
        report,
        "config.warm_start_aux_mismatch",
        "4 target layers",
        "set drafter.aux_layer_ids to [1, 2, 3, 5]",
    )
    assert_problem(report, "config.warm_start_fc_mismatch", "set drafter.aux_layer_ids to [1, 2, 3, 5]")


def test_warm_start_hidden_mismatch_refused(make_config, tmp_path):
    ckpt = warm_start(tmp_path / "ckpt", [1, 2], fc_inputs=2 * 32, hidden=32)
    report = preflight(make_config, drafter={"warm_start": str(ckpt)})
    assert_problem(report, "config.warm_start_hidden_mismatch", "hidden size 32", "64", "drafter.warm_start")


def test_warm_start_missing_refused(make_config, tmp_path):
    report = preflight(make_config, drafter={"warm_start": str(tmp_path / "no-ckpt")})
    assert_problem(report, "config.warm_start_missing", "not a checkpoint folder", "drafter.warm_start")


def test_warm_start_other_ids_warned(make_config, tmp_path):
    ckpt = warm_start(tmp_path / "ckpt", [1, 3], 2 * 64)
    report = preflight(make_config, drafter={"warm_start": str(ckpt)})
    assert report.ok
    assert_problem(report, "config.warm_start_aux_ids_differ", "[1, 3]", warning=True)


# ---------------------------------------------------------------- safetensors headers


def test_safetensors_header_read_without_tensors(tiny_target):
    header = read_safetensors_header(tiny_target / "model.safetensors")
    assert header["lm_head.weight"]["shape"] == [512, 64]


@pytest.mark.parametrize("keep", [4, 20, -100], ids=["no-length", "cut-header", "cut-data"])
def test_truncated_safetensors_names_the_file(tiny_target, tmp_path, keep):
    blob = (tiny_target / "model.safetensors").read_bytes()
    path = tmp_path / "model.safetensors"
    path.write_bytes(blob[:keep])
    with pytest.raises(SafetensorsError, match=r"model\.safetensors: truncated safetensors file"):
        read_safetensors_header(path)


def test_not_safetensors_is_a_clear_error(tmp_path):
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", 5) + b"nope!")
    with pytest.raises(SafetensorsError, match="x.safetensors: not a safetensors file"):
        read_safetensors_header(path)


def test_truncated_target_weights_refused(tiny_target, make_config, tmp_path):
    target = fake_target(tiny_target, tmp_path / "t")
    blob = (target / "model.safetensors").read_bytes()
    (target / "model.safetensors").write_bytes(blob[: len(blob) // 2])
    report = preflight(make_config, target={"path": str(target)})
    assert_problem(
        report, "config.target_bad_safetensors", str(target / "model.safetensors"), "truncated", "hf download"
    )


# ---------------------------------------------------------------- machine gate


def test_disk_gate_refuses_huge_reserve(make_config):
    report = preflight(make_config, preflight={"disk_reserve_gb": 1e9})
    assert_problem(
        report, "machine.disk_space", "GB free", "preflight.disk_reserve_gb", "train.keep_checkpoints"
    )
    disk = report.machine["disk"]
    assert disk["checkpoints"] == 4 and disk["need_gb"] > disk["free_gb"]


def test_memory_gate_refuses_huge_target(tiny_target, make_config, tmp_path):
    import torch
    from safetensors.torch import save_file

    target = tmp_path / "huge"
    target.mkdir()
    huge = json.loads((tiny_target / "config.json").read_text())
    huge.update(
        hidden_size=16384,
        num_hidden_layers=80,
        intermediate_size=53248,
        num_attention_heads=128,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=32000,
    )
    (target / "config.json").write_text(json.dumps(huge))
    save_file({"x": torch.zeros(4)}, str(target / "model.safetensors"))
    cfg = load_config(make_config(drafter={"aux_layer_ids": [2, 40, 79]}), [f"target.path={target}"])
    report = run_preflight(cfg)
    assert_problem(report, "machine.memory", "GiB", "target_weights", "train.max_tokens_per_batch")
    mem = report.machine["memory"]
    assert mem["need_gib"] > mem["available_gib"] and mem["parts_gib"]["target_weights"] > 500

    cfg.preflight.check_memory = False
    skipped = run_preflight(cfg)
    assert "machine.memory" not in skipped.codes()
    assert skipped.machine["memory"] == {"skipped": "preflight.check_memory is false"}


# ---------------------------------------------------------------- everything at once


def test_every_problem_is_listed_together(make_config, tmp_path):
    data = build(tmp_path / "ds", [sample(20, 6)] * 8 + [sample(20, 1)] * 2)
    report = preflight(
        make_config,
        data={"path": str(data)},
        drafter={"aux_layer_ids": [2, 1, 9], "mask_token_id": 2, "block_size": 1},
        preflight={"disk_reserve_gb": 1e9},
    )
    expected = {
        "data.short_responses",
        "data.no_supervised_pair",
        "config.aux_ids_unsorted",
        "config.aux_ids_out_of_depth",
        "config.mask_token_special",
        "config.block_size_too_small",
        "machine.disk_space",
    }
    assert expected <= {p.code for p in report.errors}
    text = report.render_text()
    assert text.startswith("dflash preflight: REFUSED")
    assert all(f"[{code}]" in text for code in expected)
    listed = json.loads(json.dumps(report.to_dict()))
    assert listed["ok"] is False and expected <= {p["code"] for p in listed["errors"]}
    assert all(p["fix"] for p in listed["errors"])


# ---------------------------------------------------------------- more bad inputs


def test_unreadable_dataset_refused(tiny_data, make_config, tmp_path):
    data = shutil.copytree(tiny_data, tmp_path / "ds")
    for arrow in data.glob("*.arrow"):
        arrow.write_bytes(b"not arrow")
    report = preflight(make_config, data={"path": str(data)})
    assert_problem(report, "data.unreadable", "could not be loaded", "dflash regenerate")


def test_samples_longer_than_a_batch_warned(make_config):
    report = preflight(make_config, train={"max_tokens_per_batch": 32})
    assert report.ok
    assert_problem(
        report, "data.truncated_samples", "48 usable samples", "train.max_tokens_per_batch", warning=True
    )


def test_mask_token_in_data_warned(make_config, tmp_path):
    ids, mask = sample(10, 30)
    data = save_dataset(tmp_path / "ds", [ids, ids[:-1] + [511]], [mask, mask])
    report = preflight(make_config, data={"path": str(data)})
    assert_problem(report, "data.mask_token_in_data", "occurs 1 times", "drafter.mask_token_id", warning=True)


def test_warm_start_without_weights_refused(make_config, tmp_path):
    ckpt = warm_start(tmp_path / "ckpt", [1, 2], 2 * 64)
    (ckpt / "model.safetensors").unlink()
    report = preflight(make_config, drafter={"warm_start": str(ckpt)})
    assert_problem(report, "config.warm_start_no_weights", "no *.safetensors", "drafter.warm_start")


def test_warm_start_of_another_model_type_refused(make_config, tmp_path):
    ckpt = warm_start(tmp_path / "ckpt", [1, 2], 2 * 64)
    raw = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**raw, "speculators_model_type": "eagle3"}))
    report = preflight(make_config, drafter={"warm_start": str(ckpt)})
    assert_problem(report, "config.warm_start_not_dflash", "'eagle3'", "DFlash checkpoint")


def test_out_dir_over_a_file_refused(make_config, tmp_path):
    (tmp_path / "occupied").write_text("")
    report = preflight(make_config, out_dir=str(tmp_path / "occupied" / "run"))
    assert_problem(report, "machine.out_dir_not_writable", "not a writable folder", "set out_dir")


def test_cuda_requested_is_measured_on_the_gpu_and_refused_without_one(make_config, capsys):
    """Without CUDA (this machine) `train.device: cuda` is refused: exit 2, the cause named (it was
    a warning, and `dflash train` then stopped in setup_dist with a traceback)."""
    import torch

    from trainer.cli import main

    report = preflight(make_config, train={"device": "cuda"})
    if torch.cuda.is_available():  # a GPU machine: the CUDA branch measures the real device
        assert "machine.cuda_unavailable" not in report.codes()
        memory = report.machine["memory"]
        assert memory["device"].startswith("cuda:") and memory["available_gib"] > 0
        assert memory["need_gib"] == pytest.approx(sum(memory["parts_gib"].values()))
        return
    assert_problem(report, "machine.cuda_unavailable", "torch sees no CUDA", "CPU build", "train.device")
    assert "skipped" in report.machine["memory"]
    assert main(["preflight", "--config", str(make_config(train={"device": "cuda"}))]) == 2
    assert "ERROR [machine.cuda_unavailable]" in capsys.readouterr().out
    assert main(["train", "--config", str(make_config(train={"device": "cuda"}))]) == 2
    assert "torch sees no CUDA" in capsys.readouterr().err, "refused with its cause, no traceback"


def test_memory_within_10_percent_of_the_device_is_a_warning(make_config, monkeypatch):
    from trainer.preflight import machine

    # a device of a chosen size cannot be had here: only the free-memory probe is replaced (a stand-in
    # for the hardware); the run's memory estimate and the gate's thresholds are the real ones
    need = preflight(make_config).machine["memory"]["need_gib"] * 2**30
    for available, code in (
        (need / 0.95, "machine.memory_tight"),
        (need / 0.5, None),
        (need * 0.9, "machine.memory"),
    ):
        monkeypatch.setattr(
            machine,
            "probe_device_memory",
            lambda _d, a=available: machine.DeviceMemory("fake", int(a), False),
        )
        report = preflight(make_config)
        memory_codes = [c for c in report.codes() if c.startswith("machine.memory")]
        assert memory_codes == ([code] if code else []), (available / need, memory_codes)


def test_warm_start_with_a_missing_shard_refused(make_config, tmp_path):
    ckpt = warm_start(tmp_path / "ckpt", [1, 2], 2 * 64)
    (ckpt / "model.safetensors").rename(ckpt / "model-00001-of-00002.safetensors")
    index = {
        "weight_map": {
            "fc.weight": "model-00001-of-00002.safetensors",
            "norm.weight": "model-00002-of-00002.safetensors",
        }
    }
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    report = preflight(make_config, drafter={"warm_start": str(ckpt)})
    assert_problem(
        report, "config.warm_start_missing_shards", "model-00002-of-00002.safetensors", "drafter.warm_start"
    )


def test_warm_start_with_broken_safetensors_refused(make_config, tmp_path):
    ckpt = warm_start(tmp_path / "ckpt", [1, 2], 2 * 64)
    blob = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(blob[:20])
    report = preflight(make_config, drafter={"warm_start": str(ckpt)})
    assert_problem(report, "config.warm_start_bad_safetensors", "model.safetensors", "drafter.warm_start")


# ---------------------------------------------------------------- target.source: vllm


def test_a_vllm_source_passes_and_its_trainer_holds_no_target(make_config):
    hooked = preflight(make_config)
    report = preflight(make_config, target={"source": "vllm"})
    assert report.ok, report.render_text()
    need = report.machine["memory"]["need_gib"]
    assert need < hooked.machine["memory"]["need_gib"], "no target weights or forward on the trainer"


def test_a_vllm_source_with_a_split_copy_or_a_bad_tensor_parallel_size_is_refused(make_config):
    report = preflight(
        make_config, target={"source": "vllm", "gpus_per_copy": 2, "vllm.tensor_parallel_size": 3}
    )
    assert_problem(report, "config.vllm_gpus_per_copy", "target.gpus_per_copy 2", "drop")
    assert_problem(report, "config.vllm_tensor_parallel", "does not divide", "attention heads")


def test_a_vllm_source_that_must_start_a_server_needs_vllm_installed(make_config, monkeypatch):
    """The one thing faked: that vLLM is missing from this venv (it is installed here)."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a)
    )
    report = preflight(make_config, target={"source": "vllm"})
    assert_problem(report, "config.vllm_not_installed", "not installed", "target.vllm.url")
    ok = preflight(make_config, target={"source": "vllm", "vllm.url": "http://127.0.0.1:8100"})
    assert "config.vllm_not_installed" not in ok.codes()


def test_a_vllm_url_that_is_not_http_is_a_config_error(make_config):
    from trainer.config.run import ConfigError, load_config

    with pytest.raises(ConfigError, match="http:// or https://"):
        load_config(make_config(), ["target.source=vllm", "target.vllm.url=127.0.0.1:8100"])


def test_a_draft_vocabulary_is_checked_against_the_vocabulary_and_the_datas_tokens(make_config):
    """drafter.draft_vocab_size at the vocabulary is refused; a size that keeps too few of the supervised
    tokens warns with the share (the drafter can never propose the rest); a generous one is quiet and
    reports its coverage."""
    assert_problem(
        preflight(make_config, drafter={"draft_vocab_size": 512}),
        "config.draft_vocab_too_large",
        "512",
        "(512)",
    )
    low = preflight(make_config, drafter={"draft_vocab_size": 8})
    assert low.ok and low.data["draft_vocab_coverage"] < 0.95
    assert_problem(low, "data.draft_vocab_coverage_low", "drafter.draft_vocab_size 8 keeps", warning=True)
    wide = preflight(make_config, drafter={"draft_vocab_size": 500})
    assert "data.draft_vocab_coverage_low" not in wide.codes() and wide.data["draft_vocab_coverage"] >= 0.95


def test_the_issues_case_a_1024_position_target_and_1024_token_batches_is_refused(
    tiny_target, make_config, tmp_path
):
    """A tiny Qwen3 with max_position_embeddings 1024, train.max_tokens_per_batch 1024: the server
    would be asked for max_model_len 1025 and refuse to load; preflight refuses first, naming the fix."""
    target = fake_target(tiny_target, tmp_path / "short", max_position_embeddings=1024)
    report = preflight(make_config, target={"path": str(target), "source": "vllm"})
    assert_problem(
        report,
        "config.vllm_context_too_long",
        "train.max_tokens_per_batch 1024 needs max_model_len 1025",
        "the target allows 1024 (max_position_embeddings 1024)",
        "lower train.max_tokens_per_batch to <= 1023",
    )
    fits = preflight(
        make_config, target={"path": str(target), "source": "vllm"}, train={"max_tokens_per_batch": 1023}
    )
    assert fits.ok, fits.render_text()
    assert fits.target["vllm_server"]["max_model_len"] == 1024 and "max_model_len 1024" in fits.render_text()
    short_docs = preflight(
        make_config, target={"path": str(target), "source": "vllm"}, data={"max_length": 512}
    )
    assert short_docs.ok and short_docs.target["vllm_server"]["max_model_len"] == 513
    hooked = preflight(make_config, target={"path": str(target)})
    assert "config.vllm_context_too_long" not in hooked.codes(), "only a server has the limit"


def test_what_the_server_is_asked_for_follows_the_targets_limit(tiny_target, make_config, tmp_path):
    """target.vllm.max_model_len above the limit is capped where the run still fits (a warning), one
    below the run's need is refused; data.max_length binding names data.max_length; float16 on a model
    type vLLM refuses in float16 is refused."""
    target = fake_target(tiny_target, tmp_path / "short", max_position_embeddings=1024)
    vllm = {"path": str(target), "source": "vllm"}
    capped = preflight(make_config, target={**vllm, "vllm.max_model_len": 4096}, data={"max_length": 600})
    assert capped.ok and capped.target["vllm_server"]["max_model_len"] == 1024
    assert_problem(capped, "config.vllm_context_capped", "4096", "started with 1024", warning=True)
    short = preflight(make_config, target={**vllm, "vllm.max_model_len": 256}, data={"max_length": 600})
    assert_problem(short, "config.vllm_context_too_short", "256", ">= 601")
    long_data = preflight(
        make_config, target=vllm, data={"max_length": 2000}, train={"max_tokens_per_batch": 4096}
    )
    assert_problem(long_data, "config.vllm_context_too_long", "data.max_length 2000", "<= 1023")
    gemma = fake_target(tiny_target, tmp_path / "gemma", model_type="gemma3_text")
    fp16 = preflight(make_config, target={"path": str(gemma), "source": "vllm", "dtype": "float16"})
    assert_problem(fp16, "config.vllm_dtype", "gemma3_text", "bfloat16")


MPE = "max_position_embeddings"
LINEAR2 = {"rope_type": "linear", "factor": 2.0}


@pytest.mark.parametrize(
    ("conf", "tokens", "why"),
    [
        ({MPE: 1024}, 1024, "max_position_embeddings 1024"),
        ({MPE: 4096, "seq_length": 2048}, 2048, "seq_length 2048"),
        ({MPE: 1024, "rope_scaling": {"type": "linear", "factor": 4.0}}, 4096, "x rope factor 4"),
        ({MPE: 1024, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, 2048, "dynamic"),
        ({MPE: 32768, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, 32768, "embeddings 32768"),
        (
            {MPE: 1024, "rope_parameters": {"full_attention": LINEAR2, "sliding_attention": {}}},
            2048,
            "linear",
        ),
        ({MPE: 1024, "model_max_length": 8192}, 8192, "model_max_length 8192"),
        ({}, None, "names no context length"),
    ],
)
def test_the_context_limit_is_derived_as_vllm_derives_it(conf, tokens, why):
    from trainer.preflight.vllm_request import context_limit

    got = context_limit({"model_type": "qwen3", **conf}, environ={})
    assert got.tokens == tokens and why in got.why, got
    assert (
        context_limit({"max_position_embeddings": 8}, environ={"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}).tokens
        is None
    )


# ---------------------------------------------------------------- /dev/shm for an owned vLLM server


@pytest.fixture
def small_shm(tmp_path):
    """A real 64 MiB tmpfs: the /dev/shm a container runtime gives by default (Docker's and podman's
    --shm-size), which the rented-node journey met."""
    with real_tmpfs(tmp_path / "shm", "64m") as shm:
        yield shm


def test_an_owned_vllm_server_on_a_64_mib_dev_shm_is_refused_before_it_starts(make_config, small_shm):
    from trainer.preflight.shm import shm_gate

    cfg = load_config(make_config(), ["target.source=vllm"])
    target = TargetInfo.from_config(read_config(cfg.target.path), cfg.target.path / "config.json")
    report = PreflightReport()
    shm_gate(cfg, target, report, shm=small_shm, cpu=True)
    problem = assert_problem(report, "machine.shm_too_small", "--shm-size", "engine queues", "storage_dir")
    assert "64 MiB free" in problem.message and report.machine["shm"]["need_mib"] > 240
    # the spool on disk leaves vLLM's own queues, which still do not fit
    on_disk = load_config(make_config(), ["target.source=vllm", f"target.vllm.storage_dir={cfg.out_dir}"])
    report = PreflightReport()
    shm_gate(on_disk, target, report, shm=small_shm, cpu=True)
    assert report.machine["shm"]["need_mib"] == 240 and not report.ok
    # a server of someone else's (target.vllm.url) or the hooked source: nothing to check here
    for overrides in (["target.source=vllm", "target.vllm.url=http://127.0.0.1:8100"], []):
        report = PreflightReport()
        shm_gate(load_config(make_config(), overrides), target, report, shm=small_shm, cpu=True)
        assert report.ok and "shm" not in report.machine


def test_a_large_enough_dev_shm_passes_and_is_reported(make_config, tmp_path):
    from trainer.preflight.shm import shm_gate

    cfg = load_config(make_config(), ["target.source=vllm"])
    report = PreflightReport()
    shm_gate(cfg, None, report, shm=tmp_path, cpu=True)  # this machine's disk: gigabytes free
    assert report.ok and report.machine["shm"]["free_mib"] > report.machine["shm"]["need_mib"]


# ---------------------------------------------------------------- the eval: child (issue 46)


def test_the_eval_child_is_counted_on_the_gpus_it_names(make_config, monkeypatch):
    """Preflight counts the `eval:` child with the plan's arithmetic on the GPUs this node has (given
    here: no GPU runs in this suite): GPUs too small for the harness, GPUs the run's own ranks take
    or that the node lacks are refused; rank 0's GPU must hold the trainer and the harness together."""
    from trainer.preflight import evaluation

    gib = 2**30
    monkeypatch.setattr(evaluation, "visible_gpu_memory", lambda: [16 * gib] * 4)
    monkeypatch.setenv("WORLD_SIZE", "1")
    prompts = {"prompts": "mt-bench"}
    monkeypatch.setattr(evaluation, "_prompt_set", lambda cfg, report: None)
    ok = preflight(make_config, eval={**prompts, "device": "cuda:2,3"})
    assert not [p for p in ok.errors if p.code.startswith("eval.")], ok.render_text()
    assert ok.machine["evaluation"]["device"] == "cuda:2,3"
    assert_problem(preflight(make_config, eval={**prompts, "device": "cuda:0,3"}), "eval.gpus", "[0]", "own")
    assert_problem(
        preflight(make_config, eval={**prompts, "device": "cuda:7"}), "eval.gpus", "not on this node"
    )
    assert not [p for p in preflight(make_config, eval=prompts).errors if p.code.startswith("eval.")]
    # 1 GiB GPUs: the harness's CUDA reserve alone fills 92 % of one
    monkeypatch.setattr(evaluation, "visible_gpu_memory", lambda: [1 * gib] * 4)
    assert_problem(
        preflight(make_config, eval={**prompts, "device": "cuda:3"}), "eval.no_room", "dflash plan"
    )
    assert_problem(preflight(make_config, eval=prompts), "eval.no_room", "rank 0's GPU", "eval.device: cpu")
    # no GPU here: said, not refused
    monkeypatch.setattr(evaluation, "visible_gpu_memory", lambda: [])
    assert "skipped" in preflight(make_config, eval={**prompts, "device": "cuda:3"}).machine["evaluation"]


def test_a_named_set_missing_from_the_services_cache_is_a_warning(make_config, monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    from trainer.eval import benchmarks

    benchmarks.fetch.cache_clear()
    report = preflight(make_config, eval={"prompts": "math500", "device": "cpu"})
    assert_problem(report, "eval.prompt_set_missing", "hf download HuggingFaceH4/MATH-500", warning=True)
    benchmarks.fetch.cache_clear()
