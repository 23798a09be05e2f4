"""GPU facts and the driver/CUDA decisions the provisioning roles act on (light side: stdlib only).

The gpu_facts role runs `nvidia-smi` on a host and hands the raw text to `dflash gpu facts` on the
controller; the nvidia_driver / cuda_toolkit roles call `dflash gpu decide` and act on its JSON. All
parsing and every compatibility rule live here, unit-tested against recorded outputs of the seeds'
machines (tests/fixtures/nvidia-smi/).

Rules (NVIDIA's CUDA release notes, "minimum required driver", Linux):
- CUDA 13.x needs driver >= 580, CUDA 12.x >= 525 (minor-version compatibility), 11.x >= 450.
- A GPU architecture needs a CUDA release that knows it: Blackwell (compute capability 10.x/12.x)
  needs CUDA >= 12.8, Hopper (9.0) >= 11.8, Ampere (8.x) >= 11.0.
- The driver's own "CUDA Version" (top right of `nvidia-smi`) is the newest CUDA it can run.
"""

from __future__ import annotations

import csv
import io
import json
import re
from dataclasses import asdict, dataclass
from typing import Any

from trainer.errors import DflashError

# Columns the gpu_facts role asks for, in this order (`--format=csv,noheader,nounits`).
QUERY_FIELDS = ("index", "name", "memory.total", "driver_version", "compute_cap", "pci.bus_id", "uuid")
QUERY_COMMAND = ["nvidia-smi", f"--query-gpu={','.join(QUERY_FIELDS)}", "--format=csv,noheader,nounits"]

# CUDA major -> minimum Linux driver branch (minor-version compatibility within a major).
MIN_DRIVER_FOR_CUDA_MAJOR = {11: 450, 12: 525, 13: 580}
# compute capability major -> (architecture, oldest CUDA that supports it)
ARCH_BY_CC_MAJOR = {
    7: ("Volta/Turing", (10, 0)),
    8: ("Ampere/Ada", (11, 0)),
    9: ("Hopper", (11, 8)),
    10: ("Blackwell", (12, 8)),
    12: ("Blackwell", (12, 8)),
}


class GpuFactsError(DflashError, ValueError):
    """nvidia-smi output that cannot be read; the message quotes the offending line."""


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    memory_mib: int
    driver: str
    compute_cap: str
    bus_id: str = ""
    uuid: str = ""

    @property
    def memory_gib(self) -> float:
        return self.memory_mib / 1024


def parse_version(text: str) -> tuple[int, ...]:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)*)\s*", str(text))
    if not m:
        raise GpuFactsError(f"not a version number: {text!r}")
    return tuple(int(x) for x in m.group(1).split("."))


def parse_query(text: str) -> list[Gpu]:
    """Rows of `nvidia-smi --query-gpu=<QUERY_FIELDS> --format=csv,noheader,nounits`."""
    gpus = []
    for row in csv.reader(io.StringIO(text.strip())):
        if not row or not "".join(row).strip():
            continue
        cells = [c.strip() for c in row]
        if len(cells) < 5:
            raise GpuFactsError(
                f"expected {len(QUERY_FIELDS)} comma-separated fields, got {len(cells)}: {row!r}"
            )
        try:
            gpus.append(
                Gpu(
                    index=int(cells[0]),
                    name=cells[1],
                    memory_mib=int(float(cells[2])),
                    driver=cells[3],
                    compute_cap=cells[4],
                    bus_id=cells[5] if len(cells) > 5 else "",
                    uuid=cells[6] if len(cells) > 6 else "",
                )
            )
        except ValueError as exc:
            raise GpuFactsError(f"unreadable nvidia-smi row {row!r}: {exc}") from None
    return gpus


def parse_smi_banner(text: str) -> dict[str, str | None]:
    """Driver version and the newest CUDA it supports, from plain `nvidia-smi`'s header."""
    drv = re.search(r"Driver Version:\s*([\d.]+)", text)
    cuda = re.search(r"CUDA Version:\s*([\d.]+)", text)
    return {"driver": drv.group(1) if drv else None, "driver_cuda": cuda.group(1) if cuda else None}


def min_driver_for_cuda(cuda: str) -> int:
    major = parse_version(cuda)[0]
    if major not in MIN_DRIVER_FOR_CUDA_MAJOR:
        known = ", ".join(f"{k}.x" for k in sorted(MIN_DRIVER_FOR_CUDA_MAJOR))
        raise GpuFactsError(f"CUDA {cuda}: unknown major version (known: {known})")
    return MIN_DRIVER_FOR_CUDA_MAJOR[major]


def cuda_driver_problem(cuda: str, driver: str) -> str | None:
    """None when `driver` can run CUDA `cuda`, else the reason."""
    need = min_driver_for_cuda(cuda)
    have = parse_version(driver)[0]
    if have < need:
        return f"CUDA {cuda} needs NVIDIA driver >= {need}, this host has {driver}"
    return None


def cuda_arch_problem(cuda: str, compute_cap: str) -> str | None:
    cc_major = parse_version(compute_cap)[0]
    arch = ARCH_BY_CC_MAJOR.get(cc_major)
    if arch is None:
        return None
    name, oldest = arch
    if parse_version(cuda)[:2] < oldest:
        return (
            f"CUDA {cuda} does not know {name} GPUs (compute capability {compute_cap}); "
            f"use CUDA >= {oldest[0]}.{oldest[1]}"
        )
    return None


def build_facts(
    query: str | None,
    banner: str | None = None,
    host: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Normalized GPU facts of one host (the `gpus` part of reports/<host>/recon.json).

    query=None or "" means nvidia-smi was absent or failed: a host with zero GPUs."""
    gpus = parse_query(query) if query else []
    ban = parse_smi_banner(banner or "")
    names = sorted({g.name for g in gpus})
    drivers = sorted({g.driver for g in gpus})
    facts: dict[str, Any] = {
        "count": len(gpus),
        "models": names,
        "model": names[0] if len(names) == 1 else (" + ".join(names) if names else None),
        "memory_mib_min": min((g.memory_mib for g in gpus), default=0),
        "memory_gib_min": round(min((g.memory_gib for g in gpus), default=0.0), 1),
        "driver": drivers[0] if drivers else ban["driver"],
        "driver_cuda": ban["driver_cuda"],
        "compute_cap": min({g.compute_cap for g in gpus}) if gpus else None,
        "mixed": len(names) > 1,
        "devices": [asdict(g) for g in gpus],
    }
    if gpus:
        cc_major = parse_version(facts["compute_cap"])[0]
        facts["architecture"] = ARCH_BY_CC_MAJOR.get(cc_major, ("unknown", (0, 0)))[0]
    else:
        facts["architecture"] = None
    if host:
        facts = {"host": host, "gpus": facts}
    return facts


def check_expected(gpus: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    """Mismatches between a host's GPU facts and its group's expected_* vars (empty: as expected)."""
    problems = []
    count = expected.get("expected_gpu_count")
    if count is not None and gpus["count"] != int(count):
        problems.append(f"expected {count} GPUs, found {gpus['count']}")
    model = expected.get("expected_gpu_model")
    if model and gpus["count"] and gpus["model"] != model:
        problems.append(f"expected GPU model {model!r}, found {gpus['model']!r}")
    mem = expected.get("expected_gpu_memory_gib")
    if mem is not None and gpus["count"] and gpus["memory_gib_min"] < float(mem):
        problems.append(f"expected >= {mem} GiB per GPU, found {gpus['memory_gib_min']} GiB")
    cc = expected.get("expected_gpu_compute_capability")
    if cc and gpus["count"] and gpus["compute_cap"] != str(cc):
        problems.append(f"expected compute capability {cc}, found {gpus['compute_cap']}")
    return problems


def decide(
    gpus: dict[str, Any],
    driver_branch: int,
    cuda_version: str,
    secure_boot: bool | None = None,
    toolkit_installed: str | None = None,
) -> dict[str, Any]:
    """What nvidia_driver and cuda_toolkit should do on a host with these GPU facts.

    driver.action: skip (no GPU) | keep (a working driver that can run `cuda_version`) | install
    (no working driver) | refuse (Secure Boot on with no driver: an unsigned module would not load;
    or a working driver too old for `cuda_version`: upgrading a rented node's driver under its
    container runtime breaks it, so a person decides).
    cuda.action: skip | keep (toolkit already at `cuda_version`) | install | refuse (the pair cannot work).
    """
    out: dict[str, Any] = {"driver_branch": driver_branch, "cuda_version": cuda_version}
    pin_problem = None
    need = min_driver_for_cuda(cuda_version)
    if driver_branch < need:
        pin_problem = f"pinned driver branch {driver_branch} cannot run CUDA {cuda_version} (needs >= {need})"
    if not gpus.get("count"):
        reason = "no NVIDIA GPU on this host (nvidia-smi absent or lists none)"
        out["driver"] = {"action": "skip", "reason": reason}
        out["cuda"] = {"action": "skip", "reason": reason}
        return out
    driver = gpus.get("driver")
    arch_problem = cuda_arch_problem(cuda_version, gpus["compute_cap"]) if gpus.get("compute_cap") else None
    if driver:
        problem = cuda_driver_problem(cuda_version, driver)
        if problem:
            out["driver"] = {
                "action": "refuse",
                "reason": f"{problem}; the working driver is left alone: pick a CUDA this driver runs "
                f"(cuda_toolkit_version) or upgrade the driver by hand (docs: Troubleshooting)",
            }
        else:
            out["driver"] = {"action": "keep", "reason": f"working driver {driver} runs CUDA {cuda_version}"}
    elif secure_boot:
        out["driver"] = {
            "action": "refuse",
            "reason": "Secure Boot is enabled and no NVIDIA driver is loaded: an unsigned kernel module "
            "would not load. Disable Secure Boot or enroll a MOK key, then re-run (docs: Troubleshooting)",
        }
    elif pin_problem:
        out["driver"] = {"action": "refuse", "reason": pin_problem}
    else:
        out["driver"] = {"action": "install", "reason": f"no working driver: install branch {driver_branch}"}
    effective_driver = driver or (str(driver_branch) if out["driver"]["action"] == "install" else None)
    if arch_problem:
        out["cuda"] = {"action": "refuse", "reason": arch_problem}
    elif effective_driver is None or out["driver"]["action"] == "refuse":
        out["cuda"] = {
            "action": "refuse",
            "reason": f"no driver that runs CUDA {cuda_version}: {out['driver']['reason']}",
        }
    elif toolkit_installed and parse_version(toolkit_installed)[:2] == parse_version(cuda_version)[:2]:
        out["cuda"] = {"action": "keep", "reason": f"CUDA toolkit {toolkit_installed} already installed"}
    else:
        out["cuda"] = {
            "action": "install",
            "reason": f"install CUDA toolkit {cuda_version} (driver {effective_driver} runs it)",
        }
    return out


def torch_cuda_tag(driver: str) -> str | None:
    """The newest PyTorch CUDA wheel flavour a driver runs (cu130 needs 580, cu12x 525)."""
    major = parse_version(driver)[0]
    if major >= 580:
        return "cu130"
    if major >= 525:
        return "cu128"
    return None


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=1, sort_keys=False)
