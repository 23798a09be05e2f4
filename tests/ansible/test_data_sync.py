"""data_sync on real SSH hosts with real rsync: push, idempotence, repair of a corrupted copy, a transfer
killed mid-way then re-run, a host -> host relay through the controller, and S3 -> host with no secret
in any process's command line or environment while it runs."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from tests.ansible.conftest import REPO
from tests.ansible.conftest import ROLE_PLAYBOOK as ROLE
from tests.conftest import wait_for


def make_tree(root: Path, big_mb: int = 4) -> Path:
    (root / "shards" / "train").mkdir(parents=True)
    for i in range(3):
        (root / "shards" / "train" / f"part-{i}.arrow").write_bytes(os.urandom(big_mb * 2**20 + i))
    (root / "dataset_info.json").write_text('{"rows": 3}\n')
    (root / "state.json").write_text('{"fingerprint": "abc"}\n')
    return root


def digests(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and ".rsync-partial" not in p.parts
    }


def test_push_is_verified_idempotent_and_repairs(bed, provisioned, runner, tmp_path):
    src = make_tree(tmp_path / "data")
    host = bed.hosts["node-a"]
    dest = host.root / "data" / "tokenized"
    inv = bed.inventory(tmp_path / "inv.yml")
    ev = {
        "test_role": "data_sync",
        "data_sync_manifest_dir": str(tmp_path / "manifests"),
        "data_sync_items": [{"name": "tokenized", "src": str(src), "dest": str(dest)}],
    }
    first = runner.run(ROLE, inv, limit="node-a", extravars=ev)
    assert first.ok(), first.stdout[-3000:]
    assert digests(dest) == digests(src)
    second = runner.run(ROLE, inv, limit="node-a", extravars=ev)
    assert second.ok() and second.changed("node-a") == 0, second.changed_tasks()
    # same size, same mtime, other bytes: rsync's quick check would miss it; the manifest does not
    victim = dest / "shards" / "train" / "part-1.arrow"
    st = victim.stat()
    with open(victim, "r+b") as fh:
        fh.seek(1000)
        fh.write(b"\x00" * 64)
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    (dest / "state.json").unlink()
    third = runner.run(ROLE, inv, limit="node-a", extravars=ev)
    assert third.ok(), third.stdout[-3000:]
    before = third.task_results("Check the host's copy against the manifest: tokenized", "node-a")[0][
        "stdout"
    ]
    assert '"missing": ["state.json"]' in before and "shards/train/part-1.arrow" in before
    assert third.changed_tasks("node-a") == ["Copy what is missing or different (resumable): tokenized"]
    assert digests(dest) == digests(src)


def test_transfer_killed_midway_then_rerun_completes(bed, provisioned, tmp_path):
    src = tmp_path / "big"
    src.mkdir()
    size = 128 * 2**20  # at 8 MiB/s: 16 s of transfer, the kill point 4 s in, 12 s of margin after it
    with open(src / "model.safetensors", "wb") as fh:
        fh.writelines(os.urandom(2**20) for _ in range(size // 2**20))
    host = bed.hosts["node-b"]
    dest = host.root / "target"
    inv = bed.inventory(tmp_path / "inv.yml")
    extra = (
        f'{{"test_role": "data_sync", "data_sync_manifest_dir": "{tmp_path}/manifests", '
        f'"data_sync_bwlimit_kbps": 8192, '
        f'"data_sync_items": [{{"name": "target", "src": "{src}", "dest": "{dest}"}}]}}'
    )
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
        "ANSIBLE_HOST_KEY_CHECKING": "True",
    }
    cmd = [
        str(Path(sys.executable).parent / "ansible-playbook"),
        "-i",
        str(inv),
        "-l",
        "node-b",
        "-e",
        extra,
        ROLE,
    ]
    proc = subprocess.Popen(
        cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    partial = dest / ".rsync-partial" / "model.safetensors"
    deadline = time.monotonic() + 240
    landed = 0
    while time.monotonic() < deadline and proc.poll() is None:
        # the receiver writes into a hidden temp name, moved to the partial dir if the transfer dies
        tmp = [p for p in dest.glob(".model.safetensors.*")] + ([partial] if partial.exists() else [])
        landed = max([p.stat().st_size for p in tmp], default=0)
        if landed > size * 0.25:
            break
        time.sleep(0.2)
    assert proc.poll() is None, "the transfer finished before it could be killed"
    # ansible-playbook and everything under it (its workers start rsync in sessions of their own), at once
    tree = psutil.Process(proc.pid).children(recursive=True)
    assert any(p.name() == "rsync" for p in tree), [p.name() for p in tree]
    for p in [psutil.Process(proc.pid), *tree]:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    proc.wait()
    # the remote rsync notices the dead link and keeps what it has in the partial dir: wait for that state
    assert wait_for(
        lambda: partial.exists() and not list(dest.glob(".model.safetensors.*")), timeout=120, every=0.2
    ), list(dest.iterdir())
    kept = partial.stat().st_size
    assert size * 0.15 < kept < size, (kept, size)
    assert not (dest / "model.safetensors").exists()
    r = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stdout[-3000:]
    assert digests(dest) == digests(src)
    # the re-run sent only what was missing: rsync's own count of literal (non-matched) bytes
    literal = [line for line in r.stdout.splitlines() if "Literal data:" in line]
    assert literal, r.stdout[-2000:]
    sent = int(literal[-1].split("Literal data:")[1].split()[0].replace(",", "").strip("'\""))
    assert sent <= size - kept + 2**20, (sent, size, kept)


def test_host_to_host_relay_through_the_controller(bed, provisioned, runner, tmp_path):
    a, b = bed.hosts["node-a"], bed.hosts["node-b"]
    src = make_tree(a.root / "ckpt-src", big_mb=2)
    stage = tmp_path / "stage" / "ckpt"
    dest = b.root / "ckpt-copy"
    inv = bed.inventory(tmp_path / "inv.yml")
    pull = runner.run(
        ROLE,
        inv,
        limit="node-a",
        extravars={
            "test_role": "data_sync",
            "data_sync_items": [{"name": "ckpt", "src": str(src), "dest": str(stage), "direction": "pull"}],
        },
    )
    assert pull.ok(), pull.stdout[-3000:]
    push = runner.run(
        ROLE,
        inv,
        limit="node-b",
        extravars={
            "test_role": "data_sync",
            "data_sync_manifest_dir": str(tmp_path / "manifests"),
            "data_sync_items": [{"name": "ckpt", "src": str(stage), "dest": str(dest)}],
        },
    )
    assert push.ok(), push.stdout[-3000:]
    assert digests(dest) == digests(src)
    assert (a.root / "ckpt-src.manifest.json").is_file()  # the source host's own manifest proves the chain


class SecretWatch(threading.Thread):
    """`ps e` on a test host over and over while a play runs: the command line and environment of every
    process under the host's sshd (what the play runs there; the tests run as root, so every environment
    is readable) and of every process whose command line names `mark` (the copy's destination: the role
    starts the pull in the background, and Ansible's async wrapper leaves it outside sshd's tree), with
    their children: which of them held `secret`, and how often `verb` (`dflash s3 pull`) was seen (proof
    that the watch looked while the pull ran)."""

    def __init__(self, sshd_pid: int, secret: str, verb: str = " s3 pull ", mark: str = ""):
        super().__init__(daemon=True)
        self.verb, self.mark = verb, mark
        self.sshd = psutil.Process(sshd_pid)
        self.secret = secret
        self.leaks: list[str] = []
        self.pulls_seen = 0
        self.done = threading.Event()

    def _watched(self) -> list:
        procs = self.sshd.children(recursive=True)
        if self.mark:
            for proc in psutil.process_iter(["cmdline"]):
                if self.mark in " ".join(proc.info["cmdline"] or []):
                    try:
                        procs += [proc, *proc.children(recursive=True)]
                    except psutil.Error:
                        continue
        return procs

    def run(self) -> None:
        while not self.done.is_set():
            for proc in self._watched():
                try:
                    cmd = " ".join(proc.cmdline())
                    env = proc.environ()
                except psutil.Error:
                    continue  # gone meanwhile
                if self.verb in cmd:
                    self.pulls_seen += 1
                if self.secret in cmd or any(self.secret in v for v in env.values()):
                    self.leaks.append(f"pid {proc.pid}: {cmd[:300]}")
            time.sleep(0.01)

    def __enter__(self) -> "SecretWatch":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.join(timeout=10)


def test_s3_to_host_from_a_real_s3_server(bed, provisioned, runner, rgw, tmp_path):
    """S3 -> host: the folder is uploaded once with `dflash s3 push`; the role has the host pull it from
    radosgw (reached from inside the host's namespace), proven per file; --check moves nothing, a second
    run changes nothing; a prefix without a manifest stops the play. That a damaged file is fetched again
    is the pull's (`dflash s3 pull`, which the role runs): tests/integration/test_s3sync.py proves it."""
    from tests.ansible.conftest import gateway
    from tests.s3servers import TEST_ACCESS_KEY, TEST_SECRET_KEY, s3_env

    src = make_tree(tmp_path / "tok", big_mb=2)
    up = subprocess.run(
        [
            str(Path(sys.executable).parent / "dflash"),
            "s3",
            "push",
            str(src),
            "s3://salvage/data/tok",
            "--endpoint-url",
            rgw.endpoint_url,
            "--no-progress",
        ],
        env=s3_env(),
        capture_output=True,
        text=True,
        check=False,
    )
    assert up.returncode == 0, up.stderr
    host = bed.hosts["node-a"]
    dest = host.root / "data" / "tok"
    inv = bed.inventory(tmp_path / "inv.yml")
    ev = {
        "test_role": "data_sync",
        "dflash_s3_endpoint_url": f"http://{gateway(host)}:{rgw.port}",
        "vault_s3_access_key_id": TEST_ACCESS_KEY,
        "vault_s3_secret_access_key": TEST_SECRET_KEY,
        "data_sync_items": [
            {"name": "tok", "src": "s3://salvage/data/tok", "dest": str(dest), "direction": "s3"}
        ],
    }
    dry = runner.run(ROLE, inv, limit="node-a", extravars=ev, check=True)
    assert dry.ok() and dry.changed("node-a") == 1 and not dest.exists(), dry
    with SecretWatch(host.pid, TEST_SECRET_KEY, mark=str(dest)) as watch:  # `ps` during the pull: no secret
        first = runner.run(ROLE, inv, limit="node-a", extravars=ev)
    assert first.ok(), first
    assert watch.pulls_seen > 0 and not watch.leaks, (watch.pulls_seen, watch.leaks[:5])
    creds = first.task_results("Make the S3 credentials file (0600, on the host): tok", "node-a")[0]["path"]
    assert not Path(creds).exists()  # removed after the pull
    assert digests(dest) == digests(src)
    report = json.loads(
        # the pull runs in the background (its progress printed); its result is collected by watch.yml
        first.task_results("Collect the download's result: tok", "node-a")[0]["stdout"]
    )
    assert report["downloaded"] == 5 and report["present"] == 0, report  # the five files of make_tree
    assert (host.root / "data" / "tok.manifest.json").is_file()
    assert TEST_SECRET_KEY not in first.stdout and TEST_SECRET_KEY not in json.dumps(first.events)
    second = runner.run(ROLE, inv, limit="node-a", extravars=ev)
    assert second.ok() and second.changed("node-a") == 0, second.changed_tasks()

    bad = runner.run(
        ROLE,
        inv,
        limit="node-a",
        extravars={
            **ev,
            "data_sync_items": [
                {
                    "name": "loose",
                    "src": "s3://salvage/nothing-here",
                    "dest": str(host.root / "loose"),
                    "direction": "s3",
                }
            ],
        },
    )
    assert not bad.ok() and "MANIFEST.json does not exist" in json.dumps(bad.failures())
    assert not (host.root / "loose").exists()
