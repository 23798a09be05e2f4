"""`dflash capture`: what a hidden-state source feeds the drafter, for the first N samples, in a file.

The check a user runs when served acceptance is far below the training metrics: capture the same
samples through the hooked target and through the vLLM server, then compare the two files
(`dflash capture --compare A B`). Each sample is one document (no packing): `aux.<i>` [T, n_aux*H]
(the aux layers side by side, run order), `last.<i>` [T, H] (the verifier's last hidden state, the
final norm's input) and `input_ids.<i>`; the metadata names the source, the target and the layer ids.
The file is written under a temporary name, then renamed.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from trainer.config.run import RunConfig
from trainer.errors import DflashError


class CaptureError(DflashError, ValueError):
    """A capture that cannot be made or compared; the message says why."""


def capture_samples(cfg: RunConfig, samples: int, out: Path) -> dict[str, object]:
    """Capture the first `samples` usable samples of cfg.data through cfg.target.source into `out`."""
    from safetensors.torch import save_file

    from trainer.data import compute_stats, open_dataset
    from trainer.sources.factory import make_source

    if samples < 1:
        raise CaptureError(f"--samples {samples}: capture at least one sample")
    if not out.parent.is_dir():
        raise CaptureError(f"--out {out}: its folder {out.parent} does not exist")
    ds = open_dataset(cfg.data.path)
    usable = np.flatnonzero(compute_stats(ds).usable(cfg.data.max_length))[:samples]
    if usable.size == 0:
        raise CaptureError(f"{cfg.data.path}: no usable sample (every one is dropped by the data gate)")
    source = make_source(cfg, torch.device("cpu"))
    tensors: dict[str, torch.Tensor] = {}
    try:
        for n, i in enumerate(usable.tolist()):
            ids = torch.tensor(ds[int(i)]["input_ids"], dtype=torch.long)[: cfg.train.max_tokens_per_batch]
            cap = source.capture(ids[None], torch.arange(ids.numel())[None])
            tensors[f"aux.{n}"] = cap.aux[0].contiguous()
            tensors[f"last.{n}"] = cap.last[0].contiguous()
            tensors[f"input_ids.{n}"] = ids
    finally:
        if hasattr(source, "close"):
            source.close()
    meta = {
        "source": cfg.target.source,
        "target": str(cfg.target.path),
        "aux_ids": json.dumps(cfg.drafter.aux_ids),
        "samples": str(len(usable)),
        "dtype": str(tensors["aux.0"].dtype).removeprefix("torch."),
    }
    tmp = out.with_name(out.name + ".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    os.replace(tmp, out)
    return {"out": str(out), **meta}


@dataclass
class CaptureDiff:
    """How far two captures of the same samples are apart, per feature."""

    samples: int
    tokens: int
    max_abs: dict[str, float]  # "aux[k]" per aux id, "last"
    max_rel: dict[str, float]  # max |a - b| / max |a|, per feature

    def render(self) -> str:
        lines = [f"{self.samples} samples, {self.tokens} tokens", "feature    max |a-b|    relative"]
        for k in self.max_abs:
            lines.append(f"{k:10} {self.max_abs[k]:10.3e}  {self.max_rel[k]:10.3e}")
        return "\n".join(lines)


def compare_captures(a_path: Path, b_path: Path) -> CaptureDiff:
    """Feature-by-feature differences of two `dflash capture` files of the same samples and layers."""
    from safetensors import safe_open

    def load(p: Path):
        if not p.is_file():
            raise CaptureError(f"{p}: no such capture file")
        try:
            with safe_open(str(p), "pt") as f:
                return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})
        except Exception as exc:  # safetensors' own error types: a file that is no capture
            raise CaptureError(f"{p}: not a safetensors capture file ({exc})") from None

    (a, ma), (b, mb) = load(a_path), load(b_path)
    if ma.get("aux_ids") != mb.get("aux_ids") or ma.get("samples") != mb.get("samples"):
        raise CaptureError(
            f"{a_path} and {b_path} capture different layers or samples "
            f"(aux ids {ma.get('aux_ids')} / {mb.get('aux_ids')}, "
            f"samples {ma.get('samples')} / {mb.get('samples')})"
        )
    ids = json.loads(ma["aux_ids"])
    n = int(ma["samples"])
    max_abs = {f"aux[{k}]": 0.0 for k in ids} | {"last": 0.0}
    scale = dict.fromkeys(max_abs, 0.0)
    tokens = 0
    for i in range(n):
        if not torch.equal(a[f"input_ids.{i}"], b[f"input_ids.{i}"]):
            raise CaptureError(f"sample {i}: the two files hold different tokens")
        tokens += a[f"input_ids.{i}"].numel()
        xa, xb = a[f"aux.{i}"].float(), b[f"aux.{i}"].float()
        hidden = xa.shape[-1] // len(ids)
        for j, k in enumerate(ids):
            pa, pb = xa[:, j * hidden : (j + 1) * hidden], xb[:, j * hidden : (j + 1) * hidden]
            max_abs[f"aux[{k}]"] = max(max_abs[f"aux[{k}]"], (pa - pb).abs().max().item())
            scale[f"aux[{k}]"] = max(scale[f"aux[{k}]"], pa.abs().max().item())
        la, lb = a[f"last.{i}"].float(), b[f"last.{i}"].float()
        max_abs["last"] = max(max_abs["last"], (la - lb).abs().max().item())
        scale["last"] = max(scale["last"], la.abs().max().item())
    rel = {k: max_abs[k] / scale[k] if scale[k] else 0.0 for k in max_abs}
    return CaptureDiff(samples=n, tokens=tokens, max_abs=max_abs, max_rel=rel)
