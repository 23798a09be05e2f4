"""Real test hosts for the Ansible roles: sshd servers in network namespaces on odd ports (like rented
nodes), reached with a generated key and host key checking ON (a known_hosts file of their real host
keys). Hosts share this machine's filesystem, so each gets its own root folder (`dflash_root`).

Used by tests/ansible/ (pytest fixtures), bench/sync.py and by hand (the CLI below: hosts to try a role
on). Needs root, iproute2, openssh-server (requirements/apt.txt). Everything it
creates is removed by `Testbed.close()` (namespaces, veth links, sshd processes it started).

CLI (the hosts outlive the command; DIR/state.json records what `down` removes):
    python -m tests.ansible.testbed up --dir DIR [--names node-a node-b] [--inventory PATH]
        [--var KEY=VALUE ...]
    python -m tests.ansible.testbed down --dir DIR      (idempotent: nothing recorded, nothing to do)"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
SSHD = "/usr/sbin/sshd"
ODD_PORTS = (14085, 22617, 40122, 31337)


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, check=check)


@dataclass
class Host:
    name: str
    ns: str
    addr: str
    port: int
    root: Path
    workdir: Path
    pid: int | None = None
    container: str | None = None

    def ssh(self, bed: Testbed, command: str, check: bool = True) -> subprocess.CompletedProcess:
        """Run `command` on the host over real SSH (the same key and known_hosts Ansible uses). The tests'
        own calls share one connection per host (a master kept 60 s): a journey polls its host every
        second for minutes, and a full handshake per poll cost the suite's CPU (sshd's and ssh's)."""
        mux = ["-o", "ControlMaster=auto", "-o", f"ControlPath={bed.workdir}/cm-%C"]
        mux += ["-o", "ControlPersist=60s"]
        return subprocess.run(
            ["ssh", *bed.ssh_options(), *mux, "-p", str(self.port), f"root@{self.addr}", command],
            capture_output=True,
            text=True,
            check=check,
            timeout=300,
        )

    def local_get(self, url: str) -> tuple[int, str]:
        """(status, body) of a GET from inside the host's own network namespace (what `ssh -L` reaches:
        a port bound to the host's 127.0.0.1)."""
        code = (
            "import sys,urllib.request;r=urllib.request.urlopen(sys.argv[1],timeout=5);"
            "print(r.status);print(r.read().decode())"
        )
        out = _run("ip", "netns", "exec", self.ns, sys.executable, "-c", code, url).stdout
        status, body = out.split("\n", 1)
        return int(status), body

    @property
    def inventory_vars(self) -> dict:
        return {"ansible_host": self.addr, "ansible_port": self.port, "ansible_user": "root"}


@dataclass
class Testbed:
    workdir: Path
    hosts: dict[str, Host] = field(default_factory=dict)
    links: list[str] = field(default_factory=list)
    containers: list[str] = field(default_factory=list)
    joined: dict[str, dict[str, tuple[str, str]]] = field(default_factory=dict)

    @property
    def key(self) -> Path:
        return self.workdir / "id_ed25519"

    @property
    def known_hosts(self) -> Path:
        return self.workdir / "known_hosts"

    def ssh_options(self) -> list[str]:
        return [
            "-i",
            str(self.key),
            "-o",
            "IdentitiesOnly=yes",
            "-o",
            f"UserKnownHostsFile={self.known_hosts}",
            "-o",
            "StrictHostKeyChecking=yes",
            "-o",
            "BatchMode=yes",
            "-o",
            "ConnectTimeout=10",
        ]

    def ssh_common_args(self) -> str:
        return " ".join(self.ssh_options()[2:])  # the key goes in ansible_ssh_private_key_file

    # ------------------------------------------------------------ lifecycle

    def add_host(self, name: str, port: int) -> Host:
        tag = f"{os.getpid() % 100000}{len(self.hosts)}"
        taken = {
            line.split()[0]
            for line in _run("ip", "netns", "list", check=False).stdout.splitlines()
            if line.strip()
        }
        while f"dflash5-{tag}" in taken:  # the CLI's pid may be reused by a later `up` while these hosts run
            tag = f"{random.randint(0, 99999)}{len(self.hosts)}"
        ns = f"dflash5-{tag}"
        third = _free_subnet()
        veth, peer = f"d5{tag}a"[:15], f"d5{tag}b"[:15]
        hdir = self.workdir / name
        root = hdir / "root"
        root.mkdir(parents=True)
        _run("ip", "netns", "add", ns)
        self.links.append(ns)
        _run("ip", "link", "add", veth, "type", "veth", "peer", "name", peer)
        _run("ip", "link", "set", peer, "netns", ns)
        _run("ip", "addr", "add", f"10.200.{third}.1/24", "dev", veth)
        _run("ip", "link", "set", veth, "up")
        addr = f"10.200.{third}.2"
        for cmd in (
            ("ip", "addr", "add", f"{addr}/24", "dev", peer),
            ("ip", "link", "set", peer, "up"),
            ("ip", "link", "set", "lo", "up"),
        ):
            _run("ip", "netns", "exec", ns, *cmd)
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(hdir / "ssh_host_ed25519_key"))
        shutil.copy(self.key.with_suffix(".pub"), hdir / "authorized_keys")
        cfg = hdir / "sshd_config"
        cfg.write_text(
            f"Port {port}\nListenAddress {addr}\nHostKey {hdir}/ssh_host_ed25519_key\nPidFile "
            f"{hdir}/sshd.pid\n"
            f"AuthorizedKeysFile {hdir}/authorized_keys\nPermitRootLogin prohibit-password\n"
            "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
            "MaxSessions 50\nMaxStartups 50\nSubsystem sftp internal-sftp\nAcceptEnv LANG LC_*\n"
        )
        Path("/run/sshd").mkdir(exist_ok=True)
        # a distinct hostname per host (its own UTS namespace), sshd daemonizes and writes its pid file
        _run(
            "ip",
            "netns",
            "exec",
            ns,
            "unshare",
            "--uts",
            "sh",
            "-c",
            f"hostname {name} && exec {SSHD} -f {cfg} -E {hdir}/sshd.log",
        )
        host = Host(name, ns, addr, port, root, hdir)
        self.hosts[name] = host
        _wait_port(addr, port, hdir / "sshd.log")
        pidfile = hdir / "sshd.pid"
        for _ in range(100):  # sshd writes its pid file just after it starts listening
            if pidfile.exists() and pidfile.read_text().strip():
                break
            time.sleep(0.05)
        host.pid = int(pidfile.read_text())
        pub = (hdir / "ssh_host_ed25519_key.pub").read_text().split()
        with open(self.known_hosts, "a") as fh:
            fh.write(f"[{addr}]:{port} {pub[0]} {pub[1]}\n")
        return host

    def add_systemd_host(
        self, name: str, port: int | None = None, image: str = "dflash-systemd-host"
    ) -> Host:
        """A podman container with systemd as PID 1 (its own filesystem, this machine's network), reached
        by SSH on 127.0.0.1:`port`. The image comes from `tests/ansible/build-host-image systemd`.
        Privileged, with its own cgroup namespace: its systemd then owns its cgroups as on a real host, and a
        unit's DevicePolicy= is enforced (this kernel's cgroup v1 devices controller; without these it is
        mounted read-only and every DeviceAllow= is silently a no-op, checked by hand)."""
        return self._add_container_host(
            name, port, image, ["--systemd=always", "--privileged", "--cgroupns=private"], ["/sbin/init"]
        )

    def add_bare_host(self, name: str, port: int | None = None, image: str = "dflash-bare-host") -> Host:
        """A rented GPU node as providers hand them out, without the GPU: a minimal Debian container
        (`tests/ansible/build-host-image bare`: Python and sshd only, no rsync, pip, sudo or systemd) with
        sshd as PID 1 on an odd port, root login by key. Its own filesystem, this machine's network."""
        return self._add_container_host(
            name, port, image, [], ["sh", "-c", "mkdir -p /run/sshd && exec /usr/sbin/sshd -D -e"]
        )

    def _add_container_host(
        self, name: str, port: int | None, image: str, run_args: list[str], command: list[str]
    ) -> Host:
        hdir = self.workdir / name
        hdir.mkdir(parents=True)
        # the container shares this machine's network: take a port nobody listens on (an odd one)
        port = port or _free_port()
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(hdir / "ssh_host_ed25519_key"))
        shutil.copy(self.key.with_suffix(".pub"), hdir / "authorized_keys")
        (hdir / "sshd.conf").write_text(
            f"Port {port}\nListenAddress 127.0.0.1\nHostKey /etc/dflash-test/ssh_host_ed25519_key\n"
            "AuthorizedKeysFile /etc/dflash-test/authorized_keys\nPermitRootLogin prohibit-password\n"
            "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
        )
        container = f"dflash5-{os.getpid()}-{name}"
        _podman(
            "run",
            "-d",
            "--name",
            container,
            "--hostname",
            name,
            *run_args,
            "-v",
            f"{hdir}:/etc/dflash-test:ro",
            "-v",
            f"{hdir / 'sshd.conf'}:/etc/ssh/sshd_config.d/dflash-test.conf:ro",
            image,
            *command,
        )
        self.containers.append(container)
        host = Host(name, "", "127.0.0.1", port, Path("/opt/dflash"), hdir, container=container)
        self.hosts[name] = host
        _wait_port("127.0.0.1", port, hdir / "none", timeout=60)
        pub = (hdir / "ssh_host_ed25519_key.pub").read_text().split()
        with open(self.known_hosts, "a") as fh:
            fh.write(f"[127.0.0.1]:{port} {pub[0]} {pub[1]}\n")
        return host

    def join(self, a: str, b: str) -> dict[str, tuple[str, str]]:
        """A veth link straight between hosts `a` and `b` (a network of their own, as between two rented
        nodes): {host: (its address on the link, its interface)}. Once per pair; it goes with the
        namespaces."""
        key = f"{a}+{b}"
        if key in self.joined:
            return self.joined[key]
        ha, hb = self.hosts[a], self.hosts[b]
        third = 10 + len(self.joined)  # 10.201.x.0/24: inside the hosts' namespaces only
        tag = f"{os.getpid() % 10000}{len(self.joined)}"
        ends = {a: (f"10.201.{third}.1", f"d5j{tag}a"), b: (f"10.201.{third}.2", f"d5j{tag}b")}
        _run("ip", "link", "add", ends[a][1], "type", "veth", "peer", "name", ends[b][1])
        for host, (addr, dev) in ((ha, ends[a]), (hb, ends[b])):
            _run("ip", "link", "set", dev, "netns", host.ns)
            _run("ip", "netns", "exec", host.ns, "ip", "addr", "add", f"{addr}/24", "dev", dev)
            _run("ip", "netns", "exec", host.ns, "ip", "link", "set", dev, "up")
        self.joined[key] = ends
        return ends

    def close(self) -> None:
        for c in self.containers:
            _podman("rm", "-f", "-t", "5", c, check=False)
        self.containers.clear()
        for h in self.hosts.values():
            if h.container:
                continue
            if h.pid and _is_our_sshd(h.pid, h.workdir):  # a recorded pid may be reused by now
                try:
                    os.kill(h.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
            # processes a test started inside the namespace (trainers, monitors) go with it
            pids = _run("ip", "netns", "pids", h.ns, check=False).stdout.split()
            for p in pids:
                try:
                    os.kill(int(p), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
        for ns in self.links:
            _run("ip", "netns", "del", ns, check=False)  # deletes the veth pair with it
        self.hosts.clear()
        self.links.clear()

    def save(self, path: Path) -> Path:
        """Write what `load` (and `down`) needs to find and remove everything: hosts, pids, namespaces,
        containers."""
        state = {
            "workdir": str(self.workdir),
            "hosts": {
                n: {
                    **{k: getattr(h, k) for k in ("name", "ns", "addr", "port", "pid", "container")},
                    "root": str(h.root),
                    "workdir": str(h.workdir),
                }
                for n, h in self.hosts.items()
            },
            "links": list(self.links),
            "containers": list(self.containers),
        }
        tmp = Path(path).with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1) + "\n")
        tmp.replace(path)
        return Path(path)

    @classmethod
    def load(cls, path: Path) -> Testbed:
        state = json.loads(Path(path).read_text())
        hosts = {
            n: Host(**{**h, "root": Path(h["root"]), "workdir": Path(h["workdir"])})
            for n, h in state["hosts"].items()
        }
        return cls(Path(state["workdir"]), hosts, list(state["links"]), list(state["containers"]))

    def inventory(
        self,
        path: Path,
        extra_hostvars: dict[str, dict] | None = None,
        group: str = "testhosts",
        group_vars: dict | None = None,
    ) -> Path:
        """An inventory of the hosts (their odd ports, the key, host key checking on)."""
        hosts = {}
        for name, h in self.hosts.items():
            hv = {**h.inventory_vars, "dflash_root": str(h.root)}
            if h.container:  # its own filesystem: the usual host-wide paths
                hv["gpu_facts_fact_dir"] = "/etc/ansible/facts.d"
            hosts[name] = {**hv, **(extra_hostvars or {}).get(name, {})}
        inv = {
            "all": {
                "vars": {
                    "ansible_ssh_private_key_file": str(self.key),
                    "ansible_ssh_common_args": self.ssh_common_args(),
                    "ansible_python_interpreter": "/usr/bin/python3",
                    # hosts share this machine's filesystem: host-wide paths go under each host's root
                    "gpu_facts_fact_dir": "{{ dflash_root }}/facts.d",
                    # and reports/<host>/recon.json beside this inventory, not in the repo's reports/
                    "gpu_facts_report_dir": str(Path(path).resolve().parent / "reports"),
                    "dflash_repo": str(REPO),
                    # these inventories set every variable a test needs themselves (no inventory/group_vars/):
                    # the marker the prerequisites role looks for (a user's gets it from group_vars/all)
                    "dflash_group_vars": "loaded",
                    **(group_vars or {}),
                },
                "children": {group: {"hosts": hosts}},
            }
        }
        path.write_text(yaml.safe_dump(inv, sort_keys=False))
        return path


PODMAN_DIR = Path(__file__).resolve().parent / "podman"


def _podman(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "CONTAINERS_CONF": str(PODMAN_DIR / "containers.conf"),
        "CONTAINERS_STORAGE_CONF": str(PODMAN_DIR / "storage.conf"),
    }
    return subprocess.run(["podman", *args], capture_output=True, text=True, check=check, env=env)


def build_host_image(kind: str) -> None:
    """The local podman image of a test host: `systemd` or `bare` (tests/ansible/build-host-image)."""
    subprocess.run([str(Path(__file__).resolve().parent / "build-host-image"), kind], check=True)


def _is_our_sshd(pid: int, hdir: Path) -> bool:
    """Whether `pid` is still the sshd this testbed started for the host folder `hdir`."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False
    return "sshd" in cmdline and str(hdir) in cmdline


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _free_subnet() -> int:
    used = _run("ip", "-o", "-4", "addr", check=False).stdout
    for _ in range(200):
        third = random.randint(100, 250)
        if f"10.200.{third}." not in used:
            return third
    raise RuntimeError("no free 10.200.x.0/24 subnet for a test host")


def _wait_port(addr: str, port: int, log: Path, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((addr, port), timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(
        f"sshd on {addr}:{port} did not start: {log.read_text() if log.exists() else 'no log'}"
    )


def start(workdir: Path, names: tuple[str, ...] = ("node-a", "node-b")) -> Testbed:
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    bed = Testbed(workdir)
    _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "dflash-testbed", "-f", str(bed.key))
    bed.known_hosts.write_text("")
    try:
        for i, name in enumerate(names):
            bed.add_host(name, ODD_PORTS[i % len(ODD_PORTS)])
    except BaseException:
        bed.close()
        raise
    return bed


def preconditions() -> str | None:
    """Why real hosts cannot run here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in (SSHD, shutil.which("ip"), shutil.which("ssh"), shutil.which("rsync")):
        if not tool or not Path(tool).exists():
            return "missing openssh-server/iproute2/rsync (scripts/setup-system installs them)"
    return None


STATE = "state.json"


def up(
    workdir: Path, names: tuple[str, ...], inventory: Path | None = None, group_vars: dict | None = None
) -> dict:
    """Start hosts in `workdir`, record them in workdir/state.json, write the inventory; they keep running."""
    workdir = Path(workdir).resolve()
    if (workdir / STATE).exists() and Testbed.load(workdir / STATE).hosts:
        raise SystemExit(f"testbed: {workdir} already has running hosts (run `down --dir {workdir}` first)")
    why = preconditions()
    if why:
        raise SystemExit(f"testbed: real test hosts cannot start here: {why}")
    bed = start(workdir, names)
    try:
        bed.save(workdir / STATE)
        inv = bed.inventory(
            Path(inventory) if inventory else workdir / "inventory.yml", group_vars=group_vars
        )
    except BaseException:
        bed.close()
        raise
    return {
        "state": str(workdir / STATE),
        "inventory": str(inv),
        "hosts": {n: {"addr": h.addr, "port": h.port, "root": str(h.root)} for n, h in bed.hosts.items()},
    }


def down(workdir: Path) -> dict:
    """Stop everything workdir/state.json records (no state, or already down: nothing to do)."""
    path = Path(workdir).resolve() / STATE
    if not path.exists():
        return {"removed": []}
    bed = Testbed.load(path)
    removed = sorted(bed.hosts)
    bed.close()
    bed.containers.clear()
    bed.save(path)  # now records nothing: a second `down` is a no-op
    return {"removed": removed}


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m tests.ansible.testbed", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up", help="start sshd hosts in network namespaces (they outlive this command)")
    u.add_argument("--dir", required=True, type=Path, help="testbed folder (keys, host roots, state.json)")
    u.add_argument(
        "--names", nargs="+", default=["node-a", "node-b"], help="host names (default: node-a node-b)"
    )
    u.add_argument("--inventory", type=Path, help="where to write the inventory (default: DIR/inventory.yml)")
    u.add_argument(
        "--var",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an extra variable for all hosts in the inventory (repeatable; VALUE is YAML)",
    )
    d = sub.add_parser("down", help="stop the hosts DIR/state.json records (idempotent)")
    d.add_argument("--dir", required=True, type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "up":
        group_vars = {}
        for kv in args.var:
            key, sep, value = kv.partition("=")
            if not sep:
                ap.error(f"--var {kv!r}: expected KEY=VALUE")
            group_vars[key] = yaml.safe_load(value) if value else ""
        out = up(args.dir, tuple(args.names), args.inventory, group_vars)
    else:
        out = down(args.dir)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
