"""The distributed context of a run: which rank this process is, its devices, and the few
collectives the loop needs (torchrun DDP; everything is a no-op on a single process).

Timeouts. Every collective is bounded by `train.collective_timeout_s`, except during start-up: rank 0
alone runs preflight, then (a `target.source: vllm` run without a url) stops a server a killed
predecessor left behind and starts its own (up to `target.vllm.start_timeout_s`), while the other
ranks wait in a broadcast for its verdict and for the server's URL. The process group is made with
`startup_timeout_s` (that work's bound on top of one collective's) and set back to
`collective_timeout_s` once the URL is out (`end_startup`), so rank 0's start-up never races the
others' timeout. On a timeout gloo raises (the run ends through its `run_end`); NCCL does not:
with TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (TearDown, torchrun's default, set here for any launcher) its
watchdog aborts the communicator and the process (SIGABRT), so no `run_end` is written; torchrun sees
the rank fail, ends the others and restarts the group, which resumes from the newest checkpoint. The
watchdog's own heartbeat monitor (TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC) guards the watchdog thread, not a
collective's wait, and keeps torch's default.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from trainer.config.run import RunConfig
from trainer.device import choose_device


@dataclass
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    target_devices: list[torch.device] = field(default_factory=list)
    device_why: str = "train.device cpu"  # how train.device chose it (trainer/device.py)

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup_dist(cfg: RunConfig) -> Dist:
    """This process's rank and devices from torchrun's environment; the process group when there
    is more than one rank. Rank r's target copy spans GPUs r*k..r*k+k-1 (k = target.gpus_per_copy)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    rank = node_pinned_rank(world, local)  # before RANK is rewritten below
    choice = choose_device(cfg.train.device)  # DeviceRefused (exit 2) where it cannot be honoured
    use_cuda = choice.type == "cuda"
    if use_cuda:
        k = cfg.target.gpus_per_copy
        first = local * k
        if first + k > torch.cuda.device_count():
            raise RuntimeError(
                f"rank {local} needs GPUs {first}..{first + k - 1} (target.gpus_per_copy={k}) "
                f"but {torch.cuda.device_count()} are visible: lower nproc_per_node or gpus_per_copy"
            )
        torch.cuda.set_device(first)
        devices = [torch.device("cuda", first + i) for i in range(k)]
        device = devices[0]
    else:
        device = torch.device("cpu")
        devices = [device]
    if world > 1 and not dist.is_initialized():
        # a rank (or node) that is gone fails the others' next collective within this bound (start-up's
        # until end_startup)
        timeout = timedelta(seconds=startup_timeout_s(cfg))
        backend = "nccl" if use_cuda else "gloo"
        if use_cuda:
            os.environ.setdefault(NCCL_ERROR_HANDLING, "1")  # read when the NCCL process group is made
        if os.environ.get(NODE_RANK_ENV) is None:
            dist.init_process_group(backend=backend, timeout=timeout)
        else:
            # pinned ranks: torchrun's own rank 0 hosts the round's store at MASTER_ADDR:MASTER_PORT (its
            # node); the multi-node unit sets TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, since the agent's shared
            # store keeps the previous round's keys and a restarted group read stale peer addresses
            # (pytorch/pytorch#135712: gloo/NCCL connect timeouts after a restart)
            hosts_store = (
                os.environ.get("RANK") == "0" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
            )
            store = dist.TCPStore(
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
                world,
                is_master=hosts_store,
                timeout=timeout,
            )
            dist.init_process_group(
                backend=backend, store=store, rank=rank, world_size=world, timeout=timeout
            )
    os.environ["RANK"] = str(rank)  # for anything after this that reads it
    return Dist(rank, world, local, device, devices, choice.why)


NODE_RANK_ENV = "DFLASH_NODE_RANK"
NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
LEFT_BEHIND_S = 60.0  # stopping a server a killed predecessor left: SIGTERM, 20 s, SIGKILL, 20 s


def startup_timeout_s(cfg: RunConfig) -> float:
    """The process group's bound until `end_startup`: one collective's (which covers preflight) plus,
    when rank 0 starts the run's vLLM server before the others hear from it, what that may take."""
    extra = 0.0
    if cfg.target.source == "vllm" and cfg.target.vllm.url is None:
        extra = LEFT_BEHIND_S + cfg.target.vllm.start_timeout_s
    return cfg.train.collective_timeout_s + extra


def end_startup(cfg: RunConfig, d: Dist) -> None:
    """Every collective from here is bounded by `train.collective_timeout_s` again."""
    if d.enabled and dist.is_initialized() and startup_timeout_s(cfg) != cfg.train.collective_timeout_s:
        from torch.distributed.distributed_c10d import _set_pg_timeout

        _set_pg_timeout(timedelta(seconds=cfg.train.collective_timeout_s))


def node_pinned_rank(world: int, local: int) -> int:
    """This process's global rank. torchrun's c10d rendezvous numbers the nodes in an order of its own
    (sorted host names and agent pids), which can change when the group restarts; a multi-node unit
    sets DFLASH_NODE_RANK (its place in the inventory), and rank = node rank x ranks per node + local
    rank, so that global rank 0, which writes the events and the checkpoints, is always on node 0."""
    pinned = os.environ.get(NODE_RANK_ENV)
    if pinned is None:
        return int(os.environ.get("RANK", "0"))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    rank = int(pinned) * per_node + local
    if not 0 <= rank < world:
        raise RuntimeError(
            f"{NODE_RANK_ENV}={pinned} with {per_node} ranks per node gives rank {rank}, outside the "
            f"world of {world}: the node ranks of the group must be 0..{world // max(per_node, 1) - 1}"
        )
    return rank


def all_reduce_(t: torch.Tensor, d: Dist, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In place over the ranks (nothing on a single process); returns `t`."""
    if d.enabled:
        dist.all_reduce(t, op=op)
    return t


def all_ranks(flag: bool, d: Dist) -> bool:
    """True when `flag` holds on every rank (a collective: every rank must call it)."""
    t = torch.tensor([float(flag)], device=d.device)
    return all_reduce_(t, d, dist.ReduceOp.MIN).item() == 1.0


def any_rank(flag: bool, d: Dist) -> bool:
    """True when `flag` holds on at least one rank (a collective: every rank must call it)."""
    t = torch.tensor([1.0 if flag else 0.0], device=d.device)
    return bool(all_reduce_(t, d, dist.ReduceOp.MAX).item())


def max_over_ranks(values: list[float], d: Dist) -> list[float]:
    """Each value's maximum over the ranks (a collective; `values` itself on a single process)."""
    if not d.enabled:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=d.device)
    return all_reduce_(t, d, dist.ReduceOp.MAX).tolist()


def gather_objects(obj, d: Dist) -> list:
    """`obj` of every rank, in rank order, on every rank ([obj] on a single process)."""
    if not d.enabled:
        return [obj]
    out = [None] * d.world_size
    dist.all_gather_object(out, obj)
    return out


def leave_without_teardown(code: int) -> None:
    """End a rank of a finished distributed run at once, skipping interpreter and C++ teardown.

    Every collective is over (the run's last checkpoint ends in a barrier) and every file this
    process wrote is closed (events are written by open/append/close). What is left is gloo's
    teardown: destroying the process group, or leaving it to interpreter shutdown, sometimes
    found a worker std::thread still joinable ("terminate called without an active exception",
    SIGABRT after a completed run: torchrun then reports the whole run failed). A run that
    raised does not come here; its traceback and exit code go the usual way."""
    dist.barrier()  # no rank leaves while another still needs it
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code))
