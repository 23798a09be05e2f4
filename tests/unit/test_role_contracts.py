"""What the Ansible roles and the Python package must agree on, checked on the files: the trainer's exit
codes (trainer.errors.ExitCode) as the roles name them, the GPU facts gate, one pin per version, and
argument specs that document every default."""

from __future__ import annotations

import os
import re
import subprocess
import sys
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
FACTS_ROLES = ("nvidia_driver", "cuda_toolkit", "trainer_service")


def load(path: Path):
    return yaml.safe_load(path.read_text())


def role_files(role: str, *suffixes: str) -> list[Path]:
    return sorted(p for p in (ROLES / role).rglob("*") if p.is_file() and p.suffix in suffixes)


# The tests that run each role for real (SSH test hosts, the systemd container, the bare rented-node
# container), each with a second run that changes nothing. One proof per behaviour: the roles' molecule
# scenarios repeated these runs on the same hosts and were removed (docs/provision.md, "Testing a role").
ROLE_PROOFS = {
    "gpu_facts": ("test_recon.py", "test_runbook_page.py"),
    "prerequisites": ("test_runbook_page.py",),
    "nvidia_driver": ("test_runbook_page.py",),
    "cuda_toolkit": ("test_runbook_page.py",),
    "python_env": ("test_python_env.py", "test_runbook_page.py"),  # and the systemd_host fixture
    "data_sync": ("test_data_sync.py", "test_data_sync_hub.py"),
    "trainer_service": ("test_trainer_service.py", "test_systemd_host.py", "test_runbook_page.py"),
    "monitor": ("test_runbook_page.py",),
    "salvage": ("test_salvage_role.py", "test_runbook_page.py", "test_train_nodes_playbook.py"),
    "regenerate_job": ("test_runbook_page.py",),
}


def _roles_of_role(role: str, seen: set[str]) -> set[str]:
    if role in seen:
        return set()
    seen.add(role)
    meta = load(ROLES / role / "meta" / "main.yml") or {}
    for dep in meta.get("dependencies") or []:
        _roles_of_role(dep["role"] if isinstance(dep, dict) else dep, seen)
    return seen


def _roles_of_playbook(path: Path) -> set[str]:
    """Every role a playbook runs: its plays' roles, the roles its tasks include by a literal name, the
    playbooks it imports, and each role's meta dependencies."""
    found: set[str] = set()
    for play in load(path):
        if "ansible.builtin.import_playbook" in play:
            found |= _roles_of_playbook(path.parent / play["ansible.builtin.import_playbook"])
            continue
        for entry in play.get("roles") or []:
            found |= _roles_of_role(entry["role"] if isinstance(entry, dict) else entry, set())
        for section in ("pre_tasks", "tasks", "post_tasks"):
            for task in play.get(section) or []:
                name = (
                    task.get("ansible.builtin.include_role") or task.get("ansible.builtin.import_role") or {}
                )
                if "{{" not in name.get("name", "{{"):
                    found |= _roles_of_role(name["name"], set())
    return found


def roles_run_by(test: Path) -> set[str]:
    """The roles a test under tests/ansible/ runs: the playbooks it hands the runner, and the roles it
    runs alone through tests/ansible/playbooks/role.yml (`"test_role": "NAME"`)."""
    text = test.read_text()
    found: set[str] = set()
    for book in re.findall(r'runner\.run\(\s*"(\w+\.yml)"', text):
        found |= _roles_of_playbook(REPO / "playbooks" / book)
    for role in re.findall(r'"test_role": "(\w+)"', text):
        found |= _roles_of_role(role, set())
    if "runbook_page" in text:  # the page is the test: the playbooks its commands run
        page = (REPO / "docs" / "node-to-drafter.md").read_text()
        for book in re.findall(r"ansible-playbook playbooks/(\w+\.yml)", page):
            found |= _roles_of_playbook(REPO / "playbooks" / book)
    return found


def test_every_role_is_run_for_real_by_the_tests_that_prove_it():
    assert set(ROLE_PROOFS) == set(ROLE_NAMES), set(ROLE_PROOFS) ^ set(ROLE_NAMES)
    assert not list(ROLES.glob("*/molecule")), "a scenario would run a role a second time"
    for role, tests in ROLE_PROOFS.items():
        for name in tests:
            assert role in roles_run_by(REPO / "tests" / "ansible" / name), (role, name)
        # at least one of them runs it a second time and asserts that nothing changed
        assert any(
            re.search(r"\.changed\([^)]*\) == 0", (REPO / "tests" / "ansible" / n).read_text()) for n in tests
        ), role


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
    "trainer_service": r"trainer_service_(?:preflight|status|plan)",
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
    recursively from the role's defaults/ and vars/ and `values`; Jinja's own filters and Ansible's
    `combine`), its result parsed as Ansible parses a template's result (a list or dict literal becomes
    one)."""
    import ast

    import jinja2
    from ansible.plugins.filter.core import (
        combine,
        dict_to_list_of_dict_key_value_elements,
        extract,
        list_of_dict_key_value_elements_to_dict,
        regex_replace,
        to_bool,
        to_json,
    )
    from jinja2 import meta

    # a one-host play unless `values` says otherwise (what Ansible itself would define)
    play = {"inventory_hostname": "node-0", "ansible_play_hosts_all": ["node-0"],
            "hostvars": {"node-0": {"ansible_host": "10.0.0.1"}}}  # fmt: skip
    known = {
        **play,
        **load(ROLES / role / "defaults/main.yml"),
        **load(ROLES / role / "vars/main.yml"),
        **values,
    }

    class ChainedUndefined(jinja2.StrictUndefined):
        """Ansible's: `a.b.c | default(x)` with `a` undefined is x; any other use of it still fails."""

        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return self

        __getitem__ = __getattr__

    env = jinja2.Environment(undefined=ChainedUndefined)
    env.filters.update(combine=combine, extract=extract, regex_replace=regex_replace, bool=to_bool)
    env.filters.update(to_json=to_json, dict2items=dict_to_list_of_dict_key_value_elements,
                       items2dict=list_of_dict_key_value_elements_to_dict)  # fmt: skip

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
        "trainer_service_sandbox": {"local_addr": "127.0.0.1"},
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


def test_a_multi_node_group_runs_torchrun_with_a_c10d_rendezvous_on_its_first_node():
    """dflash_nodes 2: each host's unit runs torchrun with its node rank (its place in the play), the first
    host's address as the rendezvous, torchrun's restarts, and the other node allowed through systemd's
    address filter; one node stays --standalone behind a loopback-only filter."""
    hosts = {"gpu-a": {"ansible_host": "10.9.0.11"}, "gpu-b": {"ansible_host": "10.9.0.12"}}
    values = {
        "dflash_root": "/opt/dflash",
        "dflash_nodes": 2,
        "trainer_service_layout": {"data_parallel": 8},
        "trainer_service_run_config": {"train": {"stop_timeout_s": 900}},
        "ansible_play_hosts_all": ["gpu-a", "gpu-b"],
        "hostvars": hosts,
        "trainer_service_socket_ifname": "ens5",
    }
    from trainer.layout.sandbox import decide

    ens5 = [
        {"device": "ens5", "ipv4": {"address": a["ansible_host"], "netmask": "255.255.255.0"}}
        for a in hosts.values()
    ]
    for rank, host in enumerate(hosts):
        # the role's argv for `dflash service sandbox`, and that verb's decision (its real code) for this host
        args = render_role_var(
            "trainer_service",
            "trainer_service_sandbox_args",
            {**values, "inventory_hostname": host, "ansible_local": {"dflash": {"gpus": {"count": 8}}},
             "ansible_facts": {"interfaces": ["ens5"], "ens5": ens5[rank]}},
        )  # fmt: skip
        assert args[args.index("--node-rank") + 1] == str(rank)
        assert [a for a in args if a.startswith("--node-address=")] == [
            "--node-address=10.9.0.11",
            "--node-address=10.9.0.12",
        ]
        sandbox = decide(
            {"gpus": {"count": 8}},
            {},
            node_rank=rank,
            node_addresses=["10.9.0.11", "10.9.0.12"],
            interfaces=[ens5[rank]],
            socket_ifname="ens5",
        )
        values["trainer_service_sandbox"] = sandbox
        argv = render_role_var(
            "trainer_service", "trainer_service_exec", {**values, "inventory_hostname": host}
        )
        assert argv[0].endswith("/bin/torchrun") and "--standalone" not in argv
        want = ["--nnodes=2", f"--node-rank={rank}", "--rdzv-backend=c10d", "--rdzv-endpoint=10.9.0.11:29400"]
        want += ["--rdzv-id=main", "--max-restarts=3", "--nproc-per-node=8"]
        want += [f"--rdzv-conf=is_host={1 - rank}", f"--local-addr={hosts[host]['ansible_host']}"]
        assert [f for f in want if f not in argv] == [], argv
        assert argv[argv.index("-m") + 1 :] == [
            "trainer.cli",
            "train",
            "--config",
            "/opt/dflash/runs/main/config.yaml",
        ]
        env = render_role_var(
            "trainer_service", "trainer_service_env_all", {**values, "inventory_hostname": host}
        )
        assert env["DFLASH_NODE_RANK"] == str(rank) and env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert sandbox["ip_allow"] == ["localhost", "10.9.0.11", "10.9.0.12", "10.9.0.0/24"]
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "ens5"
    one = {k: v for k, v in values.items() if k not in ("dflash_nodes", "trainer_service_socket_ifname")}
    one["inventory_hostname"] = "gpu-b"
    one["trainer_service_sandbox"] = decide({"gpus": {"count": 8}}, {})
    argv = render_role_var("trainer_service", "trainer_service_exec", one)
    # one node: torchrun's store and MASTER_ADDR on loopback (not the host's FQDN), behind a loopback filter
    assert "--standalone" in argv and "--local-addr=127.0.0.1" in argv
    assert not any(a.startswith("--nnodes") for a in argv)
    assert one["trainer_service_sandbox"]["ip_allow"] == ["localhost"]
    env = render_role_var("trainer_service", "trainer_service_env_all", one)
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "lo" and "DFLASH_NODE_RANK" not in env


def test_a_node_the_plan_splits_gets_a_vllm_source_and_trainers_on_the_other_gpus():
    """The seeds' recipe on 8 x A100-40GB: the role hands `dflash plan` the run config on stdin (no knob of
    its own); the plan (its real JSON) puts the target in a vLLM server on GPUs 2-7, and the run config the
    role renders carries what the plan decided (its `apply`): the split, train.shard and train.device cuda."""
    import json
    import subprocess
    import sys

    seeds = load(REPO / "tests" / "fixtures" / "runs" / "seeds-qwen36-27b.yaml")
    run_config = {k: v for k, v in seeds.items() if k != "out_dir"}
    values = {"dflash_root": "/opt/dflash", "dflash_repo": "/repo", "trainer_service_run_config": run_config,
              "trainer_service_target_config": "/models/Qwen3.6-27B/config.json"}  # fmt: skip
    args = render_role_var("trainer_service", "trainer_service_plan_args", values)
    assert args == ["plan", "--json", "--config", "-", "--nodes", "1",
                    "--facts=/repo/reports/node-0/recon.json",
                    "--target-config", "/models/Qwen3.6-27B/config.json"]  # fmt: skip
    plan_config = render_role_var("trainer_service", "trainer_service_plan_config", values)
    assert plan_config == {**run_config, "out_dir": "/opt/dflash/runs/main/out"}
    target = REPO / "tests" / "fixtures" / "targets" / "qwen3.6-27b"
    plan = subprocess.run(
        [sys.executable, "-m", "trainer.cli", *args[:6], "--target-config", str(target), "--gpu", "A100-40GB",
         "--gpu-count", "8"],
        input=yaml.safe_dump(plan_config), capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    values["trainer_service_layout"] = json.loads(plan)
    values["trainer_service_sandbox"] = {"local_addr": "127.0.0.1"}  # (test_sandbox.py: its decision)
    rendered = render_role_var("trainer_service", "trainer_service_rendered_config", values)
    assert rendered["target"] == {
        **run_config["target"],
        "gpus_per_copy": 1,
        "source": "vllm",
        "vllm": {"tensor_parallel_size": 2, "data_parallel_size": 3, "gpus": [2, 3, 4, 5, 6, 7]},
    }
    assert rendered["train"] == {**run_config["train"], "shard": "full", "device": "cuda"}
    assert rendered["drafter"] == run_config["drafter"] and rendered["out_dir"] == "/opt/dflash/runs/main/out"
    assert "--nproc-per-node=2" in render_role_var("trainer_service", "trainer_service_exec", values)
    cpu = {**values, "trainer_service_layout": {"gpus_per_copy": 1, "data_parallel": 1, "apply": {}}}
    assert render_role_var("trainer_service", "trainer_service_rendered_config", cpu) == plan_config
    pinned = {**values, "trainer_service_gpus_per_copy": 4}
    assert render_role_var("trainer_service", "trainer_service_plan_config", pinned)["target"] == {
        **run_config["target"],
        "gpus_per_copy": 4,
    }


def test_the_role_hands_the_plan_the_run_config_and_no_knob_of_its_own():
    """One home: the plan task passes `--config -` with the run config on stdin; no recipe flag appears in
    the role, and a GPU host without a target config to plan with is refused by name before any unit."""
    tasks = (ROLES / "trainer_service" / "tasks" / "main.yml").read_text()
    role = tasks + (ROLES / "trainer_service" / "vars" / "main.yml").read_text()
    assert "trainer_service_plan_knobs" not in role and "trainer_service_target_keys" not in role
    from trainer.layout.inputs import CONFIG_KEYS, flag

    assert [f for f in map(flag, CONFIG_KEYS) if f"'{f}'" in role] == []
    assert 'stdin: "{{ trainer_service_plan_config | to_nice_yaml' in tasks
    refuse = tasks.index("set trainer_service_target_config to a copy of it")
    assert refuse < tasks.index("Plan the layout") < tasks.index("Render the run config")


def _tasks(node):
    """Every task in a task file, blocks opened."""
    for task in node or []:
        yield task
        for key in ("block", "rescue", "always"):
            yield from _tasks(task.get(key))


def test_nothing_is_compressed_on_its_way_to_a_node():
    """What travels (wheels, safetensors, tokenized data) is compressed already or barely compresses: the
    SSH transport (ansible.cfg's ssh_args, as ansible reads it) has no -C, and every synchronize task says
    what it does about rsync's own compression, which is off by default."""
    dump = subprocess.run(
        [str(Path(sys.executable).parent / "ansible-config"), "dump", "-t", "connection", "--only-changed"],
        cwd=REPO,
        env={**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible.cfg")},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    ssh_args = re.search(r"^ssh_args\(\S*ansible\.cfg\) = (.*)$", dump, re.M)
    assert ssh_args, dump
    assert "-C" not in ssh_args.group(1).split() and "ControlPersist=60s" in ssh_args.group(1)
    syncs = []
    for path in ROLES.glob("*/tasks/*.yml"):
        for task in _tasks(load(path)):
            if "ansible.posix.synchronize" in task:
                syncs.append((path.parent.parent.name, task["name"], task["ansible.posix.synchronize"]))
    assert len(syncs) >= 4, syncs
    for role, name, args in syncs:
        compress = args.get("compress")
        assert compress is False or compress == "{{ data_sync_compress }}", (role, name, compress)
    assert load(ROLES / "data_sync" / "defaults" / "main.yml")["data_sync_compress"] is False


@pytest.mark.parametrize(
    "role, name, values",
    [
        (
            "trainer_service",
            "trainer_service_env_all",
            {
                "dflash_root": "/opt/dflash",
                "trainer_service_layout": {"data_parallel": 1},
                "trainer_service_sandbox": {"env": {}, "local_addr": "127.0.0.1"},
            },
        ),
        (
            "regenerate_job",
            "regenerate_job_engine_env_all",
            {"dflash_root": "/opt/dflash", "regenerate_job_gpus": 1},
        ),
    ],
)
def test_the_toolchain_env_outlives_the_play_that_decided_it(role, name, values):
    """trainer_service / regenerate_job in a later ansible-playbook call, without python_env: the
    environment python_env decided comes from the node's local facts (dflash_toolchain.fact); the play's own
    decision wins over what the node kept; neither: nothing."""
    pin = {"TRITON_PTXAS_BLACKWELL_PATH": "/opt/dflash/venv/lib/python3.12/site-packages/triton/ptxas"}
    kept = {"ansible_local": {"dflash": {}, "dflash_toolchain": {"env": pin}}}
    assert (
        render_role_var(role, name, {**values, **kept})["TRITON_PTXAS_BLACKWELL_PATH"]
        == pin["TRITON_PTXAS_BLACKWELL_PATH"]
    )
    now = {**kept, "python_env_toolchain_env": {}}  # this play's python_env: a CUDA 13 driver needs no pin
    assert "TRITON_PTXAS_BLACKWELL_PATH" not in render_role_var(role, name, {**values, **now})
    for nothing in ({}, {"ansible_local": {"dflash": {}}}):
        assert "TRITON_PTXAS_BLACKWELL_PATH" not in render_role_var(role, name, {**values, **nothing})
    # python_env keeps it where these roles load their local facts from
    tasks = load(ROLES / "python_env" / "tasks" / "toolchain.yml")
    (write,) = [t for t in tasks if "ansible.builtin.copy" in t]
    assert write["ansible.builtin.copy"]["dest"] == "{{ python_env_fact_dir }}/dflash_toolchain.fact"
    assert "python_env_toolchain.env" in write["ansible.builtin.copy"]["content"]
    fact_dir = load(ROLES / "python_env" / "defaults" / "main.yml")["python_env_fact_dir"]
    assert fact_dir == "{{ gpu_facts_fact_dir | default('/etc/ansible/facts.d') }}"
    setup = [t for t in load(ROLES / role / "tasks" / "main.yml") if "ansible.builtin.setup" in t]
    assert setup[0]["ansible.builtin.setup"]["fact_path"] == "{{ gpu_facts_fact_dir | default(omit) }}"


def test_a_driver_install_is_followed_by_a_second_probe():
    """A bare node's facts say "no driver yet": after nvidia_driver installs one (and reboots), gpu_facts runs
    again so cuda_toolkit, python_env and the unit decide on the GPUs the driver shows."""
    tasks = load(ROLES / "nvidia_driver" / "tasks" / "main.yml")
    names = [next(k for k in t if k.startswith("ansible.")) for t in tasks]
    install = next(i for i, t in enumerate(tasks) if t.get("register") == "nvidia_driver_install")
    flush = names.index("ansible.builtin.meta")
    (again,) = [i for i, n in enumerate(names) if n == "ansible.builtin.include_role"]
    assert install < flush < again and tasks[again]["ansible.builtin.include_role"]["name"] == "gpu_facts"
    assert "nvidia_driver_install is changed" in tasks[again]["when"]
    assert [p["roles"] for p in load(REPO / "playbooks" / "provision.yml")][0][:2] == [
        {"role": "gpu_facts"},
        {"role": "nvidia_driver"},
    ]


def test_an_s3_items_allow_locations_reach_dflash_s3_pull():
    """A salvage set pushed with --reference is pulled by the role only with the item's allow_locations
    (`dflash s3 pull` refuses reads outside the set's prefix otherwise)."""
    item = {"name": "ds", "src": "s3://b/set", "dest": "/opt/x", "direction": "s3",
            "allow_locations": ["s3://b/earlier", "s3://c/other"]}  # fmt: skip
    args = render_role_var("data_sync", "data_sync_allow_location_args", {"data_sync_item": item})
    assert args == ["--allow-location=s3://b/earlier", "--allow-location=s3://c/other"]
    item.pop("allow_locations")
    assert render_role_var("data_sync", "data_sync_allow_location_args", {"data_sync_item": item}) == []
    task = (ROLES / "data_sync" / "tasks" / "s3.yml").read_text()
    assert "+ data_sync_allow_location_args" in task
