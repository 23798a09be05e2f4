"""A follower node's marker: `out_dir/node.json` on every node of a multi-node run but node 0.

Only global rank 0 (on node 0) writes events and checkpoints. The first rank of each other node writes
this small record at the start and at the end of its share of the run (node rank, host, its pid and
start time, status, step), so that `dflash salvage` on that node can find the run's process there, stop
it (SIGTERM to that rank stops the whole run), and tell a clean end from a crash. Light: stdlib only.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

from trainer.salvage.proc import identity
from trainer.store.fsutil import atomic_write_text

NODE_FILE = "node.json"  # in out_dir on every node but node 0 (whose events say the same and more)


def node_marker_path(out_dir) -> Path:
    return Path(out_dir) / NODE_FILE


def write_node_marker(out_dir, node: int, started: float, status: str = "running", step: int = 0) -> None:
    """A node's own record of its share of a multi-node run, written by the node's first rank at the
    start and the end of the run: the events and checkpoints are node 0's, so without it salvage on
    another node could not tell which process there is the run's, nor whether it ended cleanly."""
    record = {
        "node": node,
        "host": socket.gethostname(),
        **identity(),  # pid + its start ticks and boot id: salvage stop proves it is this rank
        "time": started,
        "status": status,
        "step": step,
        "updated": round(time.time(), 3),
    }
    atomic_write_text(node_marker_path(out_dir), json.dumps(record) + "\n")


def read_node_marker(out_dir) -> dict[str, Any] | None:
    """The node marker of a run folder (None: not a follower node's folder, or unreadable)."""
    try:
        rec = json.loads(node_marker_path(out_dir).read_text())
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) and isinstance(rec.get("pid"), int) else None
