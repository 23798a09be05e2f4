"""The run config contract: typed, unknown keys refused, overrides, conventions, paths."""

from pathlib import Path

import pytest
import yaml

from trainer.config import ConfigError, apply_overrides, load_config
from trainer.config_schema import schema_reference

MINIMAL = {
    "target": {"path": "target"},
    "data": {"path": "data"},
    "drafter": {"num_layers": 1, "block_size": 4, "aux_layer_ids": [1, 2], "mask_token_id": 511},
    "train": {"max_steps": 30, "lr": 3.0e-4, "seed": 0, "checkpoint_every": 5, "max_tokens_per_batch": 1024},
    "out_dir": "out",
}


def write(tmp_path: Path, raw) -> Path:
    p = tmp_path / "run.yaml"
    p.write_text(yaml.safe_dump(raw))
    return p


def test_issue_example_is_accepted_and_paths_resolve_against_the_file(tmp_path):
    cfg = load_config(write(tmp_path, MINIMAL))
    assert cfg.train.max_steps == 30 and cfg.drafter.block_size == 4
    assert cfg.target.path == (tmp_path / "target").resolve()
    assert cfg.out_dir == (tmp_path / "out").resolve()
    # paper/SpecForge defaults for what the file does not say
    assert cfg.train.loss == "ce" and cfg.train.gamma == 7.0 and cfg.train.max_anchors == 512
    assert cfg.train.grad_clip == 1.0 and cfg.train.schedule == "cosine"


def test_unknown_keys_are_errors_naming_each_key(tmp_path):
    raw = {**MINIMAL, "trian": {}, "drafter": {**MINIMAL["drafter"], "aux_layers": [1]}}
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, raw))
    msg = str(err.value)
    assert "trian: unknown key" in msg and "drafter.aux_layers: unknown key" in msg


def test_missing_required_and_bad_types_are_listed_together(tmp_path):
    raw = {k: v for k, v in MINIMAL.items() if k != "out_dir"}
    raw["train"] = {**MINIMAL["train"], "lr": "fast"}
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, raw))
    assert "out_dir: required key is missing" in str(err.value)
    assert "train.lr" in str(err.value)


def test_set_overrides_are_typed_yaml(tmp_path):
    cfg = load_config(
        write(tmp_path, MINIMAL),
        ["train.lr=1e-3", "drafter.aux_layer_ids=[1, 3]", "train.loss=kl_div", "train.warmup_steps=2"],
    )
    assert cfg.train.lr == 1e-3 and cfg.drafter.aux_layer_ids == [1, 3]
    assert cfg.train.loss == "kl_div" and cfg.train.resolved_warmup_steps == 2


def test_the_replaced_shard_optimizer_state_key_maps_to_train_shard(tmp_path):
    """An older run.yaml (train.shard_optimizer_state, a boolean) still loads, as train.shard; a
    file that says both and disagrees is refused, naming the key to keep."""

    def train(**kw):
        return load_config(write(tmp_path, {**MINIMAL, "train": {**MINIMAL["train"], **kw}})).train

    assert train().shard == "optimizer"
    assert train(shard_optimizer_state=True).shard == "optimizer"
    assert train(shard_optimizer_state=False).shard == "none"
    assert train(shard_optimizer_state=False, shard="none").shard == "none"
    with pytest.raises(ConfigError, match="keep only train.shard"):
        train(shard_optimizer_state=True, shard="full")
    with pytest.raises(ConfigError, match="must be true or false"):
        train(shard_optimizer_state="yes")
    with pytest.raises(ConfigError, match="train.shard"):
        train(shard="zero3")


def test_set_override_of_unknown_key_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="train.lrr: unknown key"):
        load_config(write(tmp_path, MINIMAL), ["train.lrr=1"])
    with pytest.raises(ConfigError, match="expected KEY.PATH=VALUE"):
        apply_overrides({}, ["train.lr"])


def test_specforge_convention_is_converted_explicitly(tmp_path):
    raw = {
        **MINIMAL,
        "drafter": {
            **MINIMAL["drafter"],
            "aux_layer_ids": [1, 9, 17, 25, 33],
            "layer_id_convention": "specforge",
        },
    }
    cfg = load_config(write(tmp_path, raw))
    assert cfg.drafter.aux_ids == [2, 10, 18, 26, 34]  # DFLASH.md: z-lab's Qwen3-8B ids
    default = load_config(write(tmp_path, MINIMAL))
    assert default.drafter.aux_ids == [1, 2]


def test_wrong_schema_version_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="schema_version"):
        load_config(write(tmp_path, {**MINIMAL, "schema_version": 99}))


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("target: {path: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_schema_reference_lists_every_leaf_key():
    keys = {row[0] for row in schema_reference()}
    for k in (
        "target.path",
        "data.path",
        "drafter.aux_layer_ids",
        "drafter.layer_id_convention",
        "train.max_tokens_per_batch",
        "train.keep_checkpoints",
        "preflight.min_supervised_tokens",
        "out_dir",
    ):
        assert k in keys


def test_docs_reference_lists_the_current_schema():
    from tests.conftest import REPO
    from trainer.config_schema import schema_markdown

    page = (REPO / "docs" / "reference" / "config.md").read_text()
    assert schema_markdown() in page, (
        "docs/reference/config.md is stale: regenerate with `dflash config --markdown`"
    )
