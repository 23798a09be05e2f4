"""The GPUs a plan is for: a catalog name (`--gpu A100-40GB --gpu-count 8`, or any name with
`--gpu-memory-gib`) or a host's recon facts (`--facts reports/<host>/recon.json`, written by the
gpu_facts role), once per node of a multi-node group, which must agree. Light side: stdlib only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainer.layout.recipe import PlanError

# name -> (nvidia-smi name, memory GiB, dense bf16 TFLOPS, interconnect, HBM/GDDR GB/s): the
# datasheets' peak figures (the memory bandwidth paces `dflash plan`'s regeneration estimate)
GPU_CATALOG: dict[str, dict[str, Any]] = {
    name: {"smi_name": smi, "memory_gib": gib, "bf16_tflops": tflops, "link": link, "hbm_gb_s": hbm}
    for name, smi, gib, tflops, link, hbm in (
        ("A100-40GB", "NVIDIA A100-SXM4-40GB", 40.0, 312, "NVLink 600 GB/s", 1555),
        ("A100-80GB", "NVIDIA A100-SXM4-80GB", 80.0, 312, "NVLink 600 GB/s", 2039),
        ("H100-80GB", "NVIDIA H100 80GB HBM3", 79.6, 989, "NVLink 900 GB/s", 3350),
        ("H200", "NVIDIA H200", 140.4, 989, "NVLink 900 GB/s", 4800),
        ("B200", "NVIDIA B200", 179.1, 2250, "NVLink 1800 GB/s", 8000),
        (
            "RTX-PRO-6000-96GB",
            "NVIDIA RTX PRO 6000 Blackwell Server Edition",
            95.6,
            500,
            "PCIe 5.0 x16 (~64 GB/s)",
            1792,
        ),
    )
}
GPU_ALIASES = {
    "PRO6000": "RTX-PRO-6000-96GB",
    "RTX-PRO-6000": "RTX-PRO-6000-96GB",
    "PRO6000-96GB": "RTX-PRO-6000-96GB",
    "H200-141GB": "H200",
    "B200-183GB": "B200",
    "A100": "A100-40GB",
    # PCIe boards (a100_form_factor: pcie): the same chip and memory, no NVLink between the cards
    "NVIDIA A100-PCIE-40GB": "A100-40GB",
    "NVIDIA A100 80GB PCIE": "A100-80GB",
    "H100": "H100-80GB",
}

# What the hosts of one multi-node run must share: one layout is planned for all of them, NCCL needs
# one driver/CUDA pairing, and a slower or smaller GPU would pace (or not fit) the whole run.
GROUP_FIELDS = ("model", "count", "memory_gib_min", "compute_cap", "driver", "driver_cuda")


def resolve_gpu(name: str) -> tuple[str, dict[str, Any]]:
    key = name.strip()
    key = GPU_ALIASES.get(key.upper(), key)
    for cat_name, spec in GPU_CATALOG.items():
        if key.upper() == cat_name.upper() or key == spec["smi_name"]:
            return cat_name, spec
    known = ", ".join(GPU_CATALOG)
    raise PlanError(f"unknown GPU {name!r}: use one of {known} (or --gpu-memory-gib with any name)")


def uncatalogued_gpu(name: str, memory_gib: float) -> dict[str, Any]:
    """The spec of a GPU outside GPU_CATALOG: its memory only."""
    return {
        "smi_name": name,
        "memory_gib": memory_gib,
        "bf16_tflops": None,
        "link": "unknown",
        "hbm_gb_s": None,
    }


def read_facts(path: Path) -> dict[str, Any]:
    from trainer import jsonin

    try:
        facts = jsonin.loads(Path(path).read_bytes())
    except (OSError, ValueError) as exc:  # missing, not JSON, not UTF-8, nested too deeply
        raise PlanError(f"recon facts {path}: {exc}") from None
    if not isinstance(facts, dict) or not isinstance(facts.get("gpus", facts), dict):
        raise PlanError(f"recon facts {path}: not GPU facts (a recon.json or `dflash gpu facts` output)")
    return facts


def gpus_from_facts(path: Path) -> tuple[str, dict[str, Any], int]:
    """(catalog name or the smi name, spec, count) from a recon.json written by the gpu_facts role."""
    facts = read_facts(path)
    gpus = facts.get("gpus", facts)
    count = int(gpus.get("count") or 0)
    if count == 0:
        raise PlanError(f"{path}: this host has no GPU; the plan is for GPU nodes (the CPU path needs none)")
    if gpus.get("mixed"):
        raise PlanError(f"{path}: mixed GPU models {gpus['models']}: plan each model separately")
    try:
        name, spec = resolve_gpu(gpus["model"])
        spec = {**spec, "memory_gib": float(gpus["memory_gib_min"])}
    except PlanError:
        name, spec = gpus["model"], uncatalogued_gpu(gpus["model"], float(gpus["memory_gib_min"]))
    return name, spec, count


def group_mismatches(facts_files: list[Path]) -> list[str]:
    """How the hosts' recon facts differ in GROUP_FIELDS (empty: they can run as one)."""
    rows = []
    for path in facts_files:
        facts = read_facts(path)
        host = facts.get("host")
        host = (host.get("name") if isinstance(host, dict) else host) or Path(path).parent.name
        rows.append((host, facts.get("gpus", facts)))
    problems = []
    for field in GROUP_FIELDS:
        seen = {host: gpus.get(field) for host, gpus in rows}
        if len({json.dumps(v) for v in seen.values()}) > 1:
            problems.append(f"{field}: " + ", ".join(f"{h} {v}" for h, v in seen.items()))
    return problems


def node_count(facts: list[str] | None, nodes: int | None) -> int:
    """The nodes of the run: `--nodes`, else one per `--facts` file (and at least one)."""
    facts = facts or []
    nodes = nodes if nodes is not None else max(1, len(facts))
    if nodes < 1:
        raise PlanError(f"--nodes must be >= 1, got {nodes}")
    if len(facts) > 1 and nodes != len(facts):
        raise PlanError(f"--nodes {nodes} with {len(facts)} --facts files: give one per node")
    if len(facts) > 1:
        bad = group_mismatches([Path(f) for f in facts])
        if bad:
            raise PlanError("the hosts cannot run as one multi-node run, they differ in " + "; ".join(bad))
    return nodes


def node_gpus(args) -> tuple[str, dict[str, Any], int]:
    """(name, spec, count) of one node's GPUs, from --facts or --gpu/--gpu-count/--gpu-memory-gib."""
    if args.facts:
        gpu_name, spec, count = gpus_from_facts(Path(args.facts[0]))
        if args.gpu_count:
            count = args.gpu_count
    else:
        if not args.gpu or not args.gpu_count:
            raise PlanError("pass --gpu NAME --gpu-count N, or --facts reports/<host>/recon.json")
        if args.gpu_memory_gib:
            gpu_name, spec = args.gpu, uncatalogued_gpu(args.gpu, args.gpu_memory_gib)
        else:
            gpu_name, spec = resolve_gpu(args.gpu)
        count = args.gpu_count
    if count < 1:
        raise PlanError(f"--gpu-count must be >= 1, got {count}")
    return gpu_name, spec, count
