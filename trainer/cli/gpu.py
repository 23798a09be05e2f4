"""The `dflash gpu` verbs the roles call about a node's GPUs: `gpu facts` (nvidia-smi output as JSON facts,
checked against the group's expected_gpu_* vars) and `gpu decide` (what nvidia_driver and cuda_toolkit do,
and the torch/vLLM CUDA build).

Argument definitions only; each handler imports its (light) module when it runs."""

from __future__ import annotations

import json
from pathlib import Path

from trainer.cli.argtypes import positive


def _read(path: str | None) -> str | None:
    from trainer.layout.gpus import GpuFactsError

    if path is None:
        return None
    p = Path(path)
    if not p.is_file():
        raise GpuFactsError(f"{p} does not exist")
    return p.read_text(errors="replace")


def _json(text: str, what: str):
    from trainer.jsonin import loads, reason
    from trainer.layout.gpus import GpuFactsError

    try:
        return loads(text)
    except ValueError as exc:  # not JSON, nested too deeply, a lone surrogate
        raise GpuFactsError(f"{what}: not JSON: {reason(exc)}") from None


EXPECTED_NUMBERS = ("expected_gpu_count", "expected_gpu_memory_gib")


def _expected(text: str) -> dict:
    """--expected: a JSON object of the group's expected_gpu_* vars, the counts numbers."""
    from trainer.layout.gpus import GpuFactsError

    expected = _json(text, "--expected")
    if not isinstance(expected, dict):
        raise GpuFactsError(
            f"--expected: a JSON object of expected_gpu_* vars, got {type(expected).__name__} "
            "(e.g. '{\"expected_gpu_count\": 8}')"
        )
    for key in EXPECTED_NUMBERS:
        v = expected.get(key)
        ok = v is None or (not isinstance(v, bool) and isinstance(v, int | float) and v == v and abs(v) < 1e6)
        if isinstance(v, str):  # Ansible renders numbers as text: "8" is fine
            try:
                ok = 0 <= float(v) < 1e6
            except ValueError:
                ok = False
        if not ok:
            raise GpuFactsError(f"--expected: {key} must be a number, got {v!r}")
    return expected


def _gpu_facts(args) -> int:
    from trainer.layout.gpus import build_facts, check_expected

    query = args.query_text if args.query_text is not None else _read(args.query)
    smi = args.smi_text if args.smi_text is not None else _read(args.smi)
    container = {"yes": True, "no": False}.get(args.container)
    facts = build_facts(query, smi, pci=args.pci_text, container=container)
    expected = _expected(args.expected) if args.expected else {}
    facts["expected_mismatch"] = check_expected(facts, expected)
    print(json.dumps(facts, indent=1))
    return 0


def _gpu_decide(args) -> int:
    from trainer.layout import cuda_build, toolchain
    from trainer.layout.gpus import GpuFactsError, decide

    facts = _json(_read(args.facts) or "{}", args.facts)
    gpus = facts.get("gpus", facts) if isinstance(facts, dict) else None
    if not isinstance(gpus, dict):
        raise GpuFactsError(f"{args.facts}: not GPU facts (`dflash gpu facts` output or a recon.json)")
    out = decide(
        gpus,
        args.driver_branch,
        args.cuda_version or None,
        secure_boot={"yes": True, "no": False}.get(args.secure_boot),
        toolkit_installed=args.toolkit_installed or None,
        toolkit_wanted=args.toolkit_wanted == "yes",
    )
    out["torch"] = cuda_build.for_decision(gpus, out)
    recon = facts if "gpus" in facts else {"gpus": gpus}
    out["toolchain"] = toolchain.decide(recon, out, args.venv_python, args.site_packages or None)
    print(json.dumps(out, indent=1))
    return 0


def register(sub) -> None:
    p = sub.add_parser("gpu", help="GPU facts from nvidia-smi output, and the driver/CUDA decision")
    gsub = p.add_subparsers(dest="gpu_cmd", required=True, metavar="ACTION")
    f = gsub.add_parser("facts", help="normalize nvidia-smi output into JSON facts")
    f.add_argument("--query", help="file with `nvidia-smi --query-gpu=...` output (absent: no GPU)")
    f.add_argument("--smi", help="file with plain `nvidia-smi` output (for the driver's CUDA version)")
    f.add_argument("--query-text", help="the same output as a string (the gpu_facts role passes it so)")
    f.add_argument("--smi-text", help="plain nvidia-smi output as a string")
    f.add_argument(
        "--pci-text",
        help="the NVIDIA PCI functions, 'BUS CLASS' per line or comma (gpu_facts' probe of "
        "/sys/bus/pci): counts the GPUs before a driver is installed (absent: not looked at)",
    )
    f.add_argument(
        "--container",
        choices=["yes", "no", "unknown"],
        default="unknown",
        help="recon ran in a container (its PCI bus is the host's: no driver is installed there)",
    )
    f.add_argument("--expected", help="JSON of the group's expected_gpu_* vars to compare with")
    f.set_defaults(func=_gpu_facts)
    d = gsub.add_parser(
        "decide", help="what nvidia_driver and cuda_toolkit should do, and the torch/vLLM CUDA build"
    )
    d.add_argument("--facts", required=True, help="JSON from `dflash gpu facts` (or a recon.json)")
    d.add_argument(
        "--driver-branch", type=positive, default=580, help="branch installed where there is no driver (580)"
    )
    d.add_argument(
        "--cuda-version", default="", help="pinned CUDA toolkit version, e.g. 12.4 (empty: the driver's CUDA)"
    )
    d.add_argument(
        "--toolkit-wanted",
        choices=["yes", "no"],
        default="yes",
        help="no: the toolkit is skipped (no nvcc needed)",
    )
    d.add_argument("--secure-boot", choices=["yes", "no", "unknown"], default="unknown")
    d.add_argument("--toolkit-installed", help="version of an installed CUDA toolkit (nvcc), if any")
    d.add_argument(
        "--venv-python",
        choices=["managed", "system"],
        default="managed",
        help="the venv's interpreter: uv's (ships Python.h) or the system python3 (needs python3-dev)",
    )
    d.add_argument(
        "--site-packages",
        help="the venv's site-packages on the node (the toolchain's env names Triton's ptxas there)",
    )
    d.set_defaults(func=_gpu_decide)
