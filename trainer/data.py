"""Training data: the speculators prepared format (datasets.save_to_disk with `input_ids`, `loss_mask`),
its quality statistics (the data gate reads them), and deterministic, resumable packing.

Statistics are computed vectorised over the Arrow columns, so a 1M-sample dataset is scanned in
seconds without building Python lists per sample.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trainer.errors import DflashError

REQUIRED_COLUMNS = ("input_ids", "loss_mask")
HIST_EDGES = (0, 1, 2, 6, 7, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
REGENERATE_FIX = "regenerate the responses with `dflash regenerate`"


class DataError(DflashError, ValueError):
    """A dataset the trainer cannot use. `code` and `fix` let preflight report it as a Problem;
    str(error) is the message followed by the fix."""

    def __init__(self, message: str, code: str = "data.invalid", fix: str = ""):
        super().__init__(f"{message}; {fix}" if fix else message)
        self.code = code
        self.message = message
        self.fix = fix


def open_dataset(path: Path):
    """Load a datasets.save_to_disk folder; clear errors for the usual mistakes."""
    path = Path(path)
    if not path.exists():
        raise DataError(
            f"data.path {path} does not exist",
            "data.missing",
            "point data.path at a datasets.save_to_disk folder (e.g. the output of `dflash regenerate`)",
        )
    if not (path / "dataset_info.json").exists() and not (path / "state.json").exists():
        if (path / "dataset_dict.json").exists():
            raise DataError(
                f"data.path {path} is a DatasetDict",
                "data.not_a_dataset",
                f"point data.path at one split, e.g. {path}/train",
            )
        raise DataError(
            f"data.path {path} is not a datasets.save_to_disk folder (no state.json)",
            "data.not_a_dataset",
            "write it with Dataset.save_to_disk or `dflash regenerate`",
        )
    if _no_data_files(path):
        raise _empty(path)
    import datasets

    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        raise DataError(
            f"data.path {path} is a DatasetDict", "data.not_a_dataset", "point data.path at one split"
        )
    missing = [c for c in REQUIRED_COLUMNS if c not in ds.column_names]
    if missing:
        raise DataError(
            f"data.path {path} lacks column(s) {missing} (has {ds.column_names})",
            "data.missing_columns",
            "the trainer needs speculators' prepared format: input_ids and loss_mask per sample "
            "(rename the columns, or rebuild the data with `dflash regenerate`)",
        )
    if len(ds) == 0:
        raise _empty(path)
    return ds


def _empty(path: Path) -> DataError:
    return DataError(f"data.path {path} has no samples", "data.empty", f"{REGENERATE_FIX} or fix data.path")


def _no_data_files(path: Path) -> bool:
    """An empty Dataset saved with save_to_disk has no Arrow file and cannot be loaded back."""
    try:
        return json.loads((path / "state.json").read_text()).get("_data_files") == []
    except (OSError, ValueError, AttributeError):
        return False


def _flat(ds, column: str) -> tuple[np.ndarray, np.ndarray]:
    """(values, offsets) of a list column, without per-row Python objects."""
    import pyarrow as pa

    col = ds.data.column(column)
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    offsets = np.asarray(col.offsets.to_numpy(zero_copy_only=False), dtype=np.int64)
    values = np.asarray(col.values.to_numpy(zero_copy_only=False))
    base = offsets[0]
    return values[base : offsets[-1]], offsets - base


def flat_values(ds, column: str) -> np.ndarray:
    """All values of a list column, concatenated over samples (one array, no per-row objects)."""
    return _flat(ds, column)[0]


@dataclass
class DataStats:
    num_samples: int
    lengths: np.ndarray  # tokens per sample
    supervised: np.ndarray  # loss_mask sum per sample
    has_pair: np.ndarray  # at least two consecutive supervised tokens
    mismatched: np.ndarray  # len(input_ids) != len(loss_mask)
    extra: dict[str, Any] = field(default_factory=dict)

    def usable(self, max_length: int) -> np.ndarray:
        """Samples the loop trains on: a supervised pair, not too long, consistent lengths."""
        return self.has_pair & (self.lengths <= max_length) & ~self.mismatched

    def histogram(self) -> list[dict[str, Any]]:
        edges = list(HIST_EDGES) + [int(max(self.supervised.max(initial=0), HIST_EDGES[-1])) + 1]
        counts, _ = np.histogram(self.supervised, bins=edges)
        rows = []
        for lo, hi, c in zip(edges[:-1], edges[1:], counts):
            label = f"{lo}" if hi == lo + 1 else f"{lo}-{hi - 1}"
            rows.append({"supervised_tokens": label, "samples": int(c)})
        return rows


def compute_stats(ds) -> DataStats:
    ids, id_off = _flat(ds, "input_ids")
    mask, m_off = _flat(ds, "loss_mask")
    lengths = np.diff(id_off)
    mlen = np.diff(m_off)
    mismatched = lengths != mlen
    mask = (mask != 0).astype(np.int64)
    n = len(lengths)
    if n == 0:
        empty = np.zeros(0, dtype=np.int64)
        return DataStats(0, empty, empty, empty.astype(bool), empty.astype(bool))
    supervised = np.add.reduceat(mask, m_off[:-1]) if mask.size else np.zeros(n, dtype=np.int64)
    supervised = np.where(mlen == 0, 0, supervised)
    # consecutive supervised pairs, not across sample boundaries
    pair = np.zeros(mask.size, dtype=np.int64)
    if mask.size > 1:
        pair[:-1] = mask[:-1] & mask[1:]
        ends = m_off[1:] - 1  # last position of each sample: its pair would cross a boundary
        pair[ends[ends >= 0]] = 0
    pairs = np.add.reduceat(pair, m_off[:-1]) if pair.size else np.zeros(n, dtype=np.int64)
    pairs = np.where(mlen == 0, 0, pairs)
    return DataStats(n, lengths, supervised, pairs > 0, mismatched)


# ---------------------------------------------------------------- held-out samples (eval.holdout)


def holdout_indices(usable: np.ndarray, n: int, seed: int) -> np.ndarray:
    """`n` of the usable samples, sorted, chosen by `seed` alone: every rank and every restart of a run
    holds out the same ones. More than the usable samples less one is refused (training needs one)."""
    pool = np.flatnonzero(usable)
    if n >= pool.size:
        raise DataError(
            f"eval.holdout {n}: the dataset has {pool.size} usable samples (training needs at least one)",
            "data.holdout_too_large",
            "hold out fewer samples, or evaluate on a prompt file (eval.prompts)",
        )
    rng = np.random.default_rng([seed, 0x401D])
    return np.sort(rng.choice(pool, size=n, replace=False))


def holdout_prompts(ds, indices: np.ndarray) -> list[dict[str, list[int]]]:
    """Prompt-file rows ({"input_ids": ...}) of the held-out samples: each one's tokens before its first
    supervised token (the chat template's prompt as regeneration wrote it)."""
    ids, off = _flat(ds, "input_ids")
    mask, _ = _flat(ds, "loss_mask")
    rows = []
    for i in indices:
        lo, hi = int(off[i]), int(off[i + 1])
        first = int(np.flatnonzero(mask[lo:hi])[0])  # usable samples have a supervised token
        rows.append({"input_ids": [int(t) for t in ids[lo : lo + max(first, 1)]]})
    return rows


# ---------------------------------------------------------------- packing (heavy side uses it)


@dataclass
class SamplerState:
    """Where the sampler stands: enough to continue exactly after a restart."""

    epoch: int = 0
    cursor: int = 0  # index into this epoch's permutation (global, before rank sharding)

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor}


class PackedSampler:
    """Deterministic packing of usable samples into sequences of at most `max_tokens`.

    The order is a permutation of the usable samples seeded by (seed, epoch). Each global batch
    takes consecutive samples for `world_size` packs; rank r takes pack r. Samples longer than
    `max_tokens` are truncated to it (the data gate reports how many)."""

    def __init__(
        self, ds, usable: np.ndarray, max_tokens: int, seed: int, rank: int = 0, world_size: int = 1
    ):
        self.ds = ds
        self.indices = np.flatnonzero(usable)
        if self.indices.size == 0:
            raise DataError("no usable samples (every sample was dropped by the data gate)")
        self.lengths = None
        self.max_tokens = max_tokens
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.state = SamplerState()
        self._perm_epoch = -1
        self._perm: np.ndarray | None = None
        ids, off = _flat(ds, "input_ids")
        mask, _ = _flat(ds, "loss_mask")
        self._ids, self._mask, self._off = ids, mask, off

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm_epoch != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._perm = self.indices[rng.permutation(self.indices.size)]
            self._perm_epoch = epoch
        return self._perm

    def _sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = self._off[i], self._off[i + 1]
        hi = min(hi, lo + self.max_tokens)
        return self._ids[lo:hi], self._mask[lo:hi]

    def _next_pack(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        ids_l, mask_l, used = [], [], 0
        while True:
            perm = self._permutation(self.state.epoch)
            if self.state.cursor >= perm.size:
                self.state.epoch += 1
                self.state.cursor = 0
                continue
            ids, mask = self._sample(int(perm[self.state.cursor]))
            if ids_l and used + ids.size > self.max_tokens:
                return ids_l, mask_l
            ids_l.append(ids)
            mask_l.append(mask)
            used += ids.size
            self.state.cursor += 1
            if used >= self.max_tokens:
                return ids_l, mask_l

    def next_batch(self) -> dict[str, np.ndarray]:
        """The next packed batch of this rank: input_ids, loss_mask, document_ids, position_ids
        (each [T]); every rank advances the shared cursor over all ranks' packs."""
        mine = None
        for r in range(self.world_size):
            pack = self._next_pack()
            if r == self.rank:
                mine = pack
        ids_l, mask_l = mine
        input_ids = np.concatenate(ids_l).astype(np.int64)
        loss_mask = (np.concatenate(mask_l) != 0).astype(np.int64)
        document_ids = np.concatenate([np.full(a.size, d, dtype=np.int64) for d, a in enumerate(ids_l)])
        position_ids = np.concatenate([np.arange(a.size, dtype=np.int64) for a in ids_l])
        return {
            "input_ids": input_ids,
            "loss_mask": loss_mask,
            "document_ids": document_ids,
            "position_ids": position_ids,
            "num_docs": len(ids_l),
        }

    def state_dict(self) -> dict[str, int]:
        return self.state.to_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.state = SamplerState(epoch=int(state["epoch"]), cursor=int(state["cursor"]))
