"""Checkpoints: `out_dir/checkpoints/<name>/` = speculators-format drafter (config.json +
model.safetensors) + trainer_state.pt + meta.json + SHA256SUMS; `checkpoints/latest` names the
newest complete one. Written under a temp name and renamed, so a crash never leaves a folder that
looks complete; `latest` is replaced atomically and only after the rename. A state holding inf or NaN
(a step at an absurd lr, an overflow) is never written: the save is refused and `latest` stays where
it was; a resume skips an older checkpoint that holds one.

The light part (listing, verifying, the `latest` pointer) imports no torch; saving/loading does."""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.errors import DflashError, ExitCode
from trainer.store.fsutil import atomic_write_text, dir_size, fsync_dir, sha256_file

SUMS = "SHA256SUMS"
STATE = "trainer_state.pt"
META = "meta.json"
LATEST = "latest"
PREFIX = "step-"


class CheckpointError(DflashError, RuntimeError):
    """A checkpoint that cannot be used (exit 1: the run failed; a supervisor may restart it)."""

    exit_code = ExitCode.FAILED


NONFINITE = "non-finite"  # the words every refusal and skip of a state with inf/NaN says


class NonFiniteState(CheckpointError):
    """The state to save holds inf or NaN: no checkpoint of it, `latest` left alone."""


def nonfinite_tensors(obj: Any, prefix: str = "", limit: int = 5) -> list[str]:
    """Names (dotted paths) of up to `limit` floating tensors in `obj` (a tensor, or dicts and lists of
    them: a state dict, an optimizer state) that hold inf or NaN."""
    import torch

    bad: list[str] = []

    def walk(o: Any, name: str) -> None:
        if len(bad) >= limit:
            return
        if isinstance(o, torch.Tensor):
            if (o.is_floating_point() or o.is_complex()) and not bool(torch.isfinite(o).all()):
                bad.append(name or "tensor")
        elif isinstance(o, dict):
            for k, v in o.items():
                walk(v, f"{name}.{k}" if name else str(k))
        elif isinstance(o, list | tuple):
            for i, v in enumerate(o):
                walk(v, f"{name}[{i}]")

    walk(obj, prefix)
    return bad


def nonfinite_weights(folder: Path) -> list[str]:
    """The tensors of a checkpoint's model.safetensors that hold inf or NaN (one at a time in memory)."""
    from safetensors import safe_open

    bad = []
    with safe_open(str(Path(folder) / "model.safetensors"), framework="pt") as fh:
        for key in fh.keys():
            bad += nonfinite_tensors(fh.get_tensor(key), key)
    return bad


def checkpoints_dir(out_dir: Path) -> Path:
    return Path(out_dir) / "checkpoints"


def checkpoint_name(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def step_of(name: str) -> int | None:
    if not name.startswith(PREFIX):
        return None
    try:
        return int(name[len(PREFIX) :])
    except ValueError:
        return None


def list_checkpoints(out_dir: Path) -> list[Path]:
    """Complete-looking checkpoints (renamed into place), oldest first. Temp folders are ignored."""
    root = checkpoints_dir(out_dir)
    if not root.is_dir():
        return []
    found = [(step_of(p.name), p) for p in root.iterdir() if p.is_dir()]
    return [p for s, p in sorted((s, p) for s, p in found if s is not None)]


def _latest_name(out_dir: Path) -> str:
    latest = read_latest(out_dir)
    return latest.name if latest is not None else "unset (no checkpoint yet)"


def read_latest(out_dir: Path) -> Path | None:
    ptr = checkpoints_dir(out_dir) / LATEST
    if not ptr.exists():
        return None
    name = ptr.read_text().strip()
    path = checkpoints_dir(out_dir) / name
    return path if path.is_dir() else None


def resolve_checkpoint(path: Path) -> Path | None:
    """The checkpoint folder a user's path names: a folder with config.json as it is; a run's out_dir,
    its checkpoints/ folder, or the `latest` pointer itself (RUN/checkpoints/latest: a file naming the
    newest checkpoint, or a link to it): the checkpoint `latest` names. None when it names none. The one
    resolver of `dflash eval --drafter` and `dflash export --checkpoint`."""
    path = Path(path)
    if (path / "config.json").is_file():
        return path
    if path.name == LATEST and path.is_file():
        named = path.parent / path.read_text().strip()
        return named if (named / "config.json").is_file() else None
    run = path.parent if path.name == checkpoints_dir(Path()).name and (path / LATEST).exists() else path
    return read_latest(run)


def write_sums(folder: Path) -> dict[str, str]:
    sums = {p.name: sha256_file(p) for p in sorted(folder.iterdir()) if p.is_file() and p.name != SUMS}
    atomic_write_text(folder / SUMS, "".join(f"{h}  {n}\n" for n, h in sums.items()))
    return sums


def verify_checkpoint(folder: Path) -> list[str]:
    """Problems with a checkpoint folder (empty list: it verifies). Same format as `sha256sum -c`."""
    folder = Path(folder)
    sums_path = folder / SUMS
    if not sums_path.is_file():
        return [f"{folder.name}: no {SUMS} (incomplete checkpoint)"]
    problems = []
    listed = {}
    for line in sums_path.read_text().splitlines():
        if line.strip():
            digest, name = line.split(None, 1)
            listed[name.strip()] = digest
    for required in ("config.json", "model.safetensors", STATE, META):
        if required not in listed:
            problems.append(f"{folder.name}: {required} not in {SUMS}")
    for name, digest in listed.items():
        f = folder / name
        if not f.is_file():
            problems.append(f"{folder.name}/{name}: missing")
        elif sha256_file(f) != digest:
            problems.append(f"{folder.name}/{name}: sha256 differs from {SUMS}")
    return problems


def read_meta(folder: Path) -> dict[str, Any]:
    return json.loads((Path(folder) / META).read_text())


@dataclass
class Saved:
    path: Path
    step: int
    size_bytes: int
    seconds: float
    removed: list[str]


def save_checkpoint(
    out_dir: Path,
    step: int,
    drafter,
    trainer_state: dict[str, Any],
    meta: dict[str, Any],
    keep: int,
    state_dict: dict[str, Any] | None = None,
) -> Saved:
    """Write a complete checkpoint for `step`, point `latest` at it, keep the newest `keep`.
    `state_dict`: the drafter's weights gathered from its shards (FSDP), else the drafter's own.
    A state with inf or NaN in the weights or the optimizer's moments raises `NonFiniteState` before
    anything is written: the previous checkpoint stays `latest`."""
    import torch

    t0 = time.monotonic()
    weights = state_dict if state_dict is not None else drafter.state_dict()
    bad = nonfinite_tensors(weights) + nonfinite_tensors(trainer_state.get("optimizer"), "optimizer")
    if bad:
        raise NonFiniteState(
            f"step {step}: {NONFINITE} values in {', '.join(bad[:5])}: no checkpoint written, "
            f"latest stays {_latest_name(out_dir)} (the run diverged: lower train.lr, check the data)"
        )
    root = checkpoints_dir(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    name = checkpoint_name(step)
    final = root / name
    tmp = root / f".tmp-{name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        gathered = {} if state_dict is None else {"state_dict": state_dict}
        drafter.save_pretrained(str(tmp), **gathered)
        torch.save(trainer_state, tmp / STATE)
        atomic_write_text(tmp / META, json.dumps({"step": step, **meta}, indent=1, sort_keys=True))
        write_sums(tmp)
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if final.exists():  # a re-save of the same step (e.g. resumed at it): replace whole
            old = root / f".old-{name}-{os.getpid()}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    atomic_write_text(root / LATEST, name + "\n")
    removed = rotate(out_dir, keep)
    return Saved(final, step, dir_size(final), time.monotonic() - t0, removed)


def rotate(out_dir: Path, keep: int) -> list[str]:
    """Delete all but the newest `keep` checkpoints (never the one `latest` names) and stale temps."""
    root = checkpoints_dir(out_dir)
    latest = read_latest(out_dir)
    ckpts = list_checkpoints(out_dir)
    removed = []
    for p in ckpts[: max(0, len(ckpts) - keep)]:
        if latest is not None and p.resolve() == latest.resolve():
            continue
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p.name)
    for p in root.glob(".tmp-*"):
        pid = p.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid():
            shutil.rmtree(p, ignore_errors=True)
    return removed


def find_resume_checkpoint(out_dir: Path, finite: bool = False) -> tuple[Path | None, list[str]]:
    """The newest checkpoint that verifies, and the problems of any newer one that did not.
    `finite` (a resume): also skip one whose weights hold inf or NaN (written before saves were
    checked); its problem says NONFINITE."""
    problems: list[str] = []
    for folder in reversed(list_checkpoints(out_dir)):
        bad = verify_checkpoint(folder)
        if not bad and finite:
            names = nonfinite_weights(folder)
            if names:
                bad = [f"{folder.name}: {NONFINITE} weights ({', '.join(names)}); skipped"]
        if not bad:
            return folder, problems
        problems.extend(bad)
    return None, problems


def load_trainer_state(folder: Path) -> dict[str, Any]:
    import torch

    return torch.load(Path(folder) / STATE, map_location="cpu", weights_only=False)
