"""Real S3 servers on 127.0.0.1 for the salvage tests and bench/salvage.py.

- `RadosGW`: a single-node Ceph cluster (one mon speaking msgr v1 with auth none, one OSD on memstore,
  pool size 1) and radosgw's beast frontend, plus a user with fixed test keys (TESTBED.md). It checks
  Content-MD5 (BadDigest) and real multipart/ETag behaviour. ~10-20 s to start; everything lives in
  one temp folder and dies with `stop()`. `kill_gateway()` / `start_gateway()` take the S3 endpoint
  down and up again without touching the stored objects.
- `MotoServer`: moto's threaded server (fast; validates nothing), for cases that need no integrity
  checks from the server.

The keys are test-only constants for these throwaway servers, never real credentials.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

import psutil

TEST_ACCESS_KEY = "SALVAGETESTACCESS001"
TEST_SECRET_KEY = "salvage-test-secret-0000000000000000000000"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PortTaken(RuntimeError):
    """radosgw exited because its port was taken (EADDRINUSE, its exit status)."""


def have_radosgw() -> bool:
    return all(
        shutil.which(x) for x in ("ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "monmaptool", "ceph")
    )


def s3_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a subprocess that talks to the test servers (standard AWS variables)."""
    env = dict(base if base is not None else os.environ)
    for k in list(env):
        if k.startswith("AWS_"):
            del env[k]
    env.update(
        AWS_ACCESS_KEY_ID=TEST_ACCESS_KEY,
        AWS_SECRET_ACCESS_KEY=TEST_SECRET_KEY,
        AWS_DEFAULT_REGION="us-east-1",
        AWS_CONFIG_FILE="/dev/null",
        AWS_SHARED_CREDENTIALS_FILE="/dev/null",
    )
    return env


def client(endpoint_url: str):
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        aws_access_key_id=TEST_ACCESS_KEY,
        aws_secret_access_key=TEST_SECRET_KEY,
        region_name="us-east-1",
        config=Config(
            s3={"addressing_style": "path"},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        ),
    )


class RadosGW:
    def __init__(
        self, root: Path | None = None, memstore_bytes: int = 3 * 2**30, also_listen: tuple[str, ...] = ()
    ):
        """also_listen: more local addresses for the S3 endpoint (e.g. the controller side of a test
        host's veth link, so that a host in its network namespace reaches the same port)."""
        self.root = Path(root or tempfile.mkdtemp(prefix="dflash-rgw-"))
        self.mon_port = free_port()
        self.port = free_port()
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self.conf = self.root / "ceph.conf"
        self.memstore_bytes = memstore_bytes
        self.also_listen = also_listen
        self.gateway: subprocess.Popen | None = None
        self._daemons: list[int] = []

    def _ceph(self, *args: str, timeout: float = 60) -> str:
        res = subprocess.run(
            [args[0], "-c", str(self.conf), *args[1:]],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if res.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({res.returncode}): {res.stderr[-2000:]}")
        return res.stdout

    def _retry(self, *args: str, tries: int = 40) -> str:
        for i in range(tries):
            try:
                return self._ceph(*args)
            except RuntimeError:
                if i == tries - 1:
                    raise
                time.sleep(0.5)
        raise AssertionError("unreachable")

    def start(self) -> RadosGW:
        r = self.root
        for d in ("run", "log", "mon", "osd/ceph-0", "rgw"):
            (r / d).mkdir(parents=True, exist_ok=True)
        fsid = str(uuid.uuid4())
        self.conf.write_text(f"""[global]
fsid = {fsid}
mon host = v1:127.0.0.1:{self.mon_port}
mon initial members = a
auth cluster required = none
auth service required = none
auth client required = none
ms bind msgr2 = false
ms bind ipv6 = false
public addr = 127.0.0.1
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd crush chooseleaf type = 0
mon allow pool size one = true
mon max pg per osd = 1000
mon warn on pool no redundancy = false
mon data avail warn = 1
mon data avail crit = 0
osd objectstore = memstore
memstore device bytes = {self.memstore_bytes}
run dir = {r}/run
admin socket = {r}/run/$name.asok
pid file = {r}/run/$name.pid
log file = {r}/log/$name.log
mon data = {r}/mon/$cluster-$id
osd data = {r}/osd/$cluster-$id
keyring = /dev/null
[client.rgw]
{self._frontends()}
rgw data = {r}/rgw
rgw enable usage log = false
""")
        subprocess.run(
            [
                "monmaptool",
                "--create",
                "--addv",
                "a",
                f"[v1:127.0.0.1:{self.mon_port}]",
                "--fsid",
                fsid,
                str(r / "monmap"),
            ],
            check=True,
            capture_output=True,
        )
        self._ceph("ceph-mon", "--mkfs", "-i", "a", "--monmap", str(r / "monmap"))
        self._ceph("ceph-mon", "-i", "a")
        # A command sent before the new mon has won its election comes back "wrong fsid": retry.
        self._retry("ceph", "osd", "create")
        self._ceph("ceph-osd", "-i", "0", "--mkfs")
        self._retry("ceph-osd", "-i", "0")
        for attempt in range(3):
            try:
                self.start_gateway()
                break
            except PortTaken:
                # free_port() let the port go before radosgw bound it: another lane's server (or anything)
                # took it in between. A new port (the cluster keeps its objects; only the endpoint moves)
                if attempt == 2:
                    raise
                self._move_gateway(free_port())
        self._ceph(
            "radosgw-admin",
            "-n",
            "client.admin",
            "user",
            "create",
            "--uid=salvage-test",
            "--display-name=salvage test",
            f"--access-key={TEST_ACCESS_KEY}",
            f"--secret-key={TEST_SECRET_KEY}",
        )
        return self

    def start_gateway(self, timeout: float = 90) -> None:
        """radosgw in the foreground (-f) as our child, so it can be killed and started again."""
        log = open(self.root / "log" / "radosgw.stdout", "ab")  # noqa: SIM115 - lives as long as the process
        self.gateway = subprocess.Popen(
            ["radosgw", "-f", "-c", str(self.conf), "-n", "client.rgw"], stdout=log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.gateway.poll() is not None:
                error = PortTaken if self.gateway.returncode == errno.EADDRINUSE else RuntimeError
                raise error(f"radosgw exited ({self.gateway.returncode}); see {self.root}/log/")
            try:
                urllib.request.urlopen(self.endpoint_url, timeout=2)
                return
            except urllib.error.HTTPError:
                return  # it answers (403 without credentials): up
            except OSError:
                time.sleep(0.3)
        raise RuntimeError(f"radosgw did not answer on {self.endpoint_url} within {timeout}s")

    def _frontends(self) -> str:
        return "rgw frontends = beast" + "".join(
            f" endpoint={a}:{self.port}" for a in ("127.0.0.1", *self.also_listen)
        )

    def _move_gateway(self, port: int) -> None:
        """The S3 endpoint on another port (the conf's frontends line and endpoint_url)."""
        self.port = port
        self.endpoint_url = f"http://127.0.0.1:{port}"
        text = self.conf.read_text()
        self.conf.write_text(re.sub(r"(?m)^rgw frontends = .*$", self._frontends(), text))

    def kill_gateway(self) -> None:
        """SIGKILL the S3 endpoint (the cluster and its objects stay)."""
        if self.gateway is not None and self.gateway.poll() is None:
            self.gateway.kill()
            self.gateway.wait()

    def stop(self) -> None:
        self.kill_gateway()
        for name in ("osd.0", "mon.a"):
            pidfile = self.root / "run" / f"{name}.pid"
            if pidfile.is_file():
                try:
                    pid = int(pidfile.read_text().strip())
                    os.kill(pid, signal.SIGTERM)
                    for _ in range(100):
                        if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                            break  # exited; PID 1 here may never reap daemonized children
                        time.sleep(0.1)
                    else:
                        os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, ValueError, psutil.NoSuchProcess):
                    pass
        shutil.rmtree(self.root, ignore_errors=True)


class MotoServer:
    def __init__(self):
        self.server = None
        self.endpoint_url = ""

    def start(self) -> MotoServer:
        from moto.server import ThreadedMotoServer

        port = free_port()
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        self.server.start()
        self.endpoint_url = f"http://127.0.0.1:{port}"
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
