"""What the trainer's service must open on its node: `dflash service sandbox` (the trainer_service role
renders its JSON into the systemd unit; the environment part goes to supervisord too).

- Devices: every NVIDIA and InfiniBand device node recon found (`devices` in recon.json), allowed by path
  (systemd stats each at the unit's start: its exact major:minor, whatever /proc/devices calls it), plus
  the /proc/devices name globs `char-nvidia*` and `char-infiniband*`. systemd matches those with
  fnmatch() against /proc/devices at the unit's start (src/core/bpf-devices.c), so one glob covers every
  driver's naming: `nvidia` (since driver 550.40), `nvidia-frontend` (before), `nvidia-uvm`,
  `nvidia-caps`, `nvidia-nvswitch`, `nvidia-nvlink`; `infiniband_verbs` and `infiniband_mad`. rdma_cm is
  a misc device (major 10), allowed by path only. InfiniBand also needs LimitMEMLOCK=infinity (verbs pin
  their buffers). A node with neither keeps PrivateDevices=yes.
- The ranks of one run: one node talks over loopback only (torchrun's store and MASTER_ADDR on
  127.0.0.1 instead of the host's FQDN, gloo and NCCL bootstrap on `lo`, vLLM's VLLM_HOST_IP), so
  IPAddressAllow=localhost holds whatever the node's addresses are or its hostname resolves to (and the
  resolver, often not on loopback, is never asked). Several nodes: the interface that holds this node's
  cluster address (or trainer_service_socket_ifname) carries gloo and NCCL; its networks and every
  node's cluster address are allowed.
- A tracker that streams off the node (W&B online, an MLflow http(s) URI not on loopback, a trackio
  Space): systemd's IPAddressAllow takes addresses only, and such an endpoint (and the resolver that
  finds it) has none fixed, so the filter is lifted and the reason is returned for the play to print.
Light side: stdlib only.
"""

from __future__ import annotations

import ipaddress
import json
import os
import sys
from pathlib import Path
from urllib.parse import urlsplit

from trainer import jsonin
from trainer.errors import DflashError

LOOPBACK = "127.0.0.1"
# always allowed on a GPU node, present or not at recon (nvidia-uvm appears on first CUDA use)
NVIDIA_ALWAYS = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")


class SandboxError(DflashError, ValueError):
    pass


def _devices(recon: dict) -> tuple[list[str], bool, list[str]]:
    """(DeviceAllow= values, InfiniBand present, reasons) from one node's recon facts."""
    dev = recon.get("devices") or {}
    if not isinstance(dev, dict):
        raise SandboxError("recon facts: `devices` is not a mapping (run recon again: playbooks/recon.yml)")
    nodes = [str(n) for n in dev.get("nodes") or []]
    names = [str(n) for n in dev.get("names") or []]
    gpus = int((recon.get("gpus") or {}).get("count") or 0)
    nvidia = [n for n in nodes if n.startswith("/dev/nvidia")]
    ib = [n for n in nodes if n.startswith("/dev/infiniband/")]
    has_nvidia = bool(gpus or nvidia or any(n.startswith("nvidia") for n in names))
    has_ib = bool(ib or any(n.startswith("infiniband") for n in names))
    allow: list[str] = []
    reasons: list[str] = []
    if has_nvidia:
        allow += ["char-nvidia*"] + sorted(set(nvidia) | set(NVIDIA_ALWAYS))
        reasons.append(
            f"NVIDIA devices ({gpus} GPU(s), nodes {', '.join(nvidia) or 'none yet'}): char-nvidia* "
            "(every /proc/devices naming) and each node by path"
        )
    if has_ib:
        allow += ["char-infiniband*"] + sorted(set(ib) | {"/dev/infiniband/rdma_cm"})
        reasons.append(
            f"InfiniBand ({', '.join(ib) or 'named in /proc/devices'}): char-infiniband*, each node by "
            "path, LimitMEMLOCK=infinity"
        )
    return [f"{a} rw" for a in allow], has_ib, reasons


def online_tracker(config: dict, env: dict) -> str:
    """Why the run streams to a tracker off the node ('' when it does not)."""
    report_to = config.get("report_to") or []
    why = []
    if "wandb" in report_to and (config.get("trackers") or {}).get("wandb_mode") == "online":
        why.append("W&B online")
    uri = str(env.get("MLFLOW_TRACKING_URI") or "")
    if "mlflow" in report_to and uri.startswith(("http://", "https://")):
        host = urlsplit(uri).hostname or ""
        if not _is_loopback(host):
            why.append(f"MLflow at {host}")
    if "trackio" in report_to and env.get("TRACKIO_SPACE_ID"):
        why.append(f"trackio Space {env['TRACKIO_SPACE_ID']}")
    return ", ".join(why)


def _is_loopback(host: str) -> bool:
    if host in ("localhost", "localhost.localdomain") or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _iface_addresses(interfaces: list[dict]) -> dict[str, list]:
    """{device: [its interface networks]} from Ansible's per-interface facts (ansible_facts[iface])."""
    out: dict[str, list] = {}
    for f in interfaces or []:
        if not isinstance(f, dict) or not f.get("device"):
            continue
        nets = []
        for a in [f.get("ipv4") or {}] + list(f.get("ipv4_secondaries") or []):
            if a.get("address"):
                nets.append(ipaddress.ip_interface(f"{a['address']}/{a.get('netmask') or '32'}"))
        for a in f.get("ipv6") or []:
            if a.get("address"):
                nets.append(ipaddress.ip_interface(f"{a['address'].split('%')[0]}/{a.get('prefix') or 128}"))
        out[f["device"]] = nets
    return out


def _networks(nets: list, have: list[str]) -> list[str]:
    """An interface's networks (not link-local) not yet in `have`."""
    return [str(n.network) for n in nets if not n.ip.is_link_local and str(n.network) not in have]


def decide(
    recon: dict,
    config: dict,
    *,
    node_rank: int = 0,
    node_addresses: list[str] | None = None,
    interfaces: list[dict] | None = None,
    socket_ifname: str = "",
    ip_filter: bool = True,
    env: dict | None = None,
) -> dict:
    """The unit's sandbox and the ranks' network environment for node `node_rank` of
    len(node_addresses) nodes (one when empty). JSON-ready."""
    env = env or {}
    addrs = [a for a in node_addresses or [] if a]
    nodes = max(1, len(node_addresses or []))
    allow_dev, has_ib, reasons = _devices(recon)
    ifaces = _iface_addresses(interfaces or [])
    out_env: dict[str, str] = {}
    ip_allow = ["localhost"]
    if nodes == 1:
        local_addr = LOOPBACK
        ifname = socket_ifname or "lo"
        out_env["VLLM_HOST_IP"] = LOOPBACK
        ip_allow += _networks(ifaces.get(socket_ifname, []), ip_allow) if socket_ifname else []
        reasons.append(
            f"one node: torchrun's store on {LOOPBACK}, gloo/NCCL bootstrap on {ifname}"
            + ("" if socket_ifname else ", vLLM on 127.0.0.1: nothing leaves loopback")
        )
    else:
        if not 0 <= node_rank < nodes or len(addrs) != nodes:
            raise SandboxError(f"node rank {node_rank} of {nodes} nodes with addresses {node_addresses}")
        local_addr = addrs[node_rank]
        try:
            mine = ipaddress.ip_address(local_addr)
        except ValueError:
            raise SandboxError(
                f"node {node_rank}'s cluster address {local_addr!r} is not an IP address: systemd's "
                "filter allows addresses only (set trainer_service_node_addresses)"
            ) from None
        ifname = socket_ifname or next(
            (d for d, nets in ifaces.items() if any(n.ip == mine for n in nets)), ""
        )
        if not ifname:
            raise SandboxError(
                f"node {node_rank}'s cluster address {local_addr} is on none of its interfaces "
                f"({', '.join(sorted(ifaces)) or 'no interface facts'}): set trainer_service_node_addresses "
                "to the addresses the nodes reach each other on, or trainer_service_socket_ifname"
            )
        out_env["VLLM_HOST_IP"] = local_addr
        ip_allow += list(dict.fromkeys(addrs))
        ip_allow += _networks(ifaces.get(ifname, []), ip_allow)
        reasons.append(
            f"{nodes} nodes: gloo/NCCL on {ifname} (this node's {local_addr}), its networks and the "
            "nodes' addresses allowed"
        )
    out_env["GLOO_SOCKET_IFNAME"] = out_env["NCCL_SOCKET_IFNAME"] = ifname
    tracker = online_tracker(config, env)
    if not ip_filter:
        ip_allow = []
        reasons.append("no IP filter (trainer_service_local_only: false)")
    elif tracker:
        ip_allow = []
        reasons.append(
            f"IP filter lifted: report_to streams to {tracker}, whose endpoint (and the resolver that finds "
            "it) has no fixed address, and systemd's IPAddressAllow takes addresses only"
        )
    return {
        "private_devices": not allow_dev,
        "device_allow": allow_dev,
        "limit_memlock": "infinity" if has_ib else "",
        "ip_deny": "any" if ip_allow else "",
        "ip_allow": ip_allow,
        "env": out_env,
        "local_addr": local_addr,
        "online_tracker": tracker,
        "reasons": reasons,
    }


def cmd_sandbox(args) -> int:
    """`dflash service sandbox` (trainer/cli/node.py): read its inputs, print the decision as JSON."""

    def load(text: str, what: str):
        try:
            return jsonin.loads(text)
        except jsonin.BadJson as exc:  # nested too deeply, a lone surrogate: YAML would not take it either
            raise SandboxError(f"{what}: {exc}") from None
        except json.JSONDecodeError:
            import yaml

            from trainer.config import user_yaml

            try:
                return user_yaml.safe_load(text)  # a key said twice is refused, not last-wins
            except yaml.YAMLError as exc:
                raise SandboxError(f"{what}: neither JSON nor YAML: {' '.join(str(exc).split())}") from None

    if args.facts_json is not None:
        recon = load(args.facts_json, "--facts-json")
    elif not Path(args.facts).is_file():
        raise SandboxError(f"--facts {args.facts} does not exist (run recon first: playbooks/recon.yml)")
    else:
        recon = load(Path(args.facts).read_text(errors="replace"), args.facts)
    if args.config == "-":
        config = load(sys.stdin.read(), "--config -")
    elif args.config:
        if not Path(args.config).is_file():
            raise SandboxError(f"--config {args.config} does not exist")
        config = load(Path(args.config).read_text(errors="replace"), args.config)
    else:
        config = {}
    interfaces = load(args.interfaces, "--interfaces") if args.interfaces else []
    facts_from = "--facts-json" if args.facts_json is not None else f"--facts {args.facts}"
    for value, ok, said in (
        (recon, isinstance(recon, dict), f"{facts_from} is not a mapping (recon's JSON report)"),
        (config, isinstance(config or {}, dict), "--config is not a mapping (a run config)"),
        (interfaces, isinstance(interfaces, list), "--interfaces is not a JSON list of interface facts"),
    ):
        if not ok:
            raise SandboxError(f"{said}: got {type(value).__name__}")
    out = decide(
        recon,
        config or {},
        node_rank=args.node_rank,
        node_addresses=args.node_address or [],
        interfaces=interfaces,
        socket_ifname=args.socket_ifname,
        ip_filter=not args.no_ip_filter,
        env=dict(os.environ),
    )
    print(json.dumps(out, indent=1))
    return 0
