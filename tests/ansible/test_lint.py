"""ansible-lint (production profile, offline) and --syntax-check on every playbook: 0 findings."""

import os
import subprocess
import sys
from pathlib import Path

from tests.ansible.conftest import REPO

BIN = Path(sys.executable).parent
ENV = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "ANSIBLE_CONFIG": str(REPO / "ansible.cfg")}
PLAYBOOKS = sorted(p.name for p in (REPO / "playbooks").glob("*.yml"))


def test_every_playbook_passes_syntax_check():
    assert {"recon.yml", "provision.yml", "train.yml"} <= set(PLAYBOOKS)
    for name in PLAYBOOKS:
        r = subprocess.run(
            [str(BIN / "ansible-playbook"), "--syntax-check", f"playbooks/{name}"],
            cwd=REPO,
            env=ENV,
            capture_output=True,
            text=True,
            check=False,
        )
        assert r.returncode == 0, (name, r.stderr[-2000:])


def test_ansible_lint_production_profile_has_no_findings():
    # every role and the playbook the tests run one role with
    roles = [f"roles/{p.name}" for p in sorted((REPO / "roles").iterdir()) if (p / "tasks").is_dir()] + [
        "tests/ansible/playbooks"
    ]
    assert len(roles) >= 10, roles
    r = subprocess.run(
        [
            str(BIN / "ansible-lint"),
            "--offline",
            "--profile",
            "production",
            "--format",
            "pep8",
            "--nocolor",
            *(f"playbooks/{name}" for name in PLAYBOOKS),
            *roles,
        ],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "0 failure(s), 0 warning(s)" in r.stderr + r.stdout
