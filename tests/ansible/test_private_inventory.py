"""The home of the user's own settings: `inventory/*.private.yml` (git-ignored), read with
inventory/hosts.yml because ansible.cfg names the folder. Host vars there beat the tracked
group_vars/<group>.yml; group vars there fill what group_vars/ leaves unset (`a100_form_factor`) but do not
beat it (docs/provision.md, "Your own settings"). A PCIe A100 is one var, no tracked file edited."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from tests.ansible.conftest import REPO, ansible_cli

PRIVATE = """
all:
  children:
    a100:
      vars:
        a100_form_factor: pcie       # fills what group_vars/a100.yml leaves unset
        expected_gpu_count: 2        # group_vars/a100.yml sets it: this one loses
      hosts:
        my-a100:
          ansible_host: 192.0.2.10
          ansible_port: 14085
          ansible_user: root
          expected_gpu_memory_gib: 79  # a host var: beats group_vars/a100.yml's 39
"""


def inventory_copy(tmp_path: Path) -> Path:
    inv = tmp_path / "inventory"
    shutil.copytree(REPO / "inventory", inv, ignore=shutil.ignore_patterns("*.private.yml", "vault.yml"))
    (inv / "nodes.private.yml").write_text(PRIVATE)
    return inv


def test_a_private_files_vars_are_picked_up_and_a_pcie_a100_is_one_var(tmp_path):
    inv = inventory_copy(tmp_path)
    r = ansible_cli("ansible-inventory", "-i", str(inv), "--host", "my-a100")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert (got["ansible_host"], got["ansible_port"], got["ansible_user"]) == ("192.0.2.10", 14085, "root")
    assert got["a100_form_factor"] == "pcie", "a group var of the private file, unset in group_vars/"
    assert got["expected_gpu_memory_gib"] == 79, "a host var of the private file beats group_vars/a100.yml"
    assert got["expected_gpu_count"] == 8, "group_vars/a100.yml beats the private file's group vars"
    r = ansible_cli("ansible-inventory", "-i", str(inv), "--graph", "a100")
    assert "my-a100" in r.stdout
    # what recon compares the node with, templated as a play sees it (debug runs on the controller)
    r = ansible_cli(
        "ansible", "-i", str(inv), "my-a100", "-m", "ansible.builtin.debug", "-a", "var=expected_gpu_model"
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "expected_gpu_model: NVIDIA A100-PCIE-40GB" in r.stdout
    (inv / "nodes.private.yml").write_text(
        PRIVATE.replace("a100_form_factor: pcie", "a100_form_factor: sxm4")
    )
    r = ansible_cli(
        "ansible", "-i", str(inv), "my-a100", "-m", "ansible.builtin.debug", "-a", "var=expected_gpu_model"
    )
    assert "expected_gpu_model: NVIDIA A100-SXM4-40GB" in r.stdout, r.stdout


def test_private_inventory_files_are_git_ignored():
    r = subprocess.run(
        ["git", "check-ignore", "--no-index", "inventory/nodes.private.yml", "inventory/group_vars/a100.yml"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.stdout.split() == ["inventory/nodes.private.yml"]
