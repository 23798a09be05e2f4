"""Shared fixtures: tiny real models and datasets built on the spot (no downloads)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from pathlib import Path

# One OpenMP/torch thread per process unless a test asks for more, set before numpy and torch load: the suite
# runs four pytest processes on 2 cores (scripts/test), where a second thread of a torch loop spins waiting
# on a busy core. Measured, test_regenerate.py's kill -9 test (its reference and resume in this process):
# alone 36 s / 26 CPU-s on two threads, 15 s / 15 CPU-s on one; inside the full suite on two threads it took
# 228 s and 105 CPU-s of this process. Subprocesses inherit it unless their test's env says otherwise.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import yaml  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]

# vLLM's engine in the process that starts it (`vllm.LLM`: no engine-core process; a server: its engine core
# runs the model itself, no worker process), for the tests that check what an engine computes, not how its
# processes live. On a CPU vLLM 0.32 otherwise spawns an engine core and a worker, each a fresh interpreter
# importing vLLM again (vllm/platforms/cpu.py turns "uni" into "mp" unless VLLM_ENABLE_V1_MULTIPROCESSING=0):
# measured, one `dflash eval --engine both` of test_families_vllm.py 1.2 -> 0.6 CPU-min, 71 -> 36 s.
# The processes a real node runs stay tested where they matter, with vLLM's default: an engine dying in its
# worker (test_engine_death.py), ranks losing their owned server (test_vllm_source.py), salvage ending a
# left-behind server (test_salvage.py), and every container journey (the node's own environment).
ONE_PROCESS_ENGINE = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


CLOCK = os.environ.get("DFLASH_TEST_CLOCK")  # bench/suite_cpu.py: where each test's span is appended


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With DFLASH_TEST_CLOCK set (bench/suite_cpu.py sets it), one JSON line per test: its pytest process,
    its span on the system's monotonic clock (setup to teardown) and the CPU pytest itself spent on it, so
    the bench can charge every process a test started to that test."""
    if not CLOCK:
        yield
        return
    start, cpu = time.monotonic(), time.process_time()
    yield
    line = {"test": item.nodeid, "pid": os.getpid(), "start": start, "end": time.monotonic()}
    line["cpu"] = time.process_time() - cpu
    with contextlib.suppress(AttributeError, OSError):  # the lane's tmp folder names its tests' processes
        line["basetemp"] = str(item.config._tmp_path_factory.getbasetemp())
    with open(CLOCK, "a") as f:
        f.write(json.dumps(line) + "\n")


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> Path:
    from trainer.demo.synth import tiny_target as build

    return build(tmp_path_factory.mktemp("target") / "qwen3-tiny")


@pytest.fixture(scope="session")
def tiny_data(tiny_target, tmp_path_factory) -> Path:
    from trainer.demo.synth import greedy_dataset

    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, size=8).tolist() for _ in range(48)]
    return greedy_dataset(tiny_target, prompts, 56, tmp_path_factory.mktemp("data") / "ds")


@pytest.fixture(scope="session")
def vllm_sized_target(tmp_path_factory) -> Path:
    """A tiny random Qwen3 whose head size vLLM's CPU attention kernels take (64; `tiny_target` has 16).
    No tokenizer: the engine runs on token ids, and stops at the config's EOS (id 2)."""
    from trainer.demo.synth import tiny_target

    return tiny_target(tmp_path_factory.mktemp("vllm-target") / "target", num_layers=2, hidden=256)


def write_config(path: Path, target_path: Path, data_path: Path, out_path: Path, **sections) -> Path:
    """A run.yaml like the issue's example; `sections` update (dicts) or replace (scalars) keys."""
    raw = {
        "target": {"path": str(target_path)},
        "data": {"path": str(data_path)},
        "drafter": {"num_layers": 1, "block_size": 4, "aux_layer_ids": [1, 2], "mask_token_id": 511},
        "train": {
            "max_steps": 30,
            "lr": 3.0e-4,
            "seed": 0,
            "checkpoint_every": 5,
            "max_tokens_per_batch": 1024,
        },
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


# ---------------------------------------------------------------- fixtures of eval, export and regenerate
def tiny_prompts(count: int, seed: int = 0) -> list[list[int]]:
    """The prompts `tiny_data` is made of (seed 0): random ids of the tiny vocabulary."""
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, size=8).tolist() for _ in range(count)]


def train_tiny_drafter(
    target: Path, data: Path, root: Path, aux_ids: list[int], drafter: dict | None = None
) -> Path:
    """A real `dflash train` run of 150 steps (block 8, one layer, lr 3e-3) tapping `aux_ids`; returns its
    out_dir (`checkpoints/latest` is the drafter). About 20 s on 2 idle cores. `drafter`: more
    drafter keys (drafter.draft_vocab_size)."""
    cfg = write_config(
        root / "run.yaml",
        target,
        data,
        root / "run",
        drafter={
            "num_layers": 1,
            "block_size": 8,
            "aux_layer_ids": aux_ids,
            "mask_token_id": 511,
            **(drafter or {}),
        },
        train={
            "max_steps": 150,
            "lr": 3.0e-3,
            "warmup_steps": 2,
            "max_tokens_per_batch": 256,
            "max_anchors": 32,
            "checkpoint_every": 1000,
            # AdamW, not the default Muon: these drafters are fixtures for eval, export and serving; Muon's
            # Newton-Schulz steps cost ~2.6 s a step on this CPU for the served target (10 steps: 35.7 s
            # with Muon, 15.9 s with AdamW, imports included), so 150 steps took ~370 CPU-s instead of ~100
            "optimizer": "adamw",
        },
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    from tests.cli_fork import run_dflash

    res = run_dflash(["train", "--config", cfg], env=env, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return root / "run"


@pytest.fixture(scope="session")
def trained_drafter(tiny_target, tiny_data, tmp_path_factory) -> Path:
    """The out_dir of a real `dflash train` run on the tiny fixtures, aux ids [1, 2]."""
    return train_tiny_drafter(tiny_target, tiny_data, tmp_path_factory.mktemp("trained-drafter"), [1, 2])


@pytest.fixture
def one_thread():
    """Eval loops in-process on one thread: two torch threads on 2 busy cores slow each other 10x+."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@contextlib.contextmanager
def real_tmpfs(path: Path, size: str):
    """A real tmpfs of `size` (mount's notation: 1m, 64m) at `path` for the block: a small or full disk,
    real ENOSPC. The suite runs as root (CI and scripts/test): a mount that fails fails the test, saying
    why, never skips it."""
    path.mkdir(parents=True, exist_ok=True)
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True
    )
    if mount.returncode != 0:
        pytest.fail(f"cannot mount a {size} tmpfs at {path} (the suite runs as root): {mount.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "--lazy", str(path)], check=False)


def wait_for(pred, timeout: float = 180.0, every: float = 0.05) -> bool:
    """Poll `pred` until it is true or `timeout` seconds pass (for real processes and servers)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(every)
    return False


@pytest.fixture(scope="session")
def moto():
    """moto's S3 server on 127.0.0.1 with a `salvage` bucket (fast; it checks no digests: the end-to-end
    cases use Ceph radosgw, tests/s3servers.py)."""
    from tests.s3servers import MotoServer, client

    server = MotoServer().start()
    client(server.endpoint_url).create_bucket(Bucket="salvage")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def rgw():
    """A real S3 server, Ceph radosgw on 127.0.0.1, with a `salvage` bucket: one for the whole session
    (tests/ansible has its own, reachable from the test hosts' network namespaces)."""
    from tests.s3servers import RadosGW, client, have_radosgw

    if not have_radosgw():
        pytest.fail(
            "Ceph radosgw is not installed: run scripts/setup-system (requirements/apt.txt: ceph-mon "
            "ceph-osd radosgw)"
        )
    server = RadosGW().start()
    client(server.endpoint_url).create_bucket(Bucket="salvage")
    yield server
    server.stop()
