"""GPU facts and the driver/CUDA decisions the provisioning roles act on (light side: stdlib only).

The gpu_facts role runs `nvidia-smi` on a host and hands the raw text to `dflash gpu facts` on the
controller; the nvidia_driver / cuda_toolkit roles call `dflash gpu decide` and act on its JSON. All
parsing and every compatibility rule live here, unit-tested against recorded outputs of the seeds'
machines (tests/fixtures/nvidia-smi/).

Rules (NVIDIA's CUDA release notes, "minimum required driver", Linux):
- CUDA 13.x needs driver >= 580, CUDA 12.x >= 525 (minor-version compatibility), 11.x >= 450.
- A GPU architecture needs a CUDA release that knows it: Blackwell (compute capability 10.x/12.x)
  needs CUDA >= 12.8, Hopper (9.0) >= 11.8, Ampere (8.x) >= 11.0.
- The driver's own "CUDA Version" (top right of `nvidia-smi`) is the newest CUDA it can run natively
  (DRIVER_CUDA says the same for a driver whose banner was not recorded).
- The CUDA a node runs follows its driver: a working driver is never replaced (upgrading a rented node's
  driver under its container runtime breaks it); the toolkit, when one is wanted, defaults to the
  driver's CUDA; the torch/vLLM build is chosen by trainer/layout/cuda_build.py.
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
# Linux driver branch -> the newest CUDA it runs natively (NVIDIA's CUDA release notes, table 3), newest
# first: what `nvidia-smi` prints as "CUDA Version" for that driver.
DRIVER_CUDA = (
    (580, "13.0"),
    (575, "12.9"),
    (570, "12.8"),
    (565, "12.7"),
    (560, "12.6"),
    (555, "12.5"),
    (550, "12.4"),
    (545, "12.3"),
    (535, "12.2"),
    (530, "12.1"),
    (525, "12.0"),
    (520, "11.8"),
    (450, "11.0"),
)
# compute capability major -> (architecture, oldest CUDA that supports it)
ARCH_BY_CC_MAJOR = {
    7: ("Volta/Turing", (10, 0)),
    8: ("Ampere/Ada", (11, 0)),
    9: ("Hopper", (11, 8)),
    10: ("Blackwell", (12, 8)),
    12: ("Blackwell", (12, 8)),
}


# sysfs `class` prefixes (0xCCSS..) of an NVIDIA (vendor 0x10de) GPU on the PCI bus: 3D controller (the
# datacenter boards) or VGA controller (a card with display outputs). NVSwitches are bridges (0x0680,
# toolchain.py). The bus shows them before any driver loads: how recon tells a bare GPU node from a CPU one.
PCI_GPU_CLASSES = ("0x0302", "0x0300")


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


def parse_pci(text: str) -> list[str]:
    """Bus ids of the NVIDIA GPUs in the gpu_facts probe's PCI lines: "BUS CLASS", one per NVIDIA (vendor
    0x10de) PCI function, e.g. "0000:18:00.0 0x030200", separated by newlines or commas (the role joins
    them with commas); other classes (NVSwitches, audio) are not GPUs."""
    found = []
    for line in re.split(r"[\n,]", text):
        cells = line.split()
        if not cells:
            continue
        if len(cells) != 2 or not re.fullmatch(r"0x[0-9a-fA-F]{6}", cells[1]):
            raise GpuFactsError(f"expected a PCI bus id and its class (0xCCSSPP), got {line.strip()!r}")
        if cells[1].lower().startswith(PCI_GPU_CLASSES):
            found.append(cells[0])
    return found


def driverless_gpus(gpus: dict[str, Any]) -> int:
    """NVIDIA GPUs the PCI bus shows while nvidia-smi lists none: a node before its driver. 0 when
    nvidia-smi lists GPUs, when recon did not look (an older recon.json), and in a container (its PCI bus
    is the host's, and so is its driver: no driver is installed inside one)."""
    if gpus.get("count") or gpus.get("container"):
        return 0
    return int(gpus.get("pci_gpus") or 0)


def gpu_count(gpus: dict[str, Any]) -> int:
    """The host's NVIDIA GPUs: nvidia-smi's, else the PCI bus's before a driver is installed."""
    return int(gpus.get("count") or 0) or driverless_gpus(gpus)


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


def driver_cuda(driver: str, banner_cuda: str | None = None) -> str | None:
    """The newest CUDA `driver` runs natively: nvidia-smi's banner when recorded, else DRIVER_CUDA."""
    if banner_cuda:
        parse_version(banner_cuda)
        return banner_cuda
    major = parse_version(driver)[0]
    return next((cuda for branch, cuda in DRIVER_CUDA if major >= branch), None)


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
    pci: str | None = None,
    container: bool | None = None,
) -> dict[str, Any]:
    """Normalized GPU facts of one host (the `gpus` part of reports/<host>/recon.json).

    query=None or "" means nvidia-smi was absent or failed: no GPU it can see. `pci` is the probe's PCI
    lines (parse_pci; None: not looked at): `pci_gpus` counts the NVIDIA GPUs there, driver or not, so a
    bare node (no driver yet) is told from a CPU host. `container`: recon ran inside one."""
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
        "pci_gpus": len(parse_pci(pci)) if pci is not None else None,
        "container": container,
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
    bare = driverless_gpus(gpus)
    if count is not None and bare and bare != int(count):
        problems.append(f"expected {count} GPUs, found {bare} on the PCI bus (no driver yet)")
    elif count is not None and not bare and gpus["count"] != int(count):
        found = f"expected {count} GPUs, found {gpus['count']}"
        if gpus.get("pci_gpus") and gpus.get("container"):
            found += f" (the PCI bus shows {gpus['pci_gpus']}: a container started without its GPUs?)"
        problems.append(found)
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
    cuda_version: str | None = None,
    secure_boot: bool | None = None,
    toolkit_installed: str | None = None,
    toolkit_wanted: bool = True,
) -> dict[str, Any]:
    """What nvidia_driver and cuda_toolkit should do on a host with these GPU facts.

    A bare node (NVIDIA GPUs on the PCI bus, none listed by nvidia-smi: no driver yet) gets the driver;
    its compute capability is known once the driver runs (gpu_facts probes again after the install).
    driver.action: skip (no GPU) | keep (a working driver: always left alone) | install (no working
    driver: the pinned branch) | refuse (Secure Boot on with no driver: an unsigned module would not
    load; or a pinned branch that cannot run a pinned `cuda_version`).
    cuda.action: skip (no GPU, or no toolkit wanted) | keep (toolkit already at the version) | install |
    refuse (the pair cannot work). The toolkit's version is `cuda_version` when pinned, else the CUDA
    the driver runs (`cuda_version` in the answer says which).
    """
    out: dict[str, Any] = {"driver_branch": driver_branch, "cuda_version": cuda_version}
    bare = driverless_gpus(gpus)
    if not gpu_count(gpus):
        reason = "no NVIDIA GPU on this host (nvidia-smi absent or lists none"
        if gpus.get("pci_gpus") and gpus.get("container"):
            reason += (
                f"; the PCI bus shows {gpus['pci_gpus']}, but this is a container: its driver is the "
                "host's, none is installed in it; start it with its GPUs"
            )
        elif gpus.get("pci_gpus") is not None:
            reason += ", and the PCI bus shows none"
        reason += ")"
        out["driver"] = {"action": "skip", "reason": reason}
        out["cuda"] = {"action": "skip", "reason": reason}
        return out
    driver = gpus.get("driver") if gpus.get("count") else None
    missing = (
        f"nvidia-smi lists no GPU and the PCI bus shows {bare} NVIDIA GPU(s): no driver yet"
        if bare
        else "no working driver"
    )
    if driver:
        out["driver"] = {"action": "keep", "reason": f"working driver {driver}: left alone"}
        effective = driver
    elif secure_boot:
        out["driver"] = {
            "action": "refuse",
            "reason": f"{missing}; Secure Boot is enabled: an unsigned kernel module "
            "would not load. Disable Secure Boot or enroll a MOK key, then re-run (docs: Troubleshooting)",
        }
        effective = None
    elif cuda_version and driver_branch < min_driver_for_cuda(cuda_version):
        out["driver"] = {
            "action": "refuse",
            "reason": f"pinned driver branch {driver_branch} cannot run CUDA {cuda_version} "
            f"(needs >= {min_driver_for_cuda(cuda_version)})",
        }
        effective = None
    else:
        out["driver"] = {"action": "install", "reason": f"{missing}: install branch {driver_branch}"}
        effective = str(driver_branch)
    runs = driver_cuda(effective, gpus.get("driver_cuda") if driver else None) if effective else None
    cuda = cuda_version or runs
    out["cuda_version"] = cuda
    out["cuda"] = _toolkit(gpus, effective, out["driver"], cuda, toolkit_installed, toolkit_wanted)
    return out


def _toolkit(gpus, effective, driver_out, cuda, installed, wanted) -> dict[str, str]:
    if effective is None:
        return {"action": "refuse", "reason": f"no driver to run a CUDA toolkit: {driver_out['reason']}"}
    if not wanted:
        return {
            "action": "skip",
            "reason": "nothing on this node needs nvcc (torch and vLLM bring their CUDA libraries; "
            "cuda_toolkit_install: false)",
        }
    if cuda is None:
        return {
            "action": "refuse",
            "reason": f"driver {effective} is too old for any CUDA this role installs",
        }
    problem = cuda_driver_problem(cuda, effective)
    if problem:
        return {
            "action": "refuse",
            "reason": f"{problem}; the working driver is left alone: leave cuda_toolkit_version empty "
            "(the driver's CUDA) or upgrade the driver by hand (docs: Troubleshooting)",
        }
    arch = cuda_arch_problem(cuda, gpus["compute_cap"]) if gpus.get("compute_cap") else None
    if arch:
        return {"action": "refuse", "reason": arch}
    if installed and parse_version(installed)[:2] == parse_version(cuda)[:2]:
        return {"action": "keep", "reason": f"CUDA toolkit {installed} already installed"}
    return {"action": "install", "reason": f"install CUDA toolkit {cuda} (driver {effective} runs it)"}


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=1, sort_keys=False)
