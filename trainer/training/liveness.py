"""Where each rank of a distributed run is: its step and the phase of that step, kept in the run's
c10d store (the one the process group was built on, reachable from every node). Rank 0 reads it to
show each node's progress in the step events (the monitor's nodes tile) and, from the stall
watchdog's thread, to name the node whose ranks stopped: the ranks waiting in a collective are a
phase ahead of the one that never reached it."""

from __future__ import annotations

import json
import os
import socket
from typing import Any

from trainer.training.distributed import NODE_RANK_ENV, Dist

# a step's phases, in order: a rank stuck in its target forward stays at step_start while the others
# reach the all-reduce of the backward (captured)
PHASES = ("step_start", "captured", "backward_done", "step_done")
KEY = "dflash/beat/{rank}"


def default_store():
    """The default process group's store (torch keeps it private; None when it is not reachable)."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except (ImportError, RuntimeError, ValueError):
        return None


class Heartbeats:
    """This rank's beat (`beat`) and every rank's last one (`read`, `nodes`, `laggards`). A no-op on a
    single process. `store`: any c10d Store (tests pass a TCPStore of their own)."""

    def __init__(self, d: Dist, store=None, node: int | None = None, host: str | None = None):
        self.d = d
        self.store = store if store is not None else (default_store() if d.enabled else None)
        self.node = int(os.environ.get(NODE_RANK_ENV, "0")) if node is None else node
        self.host = host or socket.gethostname()
        self.last_step_s: float | None = None

    @property
    def enabled(self) -> bool:
        return self.store is not None

    def beat(self, step: int, phase: str, step_s: float | None = None) -> None:
        if self.store is None:
            return
        value = {"step": step, "phase": PHASES.index(phase), "node": self.node, "host": self.host}
        if step_s is not None:
            self.last_step_s = round(step_s, 4)
        if self.last_step_s is not None:  # every phase's beat keeps the last step's time
            value["step_s"] = self.last_step_s
        self.store.set(KEY.format(rank=self.d.rank), json.dumps(value))

    def read(self) -> list[dict[str, Any]]:
        """Every rank's last beat (ranks that have not beaten yet are left out)."""
        if self.store is None:
            return []
        out = []
        for r in range(self.d.world_size):
            key = KEY.format(rank=r)
            if self.store.check([key]):
                out.append({"rank": r, **json.loads(self.store.get(key))})
        return out

    def nodes(self) -> list[dict[str, Any]]:
        """Per node: its host, ranks, the step its slowest rank is at and the longest last step."""
        by_node: dict[int, dict[str, Any]] = {}
        for b in self.read():
            n = by_node.setdefault(
                b["node"], {"node": b["node"], "host": b["host"], "ranks": [], "step": b["step"]}
            )
            n["ranks"].append(b["rank"])
            n["step"] = min(n["step"], b["step"])
            if b.get("step_s") is not None:
                n["step_s"] = max(n.get("step_s", 0.0), b["step_s"])
        return [by_node[k] for k in sorted(by_node)]

    def laggards(self) -> str:
        """Which ranks (and nodes) are behind the others, in words, for a stall warning."""
        beats = self.read()
        if not beats:
            return ""
        missing = sorted(set(range(self.d.world_size)) - {b["rank"] for b in beats})
        if missing:
            return f"ranks {missing} have not reported yet"
        behind = min((b["step"], b["phase"]) for b in beats)
        if all((b["step"], b["phase"]) == behind for b in beats):
            return f"every rank is at step {behind[0]} {PHASES[behind[1]]}: a collective or the network"
        late = [b for b in beats if (b["step"], b["phase"]) == behind]
        where = sorted({(b["node"], b["host"]) for b in late})
        names = ", ".join(f"node {n} ({h})" for n, h in where)
        return (
            f"ranks {[b['rank'] for b in late]} on {names} stopped at step {behind[0]} "
            f"{PHASES[behind[1]]}; the others are ahead"
        )
