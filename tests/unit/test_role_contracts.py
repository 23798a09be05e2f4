"""What the Ansible roles and the Python package must agree on, checked on the files: the trainer's exit
codes (trainer.errors.ExitCode) as the roles name them, the GPU facts gate, one pin per version, and
argument specs that document every default."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from trainer.errors import ExitCode

REPO = Path(__file__).resolve().parents[2]
ROLES = REPO / "roles"
ROLE_NAMES = sorted(p.name for p in ROLES.iterdir() if (p / "tasks").is_dir())
# Roles that compare the exit codes of the trainer or of `dflash` verbs.
EXIT_CODE_ROLES = ("trainer_service", "salvage", "data_sync")
# Roles whose decisions depend on the host's hardware (they read ansible_local.dflash).
FACTS_ROLES = ("nvidia_driver", "cuda_toolkit", "flash_attn", "trainer_service")


def load(path: Path):
    return yaml.safe_load(path.read_text())


def role_files(role: str, *suffixes: str) -> list[Path]:
    return sorted(
        p
        for p in (ROLES / role).rglob("*")
        if p.is_file() and p.suffix in suffixes and "molecule" not in p.parts
    )


def test_the_roles_exist():
    assert set(EXIT_CODE_ROLES) | set(FACTS_ROLES) | {"gpu_facts", "python_env"} <= set(ROLE_NAMES)


@pytest.mark.parametrize("role", EXIT_CODE_ROLES)
def test_role_exit_codes_are_the_trainers(role):
    named = load(ROLES / role / "vars" / "main.yml")[f"{role}_exit_codes"]
    assert named == {m.name.lower(): m.value for m in ExitCode}


# Registered results of `dflash` commands, per role (their `rc` is an ExitCode).
DFLASH_RESULTS = {
    "salvage": r"_salvage_\w+",
    "data_sync": r"data_sync_\w+",
    "trainer_service": r"trainer_service_(?:preflight|status)",
}


@pytest.mark.parametrize("role", EXIT_CODE_ROLES)
def test_roles_compare_exit_codes_by_name(role):
    """No dflash `rc` compared with a bare number (`.rc == 0`, `.rc not in [0, 1]`, `.rc | default(2)`)."""
    bare = re.compile(rf"\b{DFLASH_RESULTS[role]}\.rc\b[^\n]*?(?:[=!]=\s*\d|in\s*\[\s*\d|default\(\s*\d)")
    named = re.compile(rf"\b{DFLASH_RESULTS[role]}\.rc\b[^\n]*{role}_exit_codes\.")
    files = role_files(role, ".yml")
    assert any(named.search(path.read_text()) for path in files), role
    for path in files:
        hits = [line.strip() for line in path.read_text().splitlines() if bare.search(line)]
        assert not hits, (path.relative_to(REPO), hits)


def test_service_templates_take_the_exit_codes_from_the_role():
    unit = (ROLES / "trainer_service/templates/dflash-train.service.j2").read_text()
    program = (ROLES / "trainer_service/templates/program.conf.j2").read_text()
    assert "RestartPreventExitStatus={{ trainer_service_exit_codes.refused }}" in unit.splitlines()
    assert (
        "exitcodes={{ trainer_service_exit_codes.ok }},{{ trainer_service_exit_codes.refused }}"
        in program.splitlines()
    )
    for text in (unit, program):
        assert not re.search(
            r"^(RestartPreventExitStatus|SuccessExitStatus|exitcodes)=\s*\d", text, re.MULTILINE
        )


@pytest.mark.parametrize("role", FACTS_ROLES)
def test_hardware_roles_gate_on_the_gpu_facts(role):
    tasks = load(ROLES / role / "tasks" / "main.yml")
    setup = [i for i, t in enumerate(tasks) if "ansible.builtin.setup" in t]
    gate = [
        i
        for i, t in enumerate(tasks)
        if "ansible.builtin.assert" in t
        and "ansible_local.dflash" in str(t["ansible.builtin.assert"]["that"])
    ]
    assert setup and gate and setup[0] < gate[0], role
    assert (
        "run the gpu_facts role (playbooks/recon.yml) first"
        in tasks[gate[0]]["ansible.builtin.assert"]["fail_msg"]
    )
    # nothing that could run before the gate reads the facts
    assert not any("ansible_local" in str(t) for t in tasks[: setup[0]])


def test_no_role_falls_back_to_a_gpu_count():
    """The GPU count comes from ansible_local.dflash or the role stops: never `| default(0)`."""
    for role in ROLE_NAMES:
        for path in role_files(role, ".yml", ".j2"):
            text = path.read_text()
            assert "gpu_facts_recon" not in text or role == "gpu_facts", path.relative_to(REPO)
            assert not re.search(r"gpus\.count\s*\|\s*default", text), path.relative_to(REPO)


def test_gpu_facts_loads_the_facts_it_writes():
    tasks = load(ROLES / "gpu_facts" / "tasks" / "main.yml")
    write = next(
        i
        for i, t in enumerate(tasks)
        if str(t.get("ansible.builtin.copy", {}).get("dest", "")).endswith("/dflash.fact")
    )
    load_back = [t for t in tasks[write + 1 :] if "ansible.builtin.setup" in t]
    assert load_back and load_back[0]["ansible.builtin.setup"]["fact_path"] == "{{ gpu_facts_fact_dir }}"


@pytest.mark.parametrize(
    "role, key, package",
    [
        ("python_env", "python_env_uv_version", "uv"),
        ("trainer_service", "trainer_service_supervisor_version", "supervisor"),
    ],
)
def test_each_version_is_pinned_once(role, key, package):
    version = load(ROLES / role / "defaults" / "main.yml")[key]
    assert re.fullmatch(r"\d+(\.\d+)+", version), version
    # the role's defaults and its argument spec (documentation of that default, checked below) only
    allowed = {ROLES / role / "defaults" / "main.yml", ROLES / role / "meta" / "argument_specs.yml"}
    pinned = re.compile(rf"(?<![\d.]){re.escape(version)}(?![\d.])")
    for base in ("roles", "playbooks", "inventory", "scripts"):
        for path in (REPO / base).rglob("*"):
            if path.is_file() and path not in allowed and path.suffix not in (".png", ".svg"):
                assert not pinned.search(path.read_text(errors="replace")), (
                    path.relative_to(REPO),
                    package,
                    version,
                )
    # scripts/wheel-cache reads it from that file
    assert f"role_default {role} {key}" in (REPO / "scripts" / "wheel-cache").read_text()


@pytest.mark.parametrize("role", ROLE_NAMES)
def test_argument_specs_document_every_default(role):
    defaults = load(ROLES / role / "defaults" / "main.yml") or {}
    options = load(ROLES / role / "meta" / "argument_specs.yml")["argument_specs"]["main"]["options"]
    assert set(defaults) <= set(options), set(defaults) - set(options)
    for key, value in defaults.items():
        assert options[key].get("default") == value, (key, value, options[key].get("default"))
        assert options[key].get("description"), key


def test_no_issue_numbers_in_roles_playbooks_inventory():
    ref = re.compile(r"\bissues?\s*#?\d+|(?<![\w&])#\d+\b", re.IGNORECASE)
    for base in ("roles", "playbooks", "inventory"):
        for path in (REPO / base).rglob("*"):
            if path.is_file():
                hits = [
                    line.strip() for line in path.read_text(errors="replace").splitlines() if ref.search(line)
                ]
                assert not hits, (path.relative_to(REPO), hits)


def render_role_var(role: str, name: str, values: dict) -> object:
    """A role variable rendered with Jinja2 the way Ansible would (the variables it names resolved
    recursively from the role's defaults/ and vars/ and `values`; only Jinja's own filters), its result
    parsed as Ansible parses a template's result (a list or dict literal becomes one)."""
    import ast

    import jinja2
    from jinja2 import meta

    known = {**load(ROLES / role / "defaults/main.yml"), **load(ROLES / role / "vars/main.yml"), **values}
    env = jinja2.Environment(undefined=jinja2.StrictUndefined)

    def value_of(key: str):
        v = known[key]
        if not (isinstance(v, str) and "{{" in v):
            return v
        names = meta.find_undeclared_variables(env.parse(v)) & set(known)
        text = env.from_string(v).render(**{n: value_of(n) for n in names})
        try:
            return ast.literal_eval(text.strip())
        except (ValueError, SyntaxError):
            return text

    return value_of(name)


def test_torchrun_waits_for_the_final_checkpoint_and_the_service_manager_waits_longer():
    """torchrun SIGKILLs its ranks --shutdown-timeout seconds after forwarding SIGTERM (default 30 s): the
    role's launcher must outwait the trainer's stop bound, and systemd/supervisord (stop bound + margin)
    must outwait torchrun."""
    values = {
        "dflash_root": "/opt/dflash",
        "trainer_service_layout": {"data_parallel": 4},
        "trainer_service_run_config": {"train": {"stop_timeout_s": 900}},
    }
    argv = render_role_var("trainer_service", "trainer_service_exec", values)
    assert argv[0].endswith("/bin/torchrun") and "--nproc-per-node=4" in argv
    (flag,) = [a for a in argv if a.startswith("--shutdown-timeout=")]
    shutdown = int(flag.split("=", 1)[1])
    margin = float(render_role_var("trainer_service", "trainer_service_stop_margin_s", values))
    assert 900 < shutdown < 900 + margin
    single = render_role_var(
        "trainer_service", "trainer_service_exec", {**values, "trainer_service_layout": {"data_parallel": 1}}
    )
    assert single[0].endswith("/bin/dflash") and not any(a.startswith("--shutdown") for a in single)
