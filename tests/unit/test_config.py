"""The run config contract: typed, unknown keys refused, overrides, conventions, paths."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trainer.config.run import ConfigError, apply_overrides, load_config
from trainer.config.schema import schema_reference

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
    from trainer.config.schema import schema_markdown

    page = (REPO / "docs" / "reference" / "config.md").read_text()
    assert schema_markdown() in page, (
        "docs/reference/config.md is stale: regenerate with `dflash config --markdown`"
    )


# ---------------------------------------------------------------- finite numbers, declared ranges
def _float_fields():
    from trainer.config.schema import float_fields

    return float_fields()


def _with(key: str, value) -> dict:
    """MINIMAL with the dotted `key` set to `value` (sections made as needed)."""
    raw = yaml.safe_load(yaml.safe_dump(MINIMAL))
    node = raw
    *sections, leaf = key.split(".")
    for s in sections:
        node = node.setdefault(s, {})
    node[leaf] = value
    return raw


def _candidates(field, bad: float) -> list:
    """`bad` in the field's place: alone, or in each item of a tuple field (`betas`)."""
    default = field.get_default(call_default_factory=True)
    if isinstance(default, tuple):
        return [[bad if i == j else v for j, v in enumerate(default)] for i in range(len(default))]
    return [bad]


FLOATS = [key for key, _ in _float_fields()]


def test_the_schema_has_the_float_keys_the_issue_names():
    """The enumeration the tests below run over comes from the schema itself; it finds them all."""
    for key in ("train.lr", "train.betas", "train.grad_clip", "train.weight_decay", "train.muon_lr"):
        assert key in FLOATS
    for key in ("train.gamma", "train.stop_timeout_s", "target.vllm.request_timeout_s"):
        assert key in FLOATS
    assert len(FLOATS) >= 20


@pytest.mark.parametrize("key", FLOATS)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")], ids=["inf", "-inf", "nan"])
def test_every_float_key_refuses_infinity_and_nan_naming_the_key(tmp_path, key, bad):
    """`lr: .inf` (or .nan) in run.yaml is refused at config time, naming the key, for every float
    of the run config: the file holds the YAML spelling (.inf, .nan) as a user would write it."""
    field = dict(_float_fields())[key]
    for value in _candidates(field, bad):
        path = write(tmp_path, _with(key, value))
        assert (".nan" if bad != bad else ".inf") in path.read_text()
        with pytest.raises(ConfigError) as err:
            load_config(path)
        assert f"{key}" in str(err.value) and "finite number" in str(err.value), str(err.value)


def _outside(m) -> float:
    import annotated_types as at

    for name, cls in (("gt", at.Gt), ("lt", at.Lt)):
        if isinstance(m, cls):
            return float(getattr(m, name))  # the open end itself is outside
    bound = float(m.ge if isinstance(m, at.Ge) else m.le)
    step = max(abs(bound) * 1e-3, 1e-3)
    return bound - step if isinstance(m, at.Ge) else bound + step


@pytest.mark.parametrize("key", FLOATS)
def test_every_float_key_declares_a_range_its_default_keeps_and_values_past_it_are_refused(tmp_path, key):
    """Each float declares both ends of its range beside its default (a timeout of 1e300 s overflows
    a timer; `betas: [1.0, 0.95]` never forgets); the default lies inside; just past either end is
    refused naming the key."""
    import annotated_types as at

    from trainer.config.schema import bounds

    field = dict(_float_fields())[key]
    declared = bounds(field)
    assert any(isinstance(m, at.Gt | at.Ge) for m in declared), f"{key}: no lower bound"
    assert any(isinstance(m, at.Lt | at.Le) for m in declared), f"{key}: no upper bound"
    default = field.get_default(call_default_factory=True)
    cfg = load_config(write(tmp_path, _with(key, list(default) if isinstance(default, tuple) else default)))
    assert cfg is not None
    for m in declared:
        for value in _candidates(field, _outside(m)):
            with pytest.raises(ConfigError) as err:
                load_config(write(tmp_path, _with(key, value)))
            assert key in str(err.value), str(err.value)


def test_set_overrides_refuse_nonfinite_numbers_too(tmp_path):
    with pytest.raises(ConfigError, match=r"train\.lr: Input should be a finite number"):
        load_config(write(tmp_path, MINIMAL), ["train.lr=.inf"])
    with pytest.raises(ConfigError, match=r"train\.betas\.1"):
        load_config(write(tmp_path, MINIMAL), ["train.betas=[0.9, .nan]"])
    with pytest.raises(ConfigError, match=r"train\.grad_clip"):
        load_config(write(tmp_path, MINIMAL), ["train.grad_clip=-1"])


def test_the_reference_page_gives_each_float_its_range():
    from trainer.config.schema import schema_markdown

    rows = {line.split("|")[1].strip(" `"): line for line in schema_markdown().splitlines()[2:]}
    assert "`(0, 1]`" in rows["train.lr"] and "`[0, 1)`" in rows["train.betas"]
    assert "`(0, 2592000]`" in rows["train.stop_timeout_s"]


# ---------------------------------------------------------------- duplicate keys
RUN_YAML_TWICE = """\
target: {path: target}
data: {path: data}
drafter: {num_layers: 1, block_size: 4, aux_layer_ids: [1, 2], mask_token_id: 511}
out_dir: out
train:
  max_steps: 30
  lr: 3.0e-4
  seed: 0
  lr: 1.0
"""


def test_a_key_said_twice_is_refused_naming_the_key_and_both_lines(tmp_path):
    """YAML keeps the last of two equal keys silently (`lr: 3e-4` ... `lr: 1.0` would train at 1.0);
    the run config refuses the file instead."""
    path = tmp_path / "run.yaml"
    path.write_text(RUN_YAML_TWICE)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"{path}: duplicate key train.lr on line 9 (first on line 7): keep one"
    path.write_text(RUN_YAML_TWICE.replace("  lr: 1.0\n", "") + "out_dir: elsewhere\n")
    with pytest.raises(ConfigError, match="duplicate key out_dir on line 9 .first on line 4."):
        load_config(path)
    path.write_text(RUN_YAML_TWICE.replace("  lr: 1.0\n", "").replace("[1, 2]", "[1, 2], num_layers: 2"))
    with pytest.raises(ConfigError, match=r"duplicate key drafter.num_layers on line 3, column \d+"):
        load_config(path)


def test_a_key_said_twice_in_a_set_value_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="duplicate key a on line 1"):
        load_config(write(tmp_path, MINIMAL), ["train.betas={a: 1, a: 2}"])


def test_merge_keys_still_override_and_distinct_keys_still_load(tmp_path):
    """A YAML merge (`<<: *base`) then an override is not a duplicate; the file loads as before."""
    path = tmp_path / "run.yaml"
    path.write_text(
        RUN_YAML_TWICE.replace("  lr: 1.0\n", "")
        + "preflight: &pf {max_bad_fraction: 0.2, disk_reserve_gb: 1.0}\n"
        + "trackers:\n  project: x\n"
    )
    assert load_config(path).preflight.max_bad_fraction == 0.2
    from trainer.config.user_yaml import safe_load

    assert safe_load("base: &b {x: 1, y: 2}\nd:\n  <<: *b\n  x: 3\n")["d"] == {"x": 3, "y": 2}


def test_user_yaml_names_keys_through_sequences_and_equal_scalars():
    import yaml as pyyaml

    from trainer.config.user_yaml import DuplicateKeyError, TooDeepError, safe_load

    with pytest.raises(
        DuplicateKeyError, match=r"duplicate key hosts\[1\]\.port on line 5 \(first on line 4\)"
    ):
        safe_load("hosts:\n  - {name: a}\n  - name: b\n    port: 1\n    port: 2\n")
    with pytest.raises(DuplicateKeyError, match="duplicate key 1 on line 2"):
        safe_load("1: a\n0x1: b\n")  # one integer, spelled twice
    assert safe_load('1: a\n"1": b\n') == {1: "a", "1": "b"}  # an int and a string: two keys
    with pytest.raises(TooDeepError):
        safe_load("[" * 20000 + "]" * 20000)
    assert issubclass(DuplicateKeyError, pyyaml.YAMLError)  # callers' `except yaml.YAMLError` hold


def _dflash(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "trainer.cli", *args], capture_output=True, text=True, env=env, timeout=120
    )


def test_the_verbs_refuse_bad_numbers_and_twice_said_keys_with_exit_2_naming_the_key(tmp_path):
    """What `dflash preflight` / `train` / `config` / `service sandbox` do with such a file: exit 2, the
    key named on stderr, no traceback, nothing created."""
    path = write(tmp_path, _with("train.lr", float("inf")))
    for verb in ("preflight", "train"):
        r = _dflash(verb, "--config", str(path))
        assert r.returncode == 2, (verb, r.stdout, r.stderr)
        assert "train.lr: Input should be a finite number" in r.stderr and "Traceback" not in r.stderr
    r = _dflash("train", "--config", str(write(tmp_path, _with("train.betas", [0.9, float("nan")]))))
    assert r.returncode == 2 and "train.betas.1: Input should be a finite number" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists(), "refused before the run folder exists"
    twice = tmp_path / "twice.yaml"
    twice.write_text(RUN_YAML_TWICE)
    for verb in ("config", "preflight", "train"):
        r = _dflash(verb, "--config", str(twice))
        assert r.returncode == 2 and "Traceback" not in r.stderr, (verb, r.stderr)
        assert r.stderr.strip().splitlines() == [
            f"dflash {verb}: {twice}: duplicate key train.lr on line 9 (first on line 7): keep one"
        ]
    r = _dflash("service", "sandbox", "--facts-json", "gpus: 1\ngpus: 2\n")
    assert r.returncode == 2 and "duplicate key gpus on line 2 (first on line 1)" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
