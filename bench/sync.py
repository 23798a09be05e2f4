"""bench/sync.py: the data_sync role's verified copy vs plain rsync, side by side in one run, over real
SSH to a host in a network namespace (tests/ansible/testbed.py; loopback-speed veth), and the bytes
re-sent after a transfer killed at 50 %.

    .venv/bin/python bench/sync.py [--gb 2]          (root: creates and removes a namespace host)

verified = what the role runs: `dflash manifest create --reuse` on the source (its digests cached from an
earlier create, as on a controller that already holds the data), rsync --partial --partial-dir, then
`dflash manifest verify` on the destination. plain = `rsync -a` alone. Goals: throughput ratio
verified/plain >= 0.8; after a kill at 50 %, the re-run sends <= 10 % of the set beyond what was missing.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.ansible import testbed

DFLASH = str(Path(sys.executable).parent / "dflash")


def make_set(root: Path, gb: float) -> int:
    root.mkdir(parents=True)
    total, i = int(gb * 2**30), 0
    per = 256 * 2**20
    while i * per < total:
        with open(root / f"shard-{i:03d}.bin", "wb") as fh:
            fh.writelines(os.urandom(2**22) for _ in range(per // 2**22))
        i += 1
    return i * per


def rsh(bed, host) -> str:
    return f"ssh -p {host.port} {' '.join(bed.ssh_options())}"


def rsync(bed, host, src: Path, dest: str, opts: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["rsync", *opts, "-e", rsh(bed, host), f"{src}/", f"root@{host.addr}:{dest}/"],
        capture_output=True,
        text=True,
        check=True,
    )


def literal(out: str) -> int:
    m = re.search(r"Literal data: ([\d,]+)", out)
    return int(m.group(1).replace(",", "")) if m else -1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=2.0)
    args = ap.parse_args()
    why = testbed.preconditions()
    if why:
        print(f"bench/sync.py: cannot run: {why}")
        return 2
    work = Path(tempfile.mkdtemp(prefix="bench-sync-"))
    bed = testbed.start(work / "bed", names=("bench-host",))
    host = bed.hosts["bench-host"]
    try:
        src = work / "set"
        size = make_set(src, args.gb)
        man = work / "set.manifest.json"
        subprocess.run(
            [DFLASH, "manifest", "create", str(src), "-o", str(man)], check=True, capture_output=True
        )
        role_opts = [
            "-a",
            "--partial",
            "--partial-dir=.rsync-partial",
            "--info=stats2",
            "--exclude=.rsync-partial",
        ]
        rows = []
        for rep in range(2):  # interleaved: plain, verified, plain, verified
            for kind in ("plain", "verified"):
                dest = f"{host.root}/{kind}-{rep}"
                shutil.rmtree(dest, ignore_errors=True)
                subprocess.run(["sync"], check=True)
                t0 = time.monotonic()
                if kind == "plain":
                    rsync(bed, host, src, dest, ["-a"])
                else:
                    subprocess.run(
                        [DFLASH, "manifest", "create", str(src), "-o", str(man), "--reuse"],
                        check=True,
                        capture_output=True,
                    )
                    rsync(bed, host, src, dest, role_opts)
                    v = subprocess.run(
                        [DFLASH, "manifest", "verify", dest, str(man)],
                        capture_output=True,
                        text=True,
                        check=False,
                    )
                    assert v.returncode == 0, v.stdout[-2000:]
                rows.append((kind, time.monotonic() - t0))
                shutil.rmtree(dest, ignore_errors=True)
        plain = sum(t for k, t in rows if k == "plain") / 2
        verified = sum(t for k, t in rows if k == "verified") / 2
        print(
            f"set: {size / 2**30:.2f} GiB in {len(list(src.iterdir()))} files, host {host.addr}:{host.port} "
            "(veth)"
        )
        print(f"plain rsync -a:          {plain:6.2f} s  {size / plain / 2**20:7.1f} MiB/s")
        print(f"verified (role's steps): {verified:6.2f} s  {size / verified / 2**20:7.1f} MiB/s")
        print(f"throughput ratio verified/plain: {plain / verified:.2f}  (goal >= 0.8)")

        # kill at 50 %: one big transfer, SIGKILL when half the set has landed, then re-run
        dest = f"{host.root}/killed"
        p = subprocess.Popen(
            [
                "rsync",
                *role_opts,
                "--bwlimit=200000",
                "-e",
                rsh(bed, host),
                f"{src}/",
                f"root@{host.addr}:{dest}/",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        while p.poll() is None:
            landed = (
                sum(f.stat().st_size for f in Path(dest).rglob("*") if f.is_file())
                if Path(dest).exists()
                else 0
            )
            if landed >= size / 2:
                break
            time.sleep(0.05)
        p.send_signal(signal.SIGKILL)
        p.wait()
        time.sleep(1.0)
        kept = sum(f.stat().st_size for f in Path(dest).rglob("*") if f.is_file())
        r = rsync(bed, host, src, dest, role_opts)
        sent = literal(r.stdout)
        extra = sent - (size - kept)
        v = subprocess.run(
            [DFLASH, "manifest", "verify", dest, str(man)], capture_output=True, text=True, check=False
        )
        print(
            f"killed at {kept / size:.0%} landed; re-run sent {sent / 2**20:.1f} MiB of {size / 2**20:.0f} "
            "MiB "
            f"({sent / size:.1%} of the set; beyond what was missing: {max(extra, 0) / size:.1%}, goal <= 10 "
            "%); "
            f"verify after re-run: {'OK' if v.returncode == 0 else 'FAILED'}"
        )
        return 0
    finally:
        bed.close()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
