"""Shared fixtures: tiny real models and datasets built on the spot (no downloads)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import yaml

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> Path:
    from trainer.synth import tiny_target as build

    return build(tmp_path_factory.mktemp("target") / "qwen3-tiny")


@pytest.fixture(scope="session")
def tiny_data(tiny_target, tmp_path_factory) -> Path:
    from trainer.synth import greedy_dataset

    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, size=8).tolist() for _ in range(48)]
    return greedy_dataset(tiny_target, prompts, 56, tmp_path_factory.mktemp("data") / "ds")


def write_config(path: Path, target_path: Path, data_path: Path, out_path: Path, **sections) -> Path:
    """A run.yaml like the issue's example; `sections` update (dicts) or replace (scalars) keys."""
    raw = {
        "target": {"path": str(target_path)},
        "data": {"path": str(data_path)},
        "drafter": {"num_layers": 1, "block_size": 4, "aux_layer_ids": [1, 2], "mask_token_id": 511},
        "train": {"max_steps": 30, "lr": 3.0e-4, "seed": 0, "checkpoint_every": 5, "max_tokens_per_batch": 1024},
        "out_dir": str(out_path),
    }
    for key, value in sections.items():
        if isinstance(value, dict):
            raw.setdefault(key, {}).update(value)
        else:
            raw[key] = value
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture
def make_config(tiny_target, tiny_data, tmp_path):
    def make(**sections) -> Path:
        return write_config(tmp_path / "run.yaml", tiny_target, tiny_data, tmp_path / "out", **sections)

    return make
