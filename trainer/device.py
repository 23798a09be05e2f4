"""The device a run trains on (`train.device`), and why: the one home of `auto`'s choice.

`auto` is CUDA when torch sees it, else the CPU, but never silently on a machine that has NVIDIA GPUs
torch cannot use (a CPU torch wheel, a driver older than the wheel's CUDA, CUDA_VISIBLE_DEVICES hiding
them): that is refused, as is `cuda` where torch sees none. The machine's GPUs are known without torch,
from what the NVIDIA driver exposes (`/proc/driver/nvidia/gpus/*`, one folder per GPU; else the
`/dev/nvidiaN` device nodes a container is given): no process is started. Preflight reports a refusal
(`machine.cuda_unavailable`, `machine.gpus_unused`); `setup_dist` raises it as a `DeviceRefused` (exit 2)
for a run started without preflight. Light side: torch is imported only when no answer is given.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from trainer.errors import DflashError

PROC_GPUS = Path("/proc/driver/nvidia/gpus")  # the driver's list of the machine's GPUs
DEV = Path("/dev")  # nvidia0, nvidia1, ... (nvidiactl and nvidia-uvm are not GPUs)
DRIVER_VERSION = Path("/proc/driver/nvidia/version")


class DeviceRefused(DflashError):
    """train.device cannot be honoured on this machine; `code` and `fix` as preflight reports them."""

    def __init__(self, code: str, message: str, fix: str):
        super().__init__(f"{message}: {fix}")
        self.code, self.message, self.fix = code, message, fix


@dataclass(frozen=True)
class DeviceChoice:
    type: str  # "cuda" | "cpu"
    why: str  # "auto: CUDA visible", "auto: no CUDA", "train.device cpu", "train.device cuda"

    def describe(self) -> str:
        """'cpu (auto: no CUDA)': what run_start and the log say."""
        return f"{self.type} ({self.why})"


def machine_nvidia_gpus() -> list[str]:
    """The NVIDIA GPUs this machine has, whatever torch sees: PCI addresses from the driver, else the
    device nodes; [] on a machine without them."""
    try:
        found = sorted(p.name for p in PROC_GPUS.iterdir())
    except OSError:
        found = []
    if found:
        return found
    try:
        return sorted(p.name for p in DEV.iterdir() if re.fullmatch(r"nvidia\d+", p.name))
    except OSError:
        return []


def _driver_version() -> str | None:
    try:
        m = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d+(?:\.\d+)+)", DRIVER_VERSION.read_text())
    except OSError:
        return None
    return m.group(1) if m else None


def _torch_cause() -> str:
    """Why torch sees no CUDA, as far as torch and the driver tell."""
    import torch

    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    if hidden is not None and not hidden.strip():
        return "CUDA_VISIBLE_DEVICES is empty: it hides every GPU from this process"
    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is a CPU build: it has no CUDA"
    driver = _driver_version()
    return (
        f"this torch ({torch.__version__}) is built for CUDA {torch.version.cuda} and cannot use the GPUs: "
        f"the driver ({driver or 'version unknown'}) may be older than CUDA {torch.version.cuda} needs, "
        f"or CUDA_VISIBLE_DEVICES ({hidden if hidden is not None else 'unset'}) names none of them"
    )


CUDA_FIX = (
    "install the torch (and vLLM) build for this node's driver (`dflash gpu decide` says which; the "
    "python_env role installs it), check `nvidia-smi` and `python -c 'import torch; "
    "print(torch.cuda.is_available())'` in the run's venv"
)


def choose_device(want: str, cuda: bool | None = None, gpus: list[str] | None = None) -> DeviceChoice:
    """train.device `want` on this machine (`cuda`: whether torch sees CUDA, `gpus`: the machine's NVIDIA
    GPUs; probed when not given). Raises DeviceRefused when it cannot be honoured."""
    if want == "cpu":
        return DeviceChoice("cpu", "train.device cpu")
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    if cuda:
        return DeviceChoice("cuda", "train.device cuda" if want == "cuda" else "auto: CUDA visible")
    if want == "cuda":
        raise DeviceRefused(
            "machine.cuda_unavailable",
            f"train.device is cuda but torch sees no CUDA device here ({_torch_cause()})",
            f"{CUDA_FIX}; or run on the training machine, or set train.device auto or cpu",
        )
    gpus = machine_nvidia_gpus() if gpus is None else gpus
    if gpus:
        raise DeviceRefused(
            "machine.gpus_unused",
            f"train.device auto would train on the CPU, but this machine has {len(gpus)} NVIDIA GPU(s) "
            f"({', '.join(gpus[:4])}{', ...' if len(gpus) > 4 else ''}) that torch cannot use "
            f"({_torch_cause()})",
            f"{CUDA_FIX}; set train.device cpu to train on the CPU on purpose",
        )
    return DeviceChoice("cpu", "auto: no CUDA")
