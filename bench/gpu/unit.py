"""The GPU check's stages in the service's environment: where systemd runs, each stage's command runs in
a transient unit (`systemd-run --wait --pipe`) with the sandbox of the product's own unit; elsewhere the
check says that it ran outside a unit, and why.

The properties are not copied by hand: they are the [Service] lines of the role's template
(roles/trainer_service/templates/dflash-train.service.j2) rendered here with jinja2 and the role's own
defaults and derived vars (defaults/main.yml, vars/main.yml, evaluated lazily with the few Ansible
filters they use), the host's recon facts (/etc/ansible/facts.d/dflash.fact, else nvidia-smi through
`dflash gpu facts`'s parser) and the check's paths in place of the run's (its work folder is the run
folder: ReadWritePaths, HOME). Every line of [Service] is taken except the ones that say what runs and
how it is supervised (PROCESS_KEYS); so a property the template gains (a DeviceAllow=, LimitMEMLOCK=,
an IPAddressAllow=) is in the check's unit the day it is in the product's. The unit's environment is the
template's Environment= lines plus what the check itself needs (ADDED_ENV), nothing inherited: the
variables the template used that the check could not give a value are listed (`unknown_vars`)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROLE = REPO / "roles" / "trainer_service"
TEMPLATE = ROLE / "templates" / "dflash-train.service.j2"
FACT_FILE = Path("/etc/ansible/facts.d/dflash.fact")  # gpu_facts_fact_dir's, on a provisioned node
# what runs and how it is supervised: the check sets these itself (its command, its user, no restart)
PROCESS_KEYS = {
    "Type", "User", "Group", "WorkingDirectory", "Environment", "EnvironmentFile", "ExecStart",
    "ExecStartPre", "ExecStartPost", "ExecStop", "ExecStopPost", "ExecReload", "Restart",
    "RestartPreventExitStatus", "RestartSec", "KillMode", "KillSignal", "TimeoutStopSec",
    "TimeoutStartSec", "StandardOutput", "StandardError", "StandardInput", "SyslogIdentifier",
    "SuccessExitStatus", "RemainAfterExit",
}  # fmt: skip
# the check's own environment in the unit (the product's venv has the trainer installed; the check's
# Python finds it, and the carried wheels, on PYTHONPATH)
ADDED_ENV = ("PYTHONPATH", "GPU_CHECK_STAGE", "TOKENIZERS_PARALLELISM", "OMP_NUM_THREADS")


def decide(flag: str, cuda: bool) -> tuple[bool, str]:
    """Whether the stages run in transient units (`--unit auto|on|off`), and why (or why not)."""
    if flag == "off":
        return False, "outside a unit: --unit off"
    why_not = []
    if not Path("/run/systemd/system").is_dir():  # sd_booted(): systemd is the init system
        why_not.append("systemd is not running here (no /run/systemd/system)")
    if shutil.which("systemd-run") is None:
        why_not.append("no systemd-run")
    if os.geteuid() != 0:
        why_not.append("not root (the product's unit is a system unit)")
    if not why_not:
        return True, "in transient units with dflash-train.service's sandbox"
    reason = "outside a unit: " + "; ".join(why_not)
    if flag == "on":
        raise SystemExit(f"gpu-check: --unit on, but {reason.removeprefix('outside a unit: ')}")
    return False, reason + (" (the product's node runs its trainer under supervisord then)" if cuda else "")


# ---- the role's variables, evaluated lazily (as Ansible does) -------------------------------------
def _bool(v) -> bool:
    return v if isinstance(v, bool) else str(v).strip().lower() in ("1", "true", "yes", "on", "y", "t")


def _combine(*dicts, recursive: bool = False, **_):
    out: dict = {}
    for d in dicts:
        for k, v in (d or {}).items():
            if recursive and isinstance(v, dict) and isinstance(out.get(k), dict):
                out[k] = _combine(out[k], v, recursive=True)
            else:
                out[k] = v
    return out


class RoleVars:
    """A mapping of the role's vars: overrides first, then vars/main.yml, then defaults/main.yml; a
    templated value is evaluated when first read (jinja2's native types, so lists stay lists)."""

    def __init__(self, overrides: dict):
        import jinja2
        import yaml
        from jinja2.nativetypes import NativeEnvironment

        self.unknown: set[str] = set()
        unknown = self.unknown

        class Recorded(jinja2.Undefined):  # an unknown variable that was used (not merely defaulted)
            def _used(self):
                unknown.add(self._undefined_name or "?")

            def __str__(self):
                self._used()
                return ""

            def __iter__(self):
                self._used()
                return iter(())

            def __bool__(self):
                self._used()
                return False

            def __len__(self):
                self._used()
                return 0

            def __getattr__(self, name):
                if name.startswith("__"):
                    raise AttributeError(name)
                self._used()
                return self

            __getitem__ = __getattr__

        self.raw: dict = {}
        for f in (ROLE / "defaults" / "main.yml", ROLE / "vars" / "main.yml"):
            self.raw.update(yaml.safe_load(f.read_text()) or {})
        self.raw.update(overrides)
        self.done: dict = dict(overrides)
        self.native = NativeEnvironment(undefined=Recorded)
        self.text = jinja2.Environment(undefined=Recorded, keep_trailing_newline=True)
        for env in (self.native, self.text):
            env.filters.update(
                combine=_combine,
                bool=_bool,
                regex_replace=lambda s, p, r="": re.sub(p, r, str(s)),
                extract=lambda k, c, *rest: c[k],
                hash=lambda s, alg="sha1": hashlib.new(alg, str(s).encode()).hexdigest(),
                from_yaml=yaml.safe_load,
                to_json=json.dumps,
            )
            env.tests.update(
                match=lambda s, p: re.match(p, str(s)) is not None,
                search=lambda s, p: re.search(p, str(s)) is not None,
            )
        self._busy: set[str] = set()

    def __contains__(self, key) -> bool:
        return key in self.done or key in self.raw or key in self.native.globals

    def __getitem__(self, key):
        if key in self.done:
            return self.done[key]
        if key not in self.raw:
            return self.native.globals[key]
        if key in self._busy:
            raise RecursionError(f"{key} refers to itself")
        self._busy.add(key)
        try:
            self.done[key] = self.evaluate(self.raw[key])
        except Exception:  # an expression this stand-in for Ansible cannot evaluate: unknown
            self.unknown.add(key)
            self.done[key] = self.native.undefined(name=key)
        finally:
            self._busy.discard(key)
        return self.done[key]

    def evaluate(self, value):
        if isinstance(value, list):
            return [self.evaluate(v) for v in value]
        if isinstance(value, dict):
            return {k: self.evaluate(v) for k, v in value.items()}
        if not isinstance(value, str) or ("{{" not in value and "{%" not in value):
            return value
        return self.render(self.native, value)

    def render(self, env, source: str):
        """`source` rendered with these vars as its context (shared: no eager copy of every var)."""
        from jinja2.nativetypes import native_concat

        t = env.from_string(source)
        parts = t.root_render_func(t.new_context(self, shared=True))
        return native_concat(parts) if env is self.native else "".join(parts)


def host_facts(cuda: bool) -> dict:
    """ansible_local.dflash as recon wrote it on this node, else the same facts taken here: the GPUs
    (nvidia-smi through `dflash gpu facts`'s parser) and the device nodes (gpu_facts's probe)."""
    try:
        facts = json.loads(FACT_FILE.read_text())
    except (OSError, ValueError):
        from trainer.layout.gpus import QUERY_COMMAND, build_facts

        query = banner = ""
        if cuda and shutil.which("nvidia-smi"):
            run = lambda cmd: subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)  # noqa: E731
            query, banner = run(QUERY_COMMAND).stdout, run(["nvidia-smi"]).stdout
        facts = {"gpus": build_facts(query, banner), "systemd": Path("/run/systemd/system").is_dir()}
    facts.setdefault("devices", device_facts())
    return facts


def device_facts() -> dict:
    """roles/gpu_facts's probe: the NVIDIA and InfiniBand character device nodes, and the names
    /proc/devices gives their majors (the driver's naming)."""
    nodes = [
        str(p)
        for p in sorted(
            {
                *Path("/dev").glob("nvidia*"),
                *Path("/dev").glob("*/nvidia*"),
                *Path("/dev/infiniband").glob("*"),
            }
        )
        if p.is_char_device()
    ]
    names: set[str] = set()
    try:
        text = Path("/proc/devices").read_text().split("Block devices:")[0]
        names = {
            f[1]
            for f in (x.split() for x in text.splitlines())
            if len(f) == 2 and f[1].startswith(("nvidia", "infiniband"))
        }
    except OSError:
        pass
    return {"nodes": nodes, "names": sorted(names)}


def role_decisions(ctx: RoleVars, recon: dict) -> dict:
    """What the role asks `dflash` on the controller and sets as facts, asked here of the same code for
    this host: the unit's sandbox (`dflash service sandbox`: devices, IP filter, the ranks' network
    environment) and the toolchain's environment (`dflash gpu decide`'s toolchain.env, python_env's
    python_env_toolchain_env: Triton's CUDA 12 ptxas on a CUDA 12 driver). The run config is the check's,
    which streams to no tracker. A module that is not there leaves its variable unknown (reported)."""
    out: dict = {}
    try:
        from trainer.layout.sandbox import decide as sandbox
    except ImportError:
        pass
    else:
        out["trainer_service_sandbox"] = sandbox(
            recon, {}, ip_filter=_bool(ctx["trainer_service_local_only"])
        )
    try:
        import importlib.util

        from trainer.layout import toolchain
        from trainer.layout.gpus import decide as gpu_decide

        decision = gpu_decide(recon.get("gpus") or {}, 580, None, toolkit_wanted=False)
        spec = importlib.util.find_spec("triton")
        site = str(Path(spec.origin).parents[1]) if spec and spec.origin else None
        out["python_env_toolchain_env"] = toolchain.decide(recon, decision, "managed", site)["env"]
    except Exception:  # no such module, or facts it refuses: the unit gets what the template defaults to
        pass
    return out


def addresses() -> dict:
    """This host's interfaces and addresses, as Ansible's facts name them (a template may allow them)."""
    v4, v6, names = [], [], []
    try:
        import psutil

        for name, addrs in psutil.net_if_addrs().items():
            names.append(name)
            for a in addrs:
                if a.family == socket.AF_INET:
                    v4.append(a.address)
                elif a.family == socket.AF_INET6:
                    v6.append(a.address.split("%")[0])
    except ImportError:
        pass
    return {"interfaces": names, "all_ipv4_addresses": v4, "all_ipv6_addresses": v6}


def render(run_dir: Path, paths: list[Path], cuda: bool) -> tuple[list[tuple[str, str]], list[str]]:
    """The [Service] lines of the product's unit for a run in `run_dir` on this host: (key, value)
    pairs in order, and the names of the variables the template used that had no value here."""
    host = socket.gethostname()
    net = addresses()
    local = host_facts(cuda)
    facts = {**net, "hostname": host, "user_id": _user(), "local": {"dflash": local}}
    overrides = {
        "ansible_managed": "rendered by bench/gpu/unit.py for the GPU check",
        "inventory_hostname": host,
        "ansible_play_hosts_all": [host],
        "hostvars": {host: {"ansible_host": ""}},
        # dflash_toolchain: python_env's kept copy of its toolchain env, read only where the play has no
        # python_env_toolchain_env (the check gives that one: role_decisions)
        "ansible_local": {"dflash": local, "dflash_toolchain": {"env": {}}},
        "ansible_facts": facts,
        **{f"ansible_{k}": v for k, v in net.items()},
        "dflash_root": str(run_dir),
        "trainer_service_run_dir": str(run_dir),
        "trainer_service_paths_all": sorted({str(p) for p in paths}),  # ProtectHome: read-only under /root
        "trainer_service_venv": sys.prefix,
    }
    ctx = RoleVars(overrides)
    ctx.done.update(role_decisions(ctx, local))
    text = ctx.render(ctx.text, service_source(TEMPLATE.read_text()))
    lines = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, value = line.split("=", 1)
            lines.append((key.strip(), value.strip()))
    return lines, sorted(ctx.unknown)


def service_source(template: str) -> str:
    """The template's [Service] section before rendering, less its comments and the lines of
    PROCESS_KEYS but Environment= (so that a variable only those use is not asked for)."""
    out, section = [], None
    for line in template.splitlines():
        s = line.strip()
        if re.fullmatch(r"\[\w+\]", s):
            section = s
            continue
        key = s.split("=", 1)[0].strip() if "=" in s and not s.startswith("{") else None
        if section != "[Service]" or s.startswith("#") or (key in PROCESS_KEYS and key != "Environment"):
            continue
        out.append(line)
    return "\n".join(out) + "\n"


def _user() -> str:
    import pwd

    return pwd.getpwuid(os.geteuid()).pw_name


class Unit:
    """The transient units of one shape's stages: the product's sandbox for a run in `work`."""

    def __init__(self, work: Path, cuda: bool):
        site = [Path(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        paths = [REPO, work, Path(sys.prefix), Path(sys.base_prefix), *site]
        self.lines, self.unknown = render(work, paths, cuda)
        self.properties = [(k, v) for k, v in self.lines if k not in PROCESS_KEYS]
        self.env = dict(v.split("=", 1) for k, v in self.lines if k == "Environment" and "=" in v)
        self.names: list[str] = []

    def wrap(self, cmd: list[str], env: dict[str, str], stage: str) -> list[str]:
        """`cmd` as a transient unit's command: the sandbox properties, the template's environment and
        the check's own (ADDED_ENV), the caller's stdin/stdout/stderr (--pipe), its exit code (--wait)."""
        name = f"dflash-gpu-check-{stage}-{os.getpid()}-{len(self.names)}"
        self.names.append(name)
        own = {k: env[k] for k in ADDED_ENV if k in env}
        setenv = [f"--setenv={k}={v}" for k, v in {**self.env, **own}.items()]
        props = [f"--property={k}={v}" for k, v in self.properties]
        head = ["systemd-run", f"--unit={name}", "--wait", "--pipe", "--quiet", "--collect"]
        return [*head, "--property=KillMode=mixed", f"--working-directory={REPO}", *props, *setenv, *cmd]

    def stop(self) -> None:
        """Stop the units a timed-out stage left (systemd-run's client was ended, not its service)."""
        for name in self.names:
            subprocess.run(["systemctl", "stop", f"{name}.service"], capture_output=True, check=False)

    def record(self) -> dict:
        return {
            "template": str(TEMPLATE.relative_to(REPO)),
            "properties": [f"{k}={v}" for k, v in self.properties],
            "environment": sorted(self.env),
            "added_environment": list(ADDED_ENV),
            "unknown_vars": self.unknown,
        }
