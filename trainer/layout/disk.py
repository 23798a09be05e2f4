"""The disk a run needs, by part: the one home of every disk figure `dflash plan` prints and
`dflash preflight`'s disk gate (trainer/preflight/disk.py) checks. Light side: stdlib only.

The parts and where each figure comes from:

- target: the weights as stored: model.safetensors.index.json's metadata.total_size, else the data
  offsets of every *.safetensors header (trainer/target/info.py `stored_bytes`); with only config.json
  there, the parameter count its shapes imply (`TargetInfo.config_params`: dense attention + gated MLP
  per layer, so an MoE target is undercounted) x the bytes of its torch_dtype (else the run's dtype);
- venv: an ESTIMATE per torch kind (`VENV_BYTES`): "cpu" is `du -s` of a CPU venv built by
  `scripts/setup-venv --test` (this repository's .venv on 2026-12-04: torch 2.13.0+cpu, runtime.txt,
  the vLLM CPU engine, the test and docs tools: 5.17 GB);
  "cuda" is the uncompressed size of every file in the wheels pip resolves for
  requirements/runtime.txt + cuda-constraints.txt (torch 2.13.0 and its CUDA 13 libraries):
  `pip install --dry-run --report` against PyPI, then each wheel's zip directory read, on 2026-12-04
  (101 wheels, 2.90 GB compressed, 5.27 GB of files); "cuda+engine" the same with cuda-engine.txt
  (vllm 0.32.0: 216 wheels, 4.06 GB compressed, 8.61 GB of files), the venv of a run whose target a
  vLLM server holds (target.source vllm) or of a node that regenerates (python_env_engine); not
  counted: .pyc files written at install time and the few MB of the --no-deps packages (speculators);
- checkpoints: (train.keep_checkpoints + the one being written) x one drafter checkpoint
  (`checkpoint_bytes`: fp32 trainable weights + Adam's two fp32 moments, an upper bound for Muon's,
  + a saved draft-vocabulary head + the small files);
- hidden-state spool (`target.source: vllm`, a server the run starts): the files the server writes
  and the trainer reads (`spool_tokens` x tapped layers x hidden x the server's dtype, per trainer rank
  of the node: trainer/preflight/shm.py). It is disk only when target.vllm.storage_dir is a disk
  folder (or the node has no /dev/shm); by default it sits in /dev/shm, RAM, and is not counted;
- regenerated data (`dflash plan --regenerate-samples N`): N x --mean-tokens tokens x
  `DATASET_BYTES_PER_TOKEN` (`dflash regenerate` saves input_ids and loss_mask as int64 Arrow lists);
- reserve: preflight.disk_reserve_gb, free space kept beyond all of the above.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from trainer.layout.sizing import Shapes

GB = 1e9
CHECKPOINT_OVERHEAD_BYTES = 16 * 2**20  # config, trainer state, RNG, sampler state
ADAM_STATE_BYTES = 2 * 4  # exp_avg + exp_avg_sq, fp32 (a checkpoint holds all of them)
DATASET_BYTES_PER_TOKEN = 8 + 8  # input_ids + loss_mask, int64 each (datasets.Dataset.from_dict of ints)
WEIGHT_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8": 1, "float8_e4m3fn": 1}
VENV_BYTES = {"cpu": 5_174_837_248, "cuda": 5_271_664_885, "cuda+engine": 8_605_559_110}
VENV_SOURCE = {
    "cpu": "estimate: du -s of a CPU venv (torch 2.13.0+cpu, runtime, vLLM CPU engine, test and docs tools)",
    "cuda": "estimate: the files of the pinned wheels (torch 2.13.0 CUDA 13, runtime.txt), uncompressed",
    "cuda+engine": "estimate: the files of the pinned wheels (torch 2.13.0 CUDA 13, runtime.txt, "
    "vllm 0.32.0), uncompressed",
}


def checkpoint_bytes(s: Shapes) -> int:
    """One drafter checkpoint: fp32 trainable weights + Adam state (an upper bound for Muon's) + a
    draft-vocabulary lm_head (the target lacks it, so it is saved) + small files."""
    saved_head = s.head_rows * s.hidden if s.draft_vocab else 0
    return s.drafter_trainable * (4 + ADAM_STATE_BYTES) + saved_head * 4 + CHECKPOINT_OVERHEAD_BYTES


def target_bytes(folder: Path, dtype: str = "bfloat16") -> tuple[int, str]:
    """(bytes of the target's weights, where the figure comes from) for a model folder (or its
    config.json): the stored weights when their index or headers are there, else the config's
    parameter count x the bytes of its torch_dtype (else `dtype`; else bfloat16, said so: "auto"
    names no width)."""
    from trainer.target.info import TargetInfo, read_config, stored_bytes

    given = Path(folder)
    config = given if given.is_file() else given / "config.json"
    # the weights' index or headers beside a config.json (a model folder); a copy saved under another
    # name stands alone: the folder it sits in is not the model's
    stored = stored_bytes(config.parent) if config.name == "config.json" else None
    if stored is not None:
        return stored
    info = TargetInfo.from_config(read_config(config), config)
    kind = next((k for k in (info.stored_dtype, dtype) if k in WEIGHT_DTYPE_BYTES), None)
    width = WEIGHT_DTYPE_BYTES[kind or "bfloat16"]
    said = kind or "bfloat16 assumed: neither the config's torch_dtype nor the run's dtype names a width"
    params = info.config_params
    return params * width, f"{config.name}: {params:,} parameters (dense estimate) x {width} B ({said})"


def spool_tokens(prefetch_batches: int, tokens_per_batch: int, longest_document: int) -> int:
    """The most tokens one trainer rank has in hidden-state files at once: `prefetch_batches` + 1
    batches requested, of which at most REQUEST_THREADS documents written and not yet read."""
    from trainer.layout.server_tap import REQUEST_THREADS

    return min((prefetch_batches + 1) * tokens_per_batch, REQUEST_THREADS * longest_document)


def spool_bytes(ranks: int, tokens: int, layers: int, hidden: int, width: int) -> int:
    """The hidden-state files in the folder at once: `tokens` per trainer rank of the node, at each
    tapped layer (the aux ids and the verifier's last state), `width` bytes an element."""
    return max(1, ranks) * tokens * layers * hidden * width


def dataset_bytes(samples: int, mean_tokens: float) -> int:
    return int(samples * mean_tokens * DATASET_BYTES_PER_TOKEN)


@dataclass(frozen=True)
class DiskPart:
    name: str  # target, venv, checkpoints, spool, data, reserve
    bytes: int
    source: str  # where the figure comes from, in words
    counted: bool = True  # False: not on disk (the spool in /dev/shm)
    present: bool = False  # already on this machine's disk (preflight): needs no free space
    path: str | None = None  # where it is written (preflight: the filesystem to check)


def checkpoints_part(s: Shapes, keep: int, path: str | None = None) -> DiskPart:
    one = checkpoint_bytes(s)
    return DiskPart(
        "checkpoints",
        (keep + 1) * one,
        f"(train.keep_checkpoints {keep} + the one being written) x {one / GB:.3f} GB "
        "(fp32 weights + Adam moments)",
        path=path,
    )


def venv_part(kind: str, present: bool = False) -> DiskPart:
    return DiskPart("venv", VENV_BYTES[kind], f"{kind}: {VENV_SOURCE[kind]}", present=present)


def reserve_part(reserve_gb: float, path: str | None = None) -> DiskPart:
    return DiskPart("reserve", int(reserve_gb * GB), "preflight.disk_reserve_gb", path=path)


def budget(parts: list[DiskPart]) -> dict[str, Any]:
    """The table as JSON: each part and the total on disk (the spool in /dev/shm excluded)."""
    total = sum(p.bytes for p in parts if p.counted)
    return {"parts": [asdict(p) for p in parts], "total_bytes": total, "total_gb": round(total / GB, 2)}


def render(table: dict[str, Any], indent: str = "  ") -> list[str]:
    lines = []
    for p in table["parts"]:
        note = "" if p["counted"] else "  (not disk: not in the total)"
        note += "  (already on disk)" if p["present"] else ""
        lines.append(f"{indent}{p['name']:12} {p['bytes'] / GB:>9.2f} GB  {p['source']}{note}")
    lines.append(f"{indent}{'total':12} {table['total_gb']:>9.2f} GB")
    return lines


def plan_disk(
    target_config: Path,
    dtype: str,
    s: Shapes,
    *,
    run: Any,
    source: str,
    trainer_ranks: int,
    num_layers: int,
    tokens_per_batch: int,
    regenerate_samples: int = 0,
    mean_tokens: float = 0,
) -> dict[str, Any]:
    """`dflash plan`'s disk table for one node: `run` is the run config (None: the flags, whose
    defaults are the run config's), `source` the layout's target.source, `trainer_ranks` the node's,
    `tokens_per_batch` train.max_tokens_per_batch."""
    from trainer.config.run import VllmSourceConfig
    from trainer.layout.inputs import config_default
    from trainer.layout.server_tap import server_layer_ids

    weights, where = target_bytes(target_config, dtype)
    engine = (source == "vllm" and (run is None or run.target.vllm.url is None)) or regenerate_samples > 0
    parts = [DiskPart("target", weights, where), venv_part("cuda+engine" if engine else "cuda")]
    keep = run.train.keep_checkpoints if run else config_default("train.keep_checkpoints")
    parts.append(checkpoints_part(s, keep))
    v = run.target.vllm if run else VllmSourceConfig()
    if source == "vllm" and v.url is None:
        max_length = run.data.max_length if run else config_default("data.max_length")
        aux = run.drafter.aux_ids if run else list(range(s.n_aux))  # n_aux ids below the last layer
        layers = len(server_layer_ids(aux, num_layers))
        tokens = spool_tokens(v.prefetch_batches, tokens_per_batch, min(max_length, tokens_per_batch))
        width = 4 if dtype == "float32" else 2
        on_disk = v.storage_dir is not None and not str(v.storage_dir).startswith("/dev/shm")
        parts.append(
            DiskPart(
                "spool",
                spool_bytes(trainer_ranks, tokens, layers, s.hidden, width),
                f"{trainer_ranks} trainer rank(s) x {tokens} tokens x {layers} tapped layers x hidden "
                f"{s.hidden} x {width} B, "
                + (f"in target.vllm.storage_dir {v.storage_dir}" if on_disk else "in /dev/shm (RAM)"),
                counted=on_disk,
            )
        )
    if regenerate_samples:
        parts.append(
            DiskPart(
                "data",
                dataset_bytes(regenerate_samples, mean_tokens),
                f"--regenerate-samples {regenerate_samples} x --mean-tokens {mean_tokens:g} x "
                f"{DATASET_BYTES_PER_TOKEN} B (input_ids + loss_mask, int64)",
            )
        )
    reserve = run.preflight.disk_reserve_gb if run else config_default("preflight.disk_reserve_gb")
    parts.append(reserve_part(reserve))
    return budget(parts)


def against_nodes(table: dict[str, Any], facts_files: list[str] | None) -> list[dict[str, Any]]:
    """Each recon.json's disk (the gpu_facts role's `disk_total_gib` at the run's root) beside the
    table's total: `short` when the filesystem is smaller than the total. Its size, not its free space
    (recon records no free space); preflight checks the free space on the node."""
    from trainer.layout.hardware import read_facts

    out = []
    for path in facts_files or []:
        facts = read_facts(Path(path))
        if "disk_total_gib" not in facts:
            continue
        size = float(facts["disk_total_gib"]) * 2**30
        host = facts.get("host")
        host = (host.get("name") if isinstance(host, dict) else host) or Path(path).parent.name
        out.append(
            {
                "host": host,
                "path": facts.get("disk_path"),
                "size_gb": round(size / GB, 2),
                "short": size < table["total_bytes"],
            }
        )
    return out
