"""Fixtures the integration tests share: runs that several tests compare against, made once."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
from pathlib import Path

import pytest

from tests.families import family_exported, family_run, family_trained  # noqa: F401  (the family matrix's)


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


# ------------------------------------------------- `dflash` verbs in this process (imports paid once)
def dflash_here(*args) -> subprocess.CompletedProcess:
    """`dflash ARGS` in this process, output captured like a subprocess's: on one torch thread (what
    OMP_NUM_THREADS=1 gives a subprocess; two threads on 2 busy cores slow each other) and with this
    process's environment and thread count as they were before. A `dflash train` subprocess spends
    ~8-12 CPU-s importing torch, transformers and speculators before its first step; here they are
    imported once per pytest process. Only where the test is not about a process (a kill, a signal,
    torchrun, an exit code of a real process)."""
    import torch

    from trainer.cli import main

    out, err = io.StringIO(), io.StringIO()
    before, env = torch.get_num_threads(), dict(os.environ)
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"  # for the verb's own children (the trainer's τ evaluations)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main([str(a) for a in args])
            except SystemExit as exc:  # argparse's refusals
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        torch.set_num_threads(before)
        os.environ.clear()
        os.environ.update(env)  # the trainer sets RANK; a child of a later test must not inherit it
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())
