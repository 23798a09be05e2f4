"""The one reader of a model folder: its config.json (a nested `text_config` of multimodal configs merged
over it), generation_config.json, and the headers of its safetensors files; no tensor is loaded.

- `read_safetensors_header` / `tensor_entries`: one .safetensors file's JSON header (`SafetensorsError`
  names a truncated or foreign file); `read_weight_headers`: the merged headers of a folder's weights
  (the shards of model.safetensors.index.json, else every *.safetensors) and what is wrong with them;
- `stored_bytes`: the bytes of a folder's stored weights (the index's metadata.total_size, else the
  headers' data offsets), for `dflash plan`;
- `read_json` / `read_config`: a JSON config as a dict (`ModelConfigError` names the file);
- `TargetInfo`: the target's shapes and special token ids, in the terms of trainer/layout/sizing.py.

Used by `dflash preflight` (trainer/preflight/), `dflash plan` (trainer/layout/plan.py) and salvage's
checks. Light side: stdlib only (no numpy, torch, transformers or speculators).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer import jsonin
from trainer.errors import DflashError
from trainer.layout.hybrid import LinearAttention, read_linear_attention
from trainer.layout.sizing import Shapes

if TYPE_CHECKING:
    from trainer.config.run import RunConfig

MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit on the JSON header
INDEX_NAME = "model.safetensors.index.json"


class SafetensorsError(DflashError, ValueError):
    """A .safetensors file whose header cannot be read: truncated, or not safetensors at all."""


class ModelConfigError(DflashError, ValueError):
    """A model folder's JSON config that is unreadable, not an object, lacks a key or holds an unusable
    value; the message names the file."""


# ---------------------------------------------------------------- safetensors headers


def read_safetensors_header(path: Path, *, complete: bool = True) -> dict[str, Any]:
    """The JSON header of a .safetensors file, read without loading any tensor.

    Returns {tensor name: {"dtype", "shape", "data_offsets"}, optionally "__metadata__": {...}}.
    Raises SafetensorsError naming the file when it is truncated (header or, with `complete`, tensor
    data cut short) or is not a safetensors file. `complete=False` accepts a file whose tensor data
    is cut short (the header alone is enough to count what it stores)."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise SafetensorsError(
                f"{path}: truncated safetensors file ({size} bytes, no 8-byte header length)"
            )
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER_BYTES:
            raise SafetensorsError(f"{path}: not a safetensors file (header length {length} is implausible)")
        if 8 + length > size:
            raise SafetensorsError(
                f"{path}: truncated safetensors file (header of {length} bytes, file has {size} bytes)"
            )
        raw = fh.read(length)
    try:
        header = json.loads(raw)
        end = max((int(v["data_offsets"][1]) for v in tensor_entries(header).values()), default=0)
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
        raise SafetensorsError(f"{path}: not a safetensors file (unreadable header: {exc})") from None
    if complete and 8 + length + end > size:
        raise SafetensorsError(
            f"{path}: truncated safetensors file (tensor data ends at byte {8 + length + end}, "
            f"the file has {size} bytes; an interrupted download or copy?)"
        )
    return header


def tensor_entries(header: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The tensors of a safetensors header (without "__metadata__")."""
    return {k: v for k, v in header.items() if k != "__metadata__"}


@dataclass
class WeightHeaders:
    """The merged safetensors headers of a model folder (sharded or not) and what went wrong."""

    files: list[Path] = field(default_factory=list)
    tensors: dict[str, dict[str, Any]] = field(default_factory=dict)
    problems: list[tuple[str, str]] = field(default_factory=list)  # (kind, message)

    @property
    def numel(self) -> int:
        return sum(math.prod(t["shape"]) for t in self.tensors.values())


def read_weight_headers(folder: Path) -> WeightHeaders:
    """Headers of `folder`'s weights: the shards of model.safetensors.index.json, else *.safetensors.

    Problem kinds: "no_weights", "missing_shards", "bad_safetensors"."""
    out = WeightHeaders()
    index = folder / INDEX_NAME
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            out.problems.append(("bad_safetensors", f"{index}: unreadable index ({exc})"))
            return out
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            absent = f"{index} lists {len(missing)} of {len(names)} shard(s) that are absent: {missing}"
            out.problems.append(("missing_shards", absent))
        out.files = [folder / n for n in names if n not in missing]
    else:
        out.files = sorted(folder.glob("*.safetensors"))
        if not out.files:
            out.problems.append(("no_weights", f"{folder} has no *.safetensors file"))
    for path in out.files:
        try:
            out.tensors.update(tensor_entries(read_safetensors_header(path)))
        except (SafetensorsError, OSError) as exc:
            out.problems.append(("bad_safetensors", str(exc)))
    return out


def stored_bytes(folder: Path) -> tuple[int, str] | None:
    """(bytes of `folder`'s stored weights, where the figure comes from): the index's
    metadata.total_size when it has one, else the data offsets of every *.safetensors header (a file
    whose tensor data is cut short still counts); None when there is no readable figure."""
    index = folder / INDEX_NAME
    if index.is_file():
        try:
            meta = json.loads(index.read_text()).get("metadata", {})
            total = int(meta["total_size"])
            return total, f"{index.name} metadata.total_size ({total} bytes)"
        except (ValueError, KeyError, TypeError):
            pass
    total = 0
    files = sorted(folder.glob("*.safetensors"))
    for f in files:
        try:
            header = read_safetensors_header(f, complete=False)
        except (OSError, SafetensorsError):
            return None
        for entry in tensor_entries(header).values():
            a, b = entry["data_offsets"]
            total += b - a
    if files and total:
        return total, f"safetensors headers of {len(files)} file(s) ({total} bytes)"
    return None


# ---------------------------------------------------------------- config.json


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from `path`; ModelConfigError naming the file when it is unreadable or not an object."""
    try:
        raw = jsonin.loads(Path(path).read_bytes())
    except (OSError, ValueError) as exc:
        raise ModelConfigError(f"{path} is not readable JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ModelConfigError(f"{path} is not a JSON object")
    return raw


def read_config(path: Path) -> dict[str, Any]:
    """A model's config.json (`path`: the file, or the folder holding it), with the nested
    `text_config` of a multimodal config merged over it when the top level has no layers."""
    path = Path(path)
    raw = read_json(path / "config.json" if path.is_dir() else path)
    text = raw.get("text_config") if "num_hidden_layers" not in raw else None
    return {**raw, **text} if isinstance(text, dict) else raw


def _token_ids(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, (list, tuple)):
        return {int(v) for v in value}
    return {int(value)}


def _special_ids(role: str, *configs: dict[str, Any]) -> tuple[int, ...]:
    """`{role}_token_id` over config.json and generation_config.json (either may hold a list)."""
    return tuple(sorted(set().union(*(_token_ids(c.get(f"{role}_token_id")) for c in configs))))


def special_token_ids(folder: Path, role: str) -> tuple[int, ...]:
    """`{role}_token_id` ("eos", "pad", "bos") of a model folder over its config.json (text_config
    merged) and generation_config.json, whichever exist (either may hold a list)."""
    folder = Path(folder)
    configs = [read_config(folder)] if (folder / "config.json").is_file() else []
    if (folder / "generation_config.json").is_file():
        configs.append(read_json(folder / "generation_config.json"))
    return _special_ids(role, *configs)


@dataclass(frozen=True)
class TargetInfo:
    """The target's shapes and special token ids, read from its config.json (text_config for multimodal)
    and generation_config.json."""

    num_layers: int
    hidden: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied_embeddings: bool
    attention_bias: bool
    special_ids: dict[str, tuple[int, ...]]  # "pad"/"bos"/"eos" -> ids (eos may be several)
    stored_params: int = 0  # numel over the safetensors headers; 0 when unknown
    stored_dtype: str = ""  # config.json's torch_dtype (or dtype); "" when it names none
    linear: LinearAttention | None = None  # linear-attention layers of a hybrid target (Qwen3.5/3.6)

    @classmethod
    def from_folder(cls, folder: Path) -> TargetInfo:
        """config.json and, when present, generation_config.json of `folder`.
        Raises ModelConfigError (a ValueError) naming the file and the missing key."""
        conf = read_config(folder / "config.json")
        gen_path = folder / "generation_config.json"
        gen = read_json(gen_path) if gen_path.is_file() else {}
        return cls.from_config(conf, folder / "config.json", gen)

    @classmethod
    def from_config(
        cls, conf: dict[str, Any], source: Path, generation: dict[str, Any] | None = None
    ) -> TargetInfo:
        """From a config read by `read_config` (`source`: its file, for messages)."""
        gen = generation or {}
        try:
            hidden, heads = int(conf["hidden_size"]), int(conf["num_attention_heads"])
            special = {role: _special_ids(role, conf, gen) for role in ("pad", "bos", "eos")}
            return cls(
                num_layers=int(conf["num_hidden_layers"]),
                hidden=hidden,
                vocab=int(conf["vocab_size"]),
                heads=heads,
                kv_heads=int(conf.get("num_key_value_heads") or heads),
                head_dim=int(conf.get("head_dim") or hidden // heads),
                intermediate=int(conf.get("intermediate_size") or 4 * hidden),
                tied_embeddings=bool(conf.get("tie_word_embeddings", False)),
                attention_bias=bool(conf.get("attention_bias", False)),
                special_ids=special,
                stored_dtype=str(conf.get("torch_dtype") or conf.get("dtype") or ""),
                linear=read_linear_attention(conf),
            )
        except KeyError as exc:
            raise ModelConfigError(f"{source} lacks {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise ModelConfigError(f"{source} has an unusable value ({exc})") from None

    def shapes(self, cfg: RunConfig | None = None, dtype_bytes: int = 2, with_params: bool = True) -> Shapes:
        """This target (and, with `cfg`, its drafter) in the terms of trainer/layout/sizing.py."""
        d = cfg.drafter if cfg is not None else None
        drafter = (
            {"draft_layers": 1, "n_aux": 1}
            if d is None
            else {
                "draft_layers": d.num_layers,
                "draft_intermediate": d.intermediate_size,
                "n_aux": len(d.aux_ids),
                "draft_vocab": d.draft_vocab_size,
            }
        )
        return Shapes.of(self, self.params if with_params else 0, dtype_bytes, **drafter)

    def decoder_layer_params(self, intermediate: int | None = None) -> int:
        """Parameters of one Qwen3-style decoder layer of this width (the drafter's layers too)."""
        return self.shapes(with_params=False).decoder_layer_params(intermediate)

    @property
    def config_params(self) -> int:
        """Parameter count implied by config.json (dense estimate; MoE targets count from headers)."""
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return embeddings + self.num_layers * self.decoder_layer_params() + self.hidden

    @property
    def params(self) -> int:
        return max(self.stored_params, self.config_params)
