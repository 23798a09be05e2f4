"""Issue #32: the decisions around the CUDA paths, checked on CPU (CUDA made visible by mocks for the
decision only, never for the compute). Each test names its item of the issue."""

from __future__ import annotations

import gc
import os
import weakref
from types import SimpleNamespace

import pytest
import torch


# ---------------------------------------------------------------- item 2: eval --engine both
def test_release_frees_the_harness_target(tiny_target, monkeypatch):
    """`del target` left the weights alive: every hook's closure refers back to the HookedTarget (and a
    ReferenceTarget's hook to the model), a cycle only a collection frees, and vLLM then finds too
    little of the GPU free. `release` frees them at once, even while a name still holds the target,
    and empties torch's cache on CUDA."""
    from trainer.eval.models import HookedTarget, release
    from trainer.eval.reference import ReferenceTarget

    target = HookedTarget(tiny_target, [1, 2], torch.device("cpu"))
    ReferenceTarget(target)  # its pre-hook on the final norm: a second cycle through the model
    target.forward(torch.tensor([[5, 6, 7]]))
    model, weight = weakref.ref(target.model), weakref.ref(next(target.model.parameters()))
    held = weakref.ref(target)
    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    gc.collect()
    gc.disable()  # what frees the weights is the release, not a collection that happens to run
    try:
        release(target, torch.device("cuda"))
        assert model() is None and weight() is None, "the target's weights outlived the release"
        del target
        assert held() is None, "the released target is still in a cycle"
    finally:
        gc.enable()
    assert emptied == [True]
    release(None, torch.device("cpu"))  # nothing loaded yet: nothing to do
    assert emptied == [True]


# ---------------------------------------------------------------- item 7: deterministic mode
@pytest.fixture
def restore_determinism():
    import torch.utils.deterministic

    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    fill = torch.utils.deterministic.fill_uninitialized_memory
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    torch.utils.deterministic.fill_uninitialized_memory = fill


def test_deterministic_mode_is_on_for_cpu_and_asked_for_on_cuda(restore_determinism):
    """On CPU as before (the exact-resume tests rely on it); on CUDA off unless DFLASH_DETERMINISTIC=1,
    and then with the cuBLAS workspace it needs and without the NaN fill of fresh allocations."""
    import torch.utils.deterministic

    from trainer.training.state import set_determinism

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)  # a device name: nothing runs on it
    env: dict[str, str] = {}
    assert set_determinism(cpu, env) and torch.are_deterministic_algorithms_enabled()
    assert torch.is_deterministic_algorithms_warn_only_enabled() and env == {}
    assert not set_determinism(cuda, env) and not torch.are_deterministic_algorithms_enabled()
    assert "CUBLAS_WORKSPACE_CONFIG" not in env
    env = {"DFLASH_DETERMINISTIC": "1"}
    assert set_determinism(cuda, env) and torch.are_deterministic_algorithms_enabled()
    assert env["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert torch.utils.deterministic.fill_uninitialized_memory is False
    env = {"DFLASH_DETERMINISTIC": "1", "CUBLAS_WORKSPACE_CONFIG": ":16:8"}
    set_determinism(cuda, env)
    assert env["CUBLAS_WORKSPACE_CONFIG"] == ":16:8", "the operator's own setting is kept"
    assert not set_determinism(cpu, {"DFLASH_DETERMINISTIC": "0"}), "off on request, CPU too"


# ---------------------------------------------------------------- item 8: start-up vs collective timeouts
def test_the_start_up_timeout_covers_rank_0s_server_start(make_config, monkeypatch):
    """Rank 0 starts the run's vLLM server (up to target.vllm.start_timeout_s) while the other ranks wait
    for its URL in a broadcast bounded by the process group's timeout: the group is made with that
    work's bound on top of one collective's, NCCL tears a timed-out rank down (TearDown, set for any
    launcher), and end_startup sets the collective bound back. CUDA is visible to the decision only."""
    from datetime import timedelta
    from types import SimpleNamespace

    from trainer.config.run import load_config
    from trainer.training import distributed as D

    sets = ["train.collective_timeout_s=900", "target.vllm.start_timeout_s=900"]
    owned = load_config(make_config(), ["target.source=vllm", *sets])
    by_url = load_config(
        make_config(), ["target.source=vllm", "target.vllm.url=http://127.0.0.1:8100", *sets]
    )
    hooked = load_config(make_config(), sets)
    assert D.startup_timeout_s(owned) == 900 + D.LEFT_BEHIND_S + 900 > 900
    assert D.startup_timeout_s(by_url) == D.startup_timeout_s(hooked) == 900

    made = {}
    for var, value in (("WORLD_SIZE", "2"), ("LOCAL_RANK", "0"), ("RANK", "0")):
        monkeypatch.setenv(var, value)
    monkeypatch.delenv(D.NCCL_ERROR_HANDLING, raising=False)
    monkeypatch.delenv(D.NODE_RANK_ENV, raising=False)
    monkeypatch.setattr(D, "choose_device", lambda name: SimpleNamespace(type="cuda", why="test"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: None)
    monkeypatch.setattr(D.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(D.dist, "init_process_group", lambda **kw: made.update(kw))
    d = D.setup_dist(owned)
    assert made == {"backend": "nccl", "timeout": timedelta(seconds=1860)}
    assert os.environ[D.NCCL_ERROR_HANDLING] == "1"

    restored = []
    monkeypatch.setattr(D.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(
        "torch.distributed.distributed_c10d._set_pg_timeout", lambda t, group=None: restored.append(t)
    )
    D.end_startup(owned, d)
    D.end_startup(hooked, d)  # its group was made with the collective bound: nothing to set back
    assert restored == [timedelta(seconds=900)]


def test_end_startup_sets_a_real_gloo_groups_timeout_back(make_config, tmp_path):
    """The private torch call end_startup uses exists in the pinned torch and does what it says (a
    one-rank gloo group standing for the run's)."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_group

    from trainer.config.run import load_config
    from trainer.training import distributed as D

    cfg = load_config(make_config(), ["target.source=vllm", "train.collective_timeout_s=900"])
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=1860))
    try:
        gloo = _get_default_group()._get_backend(torch.device("cpu"))
        assert gloo.options._timeout == timedelta(seconds=1860)
        D.end_startup(cfg, D.Dist(rank=0, world_size=2))  # as rank 0 of two
        assert gloo.options._timeout == timedelta(seconds=900)
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- item 9: the step's peak memory
class FakeAllocator:
    """CUDA's allocator statistics as torch.cuda reports them: current bytes and the peak since reset."""

    def __init__(self):
        self.now = self.peak = 0

    def alloc(self, n: int) -> None:
        self.now += n
        self.peak = max(self.peak, self.now)

    def free(self, n: int) -> None:
        self.now -= n


def test_the_reported_peak_is_the_steps_not_the_loads(monkeypatch):
    """The target's load (and the first compile's autotuning) set a high mark that `max_memory_allocated`
    keeps forever; the step event's gpu_peak_gb must be the step's (what the memory model predicts).
    Trainer.train_step resets the peak at the step's start; the allocator is mocked, the step's parts
    are stubs."""
    import numpy as np

    from trainer.training import loop
    from trainer.training.distributed import Dist
    from trainer.training.metrics import StepResult, memory_snapshot

    gib, mem, cuda = 2**30, FakeAllocator(), torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: mem.now)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: mem.peak)
    monkeypatch.setattr(
        torch.cuda, "reset_peak_memory_stats", lambda device=None: setattr(mem, "peak", mem.now)
    )
    mem.alloc(50 * gib)  # loading the target in full precision, then casting it
    mem.free(30 * gib)  # 20 GiB stay: weights, optimizer

    t = object.__new__(loop.Trainer)
    t.cfg = SimpleNamespace(
        target=SimpleNamespace(source="hooked"),
        train=SimpleNamespace(grad_accum_steps=1, agreement_every=50),
        drafter=SimpleNamespace(block_size=4),
    )
    t.d, t.step, t.tokens, t.source = Dist(device=cuda), 1, 0, None
    t.beats = SimpleNamespace(beat=lambda *a, **k: None)
    batch = {"input_ids": np.zeros(8, dtype=np.int64), "loss_mask": np.ones(8), "num_docs": 1}
    t.next_batch = lambda: batch
    t.capture = lambda b: mem.alloc(8 * gib)  # the step's activations
    t.features_finite = lambda cap: True
    t.drafter_backward = lambda b, cap, scale, sync: (mem.free(8 * gib), (torch.tensor(1.0), {}))[1]
    t.optimizer_step = lambda loss, sums: StepResult(torch.tensor(1.0), {}, torch.tensor(0.5), 1e-3, True)
    monkeypatch.setattr(
        loop, "step_metrics", lambda result, batch, **kw: {"batch_tokens": 8, **memory_snapshot(cuda)}
    )
    m = t.train_step()
    assert m["gpu_peak_gb"] == 28.0 and m["gpu_allocated_gb"] == 20.0, m


# ---------------------------------------------------------------- found by bench/gpu on an H200
def test_the_fused_losss_kernels_get_configs_lists_of_their_own(monkeypatch):
    """speculators' fused loss: one `triton.autotune` object decorates both kernels, so they share one
    `configs` list, and dynamo refuses the second kernel inside the drafter's compiled forward ("already
    tracked for mutation"): the GPU check's hooked, zero1 and fsdp2 stages died at step 1. The CUDA
    choice of loss gives each kernel a list of its own with the same configs; the CPU one touches
    nothing (Triton is imported only on CUDA)."""
    import triton  # noqa: F401  (pinned in the venv: speculators' fused loss is Triton)
    from speculators.losses import fused

    from trainer.drafter.model import loss_implementation

    shared = list(fused.loss_forward_kernel.configs)
    monkeypatch.setattr(fused.loss_backward_kernel, "configs", fused.loss_forward_kernel.configs)
    assert loss_implementation(torch.device("cpu")) == "eager"
    assert fused.loss_forward_kernel.configs is fused.loss_backward_kernel.configs  # upstream's state

    assert loss_implementation(torch.device("cuda")) == "fused"
    assert fused.loss_forward_kernel.configs is not fused.loss_backward_kernel.configs
    assert fused.loss_forward_kernel.configs == shared == fused.loss_backward_kernel.configs
    assert loss_implementation(torch.device("cuda")) == "fused"  # a second run keeps them apart
    assert fused.loss_forward_kernel.configs is not fused.loss_backward_kernel.configs
