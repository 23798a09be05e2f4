"""The draft vocabulary (`drafter.draft_vocab_size`): the tokens the drafter's heads score.

The mapping is speculators' own (`build_vocab_mappings_from_distribution`: the most frequent tokens,
ties broken by id, topped up with the lowest ids when the data has fewer distinct tokens, kept in id
order): `d2t[i]` is the offset from draft id i to its target id, `t2d` marks the kept target ids.
The frequencies are the supervised tokens (loss_mask 1) of the run's data, counted over the Arrow
columns at once, so every rank (every node, with or without a shared filesystem) derives the same
mapping from the same data; the checkpoint keeps it (speculators saves t2d/d2t with the reduced
head), and a resume refuses a checkpoint whose mapping is not the one the data gives. A process counts
a dataset once: `dflash train`'s preflight (rank 0) and the drafter's build share the counts, keyed by
the data folder's files (names, sizes, mtimes), so a rewritten dataset is counted again.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainer.errors import DflashError

CHUNK = 1 << 24  # tokens counted at a time


class DraftVocabError(DflashError, ValueError):
    """A draft vocabulary that cannot be built; the message says what to change."""


@dataclass(frozen=True)
class DraftVocab:
    d2t: object  # torch.LongTensor [draft]: target id = draft id + d2t[draft id]
    t2d: object  # torch.BoolTensor [target vocab]: the kept target ids
    coverage: float  # share of the data's supervised tokens that are kept
    distinct: int  # distinct supervised token ids in the data

    @property
    def size(self) -> int:
        return int(self.d2t.shape[0])

    def target_ids(self):
        """The kept target ids, in draft-id order."""
        import torch

        return torch.arange(self.size) + self.d2t


def supervised_token_counts(ds, target_vocab: int) -> np.ndarray:
    """How often each target id is a supervised token (loss_mask 1) in `ds`: [target_vocab] int64."""
    from trainer.data import flat_values

    ids = flat_values(ds, "input_ids")
    mask = flat_values(ds, "loss_mask")
    if ids.shape != mask.shape:
        raise DraftVocabError("input_ids and loss_mask differ in length: the data gate refuses this data")
    counts = np.zeros(target_vocab, dtype=np.int64)
    for s in range(0, ids.size, CHUNK):  # a chunk at a time: no int64 copy of a billion-token column
        kept = ids[s : s + CHUNK][mask[s : s + CHUNK] != 0]
        if kept.size and (kept.min() < 0 or kept.max() >= target_vocab):
            raise DraftVocabError(
                f"supervised token ids span {kept.min()}..{kept.max()}, outside the target's vocabulary "
                f"of {target_vocab}: the data was tokenized for another model"
            )
        counts += np.bincount(kept, minlength=target_vocab)
    return counts


def build_draft_vocab(counts: np.ndarray, size: int) -> DraftVocab:
    """The `size`-token mapping from per-id `counts` (speculators' mapping code)."""
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    target_vocab = int(counts.shape[0])
    if not 2 <= size < target_vocab:
        raise DraftVocabError(
            f"drafter.draft_vocab_size {size}: must be at least 2 and below the target's vocabulary "
            f"({target_vocab}); null keeps the whole vocabulary"
        )
    seen = np.nonzero(counts)[0]
    freq = {int(t): int(counts[t]) for t in seen}
    d2t, t2d = build_vocab_mappings_from_distribution(freq, size, target_vocab)
    total = int(counts.sum())
    kept = int(counts[t2d.numpy()].sum())
    return DraftVocab(d2t=d2t, t2d=t2d, coverage=kept / total if total else 0.0, distinct=int(seen.size))


def draft_vocab_for(data_path: Path, size: int, target_vocab: int) -> DraftVocab:
    """The run's mapping: `size` tokens from the supervised tokens of the data at `data_path`."""
    return build_draft_vocab(data_token_counts(Path(data_path), target_vocab), size)


def data_token_counts(data_path: Path, target_vocab: int) -> np.ndarray:
    """`supervised_token_counts` of the dataset folder, counted once per process while its files stay
    the same (a read-only array: callers share it)."""
    path = data_path.resolve()
    stamp = tuple(
        (str(f.relative_to(path)), st.st_size, st.st_mtime_ns)
        for f in sorted(path.rglob("*"))
        if f.is_file() and (st := f.stat())
    )
    return _counts(path, stamp, target_vocab)


@functools.lru_cache(maxsize=2)
def _counts(path: Path, stamp: tuple, target_vocab: int) -> np.ndarray:
    from trainer.data import open_dataset

    counts = supervised_token_counts(open_dataset(path), target_vocab)
    counts.flags.writeable = False
    return counts
