"""Fixtures the integration tests share: runs that several tests compare against, made once."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def ddp_run(tiny_target, tiny_data, tmp_path_factory) -> Path:
    """The run folder of one uninterrupted 2-rank `torchrun --standalone` run on gloo with the default
    shard level (ZeRO-1), test_train_ranks.COMMON's recipe: the reference that the accumulating single
    process, the ZeRO-1 resume and plain AdamW (test_train_ranks.py) and the two node ranks with their
    kill (test_train_nodes.py) must each end at. Read it, never write into it."""
    from tests.integration.test_train import cfg_file
    from tests.integration.test_train_ranks import COMMON, run_torchrun

    root = tmp_path_factory.mktemp("ddp-reference")
    res = run_torchrun(cfg_file(root, tiny_target, tiny_data, name="run", **COMMON))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return root / "run"


@pytest.fixture(scope="session")
def ddp_unsharded_run(tiny_target, tiny_data, tmp_path_factory) -> Path:
    """The same run with `train.shard: none` (DDP, plain AdamW on each rank): what ZeRO-1 must train
    to rounding and what FSDP2 must end at, and whose step-3 checkpoint FSDP2 resumes (one format)."""
    from tests.integration.test_train import cfg_file
    from tests.integration.test_train_ranks import COMMON, run_torchrun

    root = tmp_path_factory.mktemp("ddp-unsharded")
    res = run_torchrun(cfg_file(root, tiny_target, tiny_data, name="run", shard="none", **COMMON))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return root / "run"
