"""What a GPU node needs around the driver, from its recon facts (light side: stdlib only).

`dflash gpu decide` adds this to its JSON as `toolchain`; nvidia_driver installs `driver_packages`,
python_env installs `packages` (prerequisites) and hands `env` to trainer_service's unit. Each part says
why. Facts settled from source (the wheels' files, `ptxas --version` run on them):

- Triton builds its launcher with a C compiler on first CUDA use (triton/runtime/build.py `_build`: $CC,
  else `gcc`, else `clang` on PATH, `-I` the interpreter's sysconfig include dir, where Python.h is).
  uv's managed Pythons (python-build-standalone) ship their headers; the system python3 of Debian/Ubuntu
  needs python3-dev. Debian's gcc only recommends libc6-dev, and apt here installs no recommends.
- torch 2.13.0 pins triton 3.7.1: its bin/ptxas is CUDA 12.8, bin/ptxas-blackwell CUDA 13.1, and
  compiler.py `get_ptxas` takes ptxas-blackwell for sm_100+. triton 3.9.0 (ptxas 12.9, ptxas-blackwell
  13.4) takes it for sm_90+ already. Triton loads the cubin that ptxas writes: a CUDA 13 cubin needs a
  CUDA 13 driver (>= 580: the same sm_90 PTX comes out of 12.8/12.9 as an ELF of OS/ABI 33, ABI version
  7, and out of 13.1/13.4 as OS/ABI 41, ABI version 8); a CUDA 12.x cubin runs on any CUDA 12 driver
  (>= 525, minor-version compatibility). knobs.py reads TRITON_PTXAS_BLACKWELL_PATH for the sm_90+/sm_100+
  assembler. CUDA 12.8's ptxas knows sm_90a/100a/120a, not sm_103a/121a (12.9 does).
- NVSwitch boards (HGX A100/H100/H200/B200) need nvidia-fabricmanager of the driver's exact version,
  else CUDA init fails with error 802 (system not yet initialized). The switches are PCI bridges of
  vendor 0x10de (class 0x0680), visible before any driver is loaded.
- Debian has no nvidia-driver-N-server (Ubuntu's archive names it so): the driver comes from NVIDIA's CUDA
  repository (cuda-keyring; Debian's contrib component on), held to its branch by an APT pin, since the
  branch-named metapackages there do not hold it (sources beside `driver_packages`). Blackwell needs the
  open kernel modules.
"""

from __future__ import annotations

from typing import Any

from trainer.layout.gpus import gpu_count, parse_version

# The CUDA 12 ptxas bundled with every Triton the pinned torch can bring (relative to site-packages).
CUDA12_PTXAS = "triton/backends/nvidia/bin/ptxas"
CUDA12_PTXAS_RELEASE = "12.8"  # the older of triton 3.7.1's (12.8) and 3.9.0's (12.9)
PTXAS_ENV = "TRITON_PTXAS_BLACKWELL_PATH"
# compute capability -> the oldest ptxas (CUDA release) that assembles for it; absent: known to 11.8
PTXAS_FOR_CC = {"10.0": "12.8", "10.3": "12.9", "11.0": "13.0", "12.0": "12.8", "12.1": "12.9"}
CUDA13_DRIVER = 580
COMPILER_PACKAGES = ["gcc", "libc6-dev"]
HEADER_PACKAGES = ["python3-dev"]
FM_SERVICE = "nvidia-fabricmanager"
# From this branch NVIDIA installs the open kernel modules by default (Turing and newer).
OPEN_DEFAULT_BRANCH = 560
# NVIDIA's Debian repository names the fabric manager nvidia-fabricmanager-<branch> up to 575 and
# nvidia-fabricmanager (unversioned, versions 580.x) from 580 (sources beside `driver_packages`).
DEBIAN_FM_UNVERSIONED_BRANCH = 580
PROPRIETARY = "proprietary kernel modules"


def _part(action: str, reason: str, **extra: Any) -> dict[str, Any]:
    return {"action": action, **extra, "reason": reason}


def compiler(facts: dict[str, Any]) -> dict[str, Any]:
    cc = facts.get("c_compiler")
    if cc:
        return _part("keep", f"Triton builds its launcher with {cc}", packages=[])
    why = "no gcc or clang on PATH" if cc is not None else "recon did not look for one (an older recon.json)"
    return _part(
        "install",
        f"{why}: Triton builds its launcher with a C compiler on first CUDA use (triton/runtime/build.py); "
        "gcc, and libc6-dev, which Debian's gcc only recommends",
        packages=list(COMPILER_PACKAGES),
    )


def python_headers(facts: dict[str, Any], venv_python: str) -> dict[str, Any]:
    if venv_python != "system":
        return _part(
            "skip", "the venv's Python is uv's (python-build-standalone): it ships Python.h", packages=[]
        )
    version = facts.get("system_python") or "3"
    if facts.get("system_python_headers"):
        return _part("keep", f"/usr/include/python{version}/Python.h is there", packages=[])
    return _part(
        "install",
        f"the venv runs the system Python {version}, whose headers Triton's launcher build includes "
        f"(/usr/include/python{version}/Python.h): not there",
        packages=list(HEADER_PACKAGES),
    )


def ptxas(gpus: dict[str, Any], driver: str | None, site_packages: str | None) -> dict[str, Any]:
    """What the unit's environment says about Triton's assembler for sm_90+ on this driver."""
    cc = gpus.get("compute_cap")
    if not driver:
        return _part("skip", "no driver the node has or gets: no Triton kernel runs", env={})
    branch = parse_version(driver)[0]
    if branch >= CUDA13_DRIVER:
        return _part(
            "default",
            f"driver {driver} runs CUDA 13: it loads what both of Triton's ptxas (CUDA 12 and 13) write",
            env={},
        )
    if not cc:
        return _part(
            "unknown",
            f"no driver yet, so no compute capability: whether Triton needs its CUDA 12 ptxas on driver "
            f"{driver} is decided when python_env runs after the driver is in (re-run it if it ran before)",
            env={},
        )
    cc_v = parse_version(cc)[:2]
    if cc_v < (9, 0):
        return _part(
            "default",
            f"compute capability {cc}: Triton assembles it with its CUDA 12 ptxas, whose cubins driver "
            f"{driver} loads (CUDA 12 minor-version compatibility)",
            env={},
        )
    need = PTXAS_FOR_CC.get(f"{cc_v[0]}.{cc_v[1]}")
    if need and parse_version(need) > parse_version(CUDA12_PTXAS_RELEASE):
        return _part(
            "refuse",
            f"compute capability {cc} needs ptxas >= {need}; Triton's CUDA 12 ptxas may be "
            f"{CUDA12_PTXAS_RELEASE} and its CUDA 13 one writes cubins driver {driver} cannot load: "
            f"install driver branch {CUDA13_DRIVER} (or newer)",
            env={},
        )
    path = f"{site_packages.rstrip('/')}/{CUDA12_PTXAS}" if site_packages else None
    return _part(
        "pin",
        f"Triton assembles sm_{cc_v[0]}{cc_v[1]} with its CUDA 13 ptxas-blackwell where it can (triton "
        f"3.9: sm_90+; 3.7.1, torch 2.13's: sm_100+), whose cubins need driver >= {CUDA13_DRIVER}; driver "
        f"{driver} is a CUDA 12 driver: {PTXAS_ENV} names Triton's bundled CUDA 12 ptxas, whose cubins "
        "it loads",
        env={PTXAS_ENV: path} if path else {},
        bundled=CUDA12_PTXAS,
    )


def fabric_manager(facts: dict[str, Any], driver_action: str, branch: int) -> dict[str, Any]:
    switches = facts.get("nvswitches")
    if switches is None:
        return _part("unknown", "recon did not count NVSwitches (an older recon.json): re-run recon")
    if not switches:
        return _part("skip", "no NVSwitch on the PCI bus: no fabric manager needed")
    board = f"{switches} NVSwitch on the PCI bus (an HGX board)"
    if driver_action == "install":
        return _part(
            "install",
            f"{board}: CUDA init fails with error 802 until {FM_SERVICE} of the driver's exact version "
            "runs: installed with the driver, from the same repository, and enabled",
            service=FM_SERVICE,
        )
    state = facts.get("fabric_manager") or "unknown"
    if state == "active":
        return _part("running", f"{board}: {FM_SERVICE} is active", service=FM_SERVICE)
    if state == "unknown":
        return _part(
            "unknown",
            f"{board}, and no systemd here to ask: the fabric manager runs outside (the provider's); "
            "if CUDA init fails with error 802, it is down",
            service=FM_SERVICE,
        )
    return _part(
        "warn",
        f"{board} and {FM_SERVICE} is {state}: CUDA init fails with error 802. The working driver is the "
        f"provider's: ask them, or as root `systemctl enable --now {FM_SERVICE}` (its version must equal "
        "the driver's)",
        service=FM_SERVICE,
    )


def driver_packages(gpus: dict[str, Any], os_name: str, kernel: str, branch: int, fm: bool) -> dict:
    """The packages that install driver `branch` on this distribution (nvidia_driver acts on them)."""
    distro, _, version = (os_name or "").partition(" ")
    cc = gpus.get("compute_cap")
    if cc:
        open_modules = parse_version(cc)[0] >= 10
        flavor = "open kernel modules (Blackwell needs them)" if open_modules else PROPRIETARY
    else:  # a bare node: no driver to ask the GPU's compute capability
        open_modules = branch >= OPEN_DEFAULT_BRANCH
        flavor = (
            f"open kernel modules (no driver yet to name the GPUs' architecture: NVIDIA's default from "
            f"branch {OPEN_DEFAULT_BRANCH} for Turing and newer, which Blackwell needs)"
            if open_modules
            else f"{PROPRIETARY} (no driver yet to name the GPUs' architecture)"
        )
    headers = [f"linux-headers-{kernel}"] if kernel else []
    if distro == "Ubuntu":
        name = f"nvidia-driver-{branch}-server" + ("-open" if open_modules else "")
        fm_pkgs = [f"nvidia-fabricmanager-{branch}"] if fm else []
        return _part(
            "install",
            f"Ubuntu's archive: the -server (datacenter) branch {branch}, {flavor}"
            + (", and its fabric manager, the same version from the same archive" if fm else ""),
            repo="distribution",
            components=[],
            pin=None,
            packages=[name, *headers, *fm_pkgs],
        )
    if distro == "Debian":
        # Checked against NVIDIA's public sources, not against the live repository:
        # - NVIDIA Driver Installation Guide, Debian (https://docs.nvidia.com/datacenter/tesla/
        #   driver-installation-guide/debian.html): "sudo add-apt-repository contrib"; the network
        #   repository's .../compute/cuda/repos/$distro/$arch/cuda-keyring_1.1-1_all.deb; "Open Kernel
        #   Modules: sudo apt -V install nvidia-open", "Proprietary Kernel Modules: sudo apt -V install
        #   cuda-drivers"; a branch by "sudo apt install nvidia-driver-pinning-<branch>" first (Recent
        #   Updates: "Driver pinning packages have been introduced for Debian and Ubuntu to track specific
        #   driver branches").
        # - Kernel Modules (.../driver-installation-guide/kernel-modules.html): "Starting in the 560 driver
        #   release series, the open kernel module flavor is the default and suggested installation"
        #   (nvidia-open from then on; before it, nvidia-kernel-open-dkms beside cuda-drivers).
        # - A branch-named metapackage does not hold its branch there: https://forums.developer.nvidia.com/
        #   t/353805 "Debian cuda-drivers-580 package 580.105.08-1 improperly pulls in v590 components":
        #   "Depends: nvidia-driver (>= 580.65.06), nvidia-driver-cuda (>= 580.65.06), nvidia-kernel-dkms
        #   (>= 580.65.06) ...". So the role writes NVIDIA's APT version lock instead (.../version-locking
        #   .html, APT: "Package: src:*nvidia*:any src:cuda-drivers:any src:cuda-compat:any", "Pin: version
        #   <branch>.*", "Pin-Priority: 1000"), which holds any branch; pinning packages are seen for 570
        #   and 580 only.
        # - Fabric manager in https://developer.download.nvidia.com/compute/cuda/repos/debian12/x86_64/:
        #   "nvidia-fabricmanager-550_550.90.07-1_amd64.deb", "nvidia-fabricmanager-570_570.172.08-1_
        #   amd64.deb", "nvidia-fabricmanager-575_575.57.08-1_amd64.deb", and "580 has the following format
        #   nvidia-fabricmanager_580.65.06-1_amd64.deb" (public install scripts quoting the listing). Same
        #   repository, same pin: the driver's version.
        if not open_modules:
            meta = ["cuda-drivers"]
        elif branch >= OPEN_DEFAULT_BRANCH:
            meta = ["nvidia-open"]
        else:
            meta = ["nvidia-kernel-open-dkms", "cuda-drivers"]
        fm_name = (
            "nvidia-fabricmanager"
            if branch >= DEBIAN_FM_UNVERSIONED_BRANCH
            else f"nvidia-fabricmanager-{branch}"
        )
        fm_pkgs = [fm_name] if fm else []
        return _part(
            "install",
            f"Debian {version} has no nvidia-driver-N-server: NVIDIA's CUDA repository (cuda-keyring, with "
            f"Debian's contrib component), {' + '.join(meta)}, {flavor}, held to branch {branch} by an APT "
            f"pin (version {branch}.*: the repository's metapackages follow its newest branch)"
            + (f", and the fabric manager {fm_name} under the same pin" if fm else ""),
            repo="nvidia",
            components=["contrib"],
            pin=f"{branch}.*",
            packages=[*meta, *headers, *fm_pkgs],
        )
    return _part(
        "refuse",
        f"{os_name or 'this OS'}: the role installs drivers on Debian and Ubuntu only; install driver "
        f"branch {branch} by hand (with nvidia-fabricmanager-{branch} on an NVSwitch board), then re-run",
        repo=None,
        components=[],
        pin=None,
        packages=[],
    )


def decide(
    recon: dict[str, Any],
    decision: dict[str, Any],
    venv_python: str = "managed",
    site_packages: str | None = None,
) -> dict[str, Any]:
    """The `toolchain` part of `dflash gpu decide`: `recon` is the host's recon.json, `decision` the
    driver/CUDA decision (gpus.decide). packages/env/refusals gather what the parts below say."""
    gpus = recon.get("gpus", {}) if isinstance(recon.get("gpus"), dict) else {}
    facts = recon.get("toolchain") if isinstance(recon.get("toolchain"), dict) else {}
    branch = int(decision["driver_branch"])
    action = decision["driver"]["action"]
    if not gpu_count(gpus):
        why = "no NVIDIA GPU on this host: Triton never builds a CUDA launcher"
        parts = {k: _part("skip", why) for k in ("compiler", "python_headers", "ptxas", "fabric_manager")}
        parts["ptxas"]["env"] = {}
    else:
        driver = gpus.get("driver") if action == "keep" else (str(branch) if action == "install" else None)
        parts = {
            "compiler": compiler(facts),
            "python_headers": python_headers(facts, venv_python),
            "ptxas": ptxas(gpus, driver, site_packages),
            "fabric_manager": fabric_manager(facts, action, branch),
        }
    if action == "install":
        fm = parts["fabric_manager"]["action"] == "install"
        parts["driver_packages"] = driver_packages(
            gpus, recon.get("os", ""), recon.get("kernel", ""), branch, fm
        )
    packages = [p for k in ("compiler", "python_headers") for p in parts[k].get("packages", [])]
    refusals = [{"what": k, "reason": v["reason"]} for k, v in parts.items() if v["action"] == "refuse"]
    notes = [v["reason"] for v in parts.values() if v["action"] in ("warn", "unknown")]
    return {
        "packages": packages,
        "env": dict(parts["ptxas"]["env"]),
        "refusals": refusals,
        "notes": notes,
        **parts,
    }
