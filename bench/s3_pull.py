"""bench/s3_pull.py: the data_sync role's S3 -> host copy (`dflash s3 pull`) vs a plain boto3 download,
side by side in one run, from a real S3 server (Ceph radosgw on 127.0.0.1, tests/s3servers.py), and the
bytes fetched again after a pull killed at 50 %.

    .venv/bin/python bench/s3_pull.py [--gb 1]     (root; Debian's ceph packages, scripts/setup-system)

verified = `dflash s3 pull` into an empty folder: manifest read, object sizes checked, each file into
`.s3-partial/`, hashed, renamed. plain = boto3's `download_file` of every object (the transfer manager,
the same worker count), no hashing. Goals (the same as for rsync in bench/sync.py): throughput
ratio verified/plain >= 0.8; after a kill at 50 %, the re-run fetches <= 10 % of the set beyond what was
missing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.s3servers import RadosGW, client, s3_env

DFLASH = str(Path(sys.executable).parent / "dflash")
WORKERS = 4


def make_set(root: Path, gb: float) -> int:
    root.mkdir(parents=True)
    total, i, per = int(gb * 2**30), 0, 128 * 2**20
    while i * per < total:
        with open(root / f"shard-{i:03d}.bin", "wb") as fh:
            fh.writelines(os.urandom(2**22) for _ in range(per // 2**22))
        i += 1
    return i * per


def pull(url: str, dest: Path, endpoint: str, *extra: str) -> dict:
    res = subprocess.run(
        [
            DFLASH,
            "s3",
            "pull",
            url,
            str(dest),
            "--endpoint-url",
            endpoint,
            "--json",
            "--no-progress",
            "--workers",
            str(WORKERS),
            *extra,
        ],
        env=s3_env(),
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(res.stdout)


def plain(s3c, bucket: str, prefix: str, dest: Path) -> None:
    from boto3.s3.transfer import TransferConfig

    cfg = TransferConfig(
        max_concurrency=WORKERS, multipart_threshold=16 * 2**20, multipart_chunksize=16 * 2**20
    )
    keys = [o["Key"] for o in s3c.list_objects_v2(Bucket=bucket, Prefix=prefix + "/")["Contents"]]
    dest.mkdir(parents=True)
    for key in keys:
        s3c.download_file(bucket, key, str(dest / key.rsplit("/", 1)[1]), Config=cfg)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=1.0)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-s3pull-"))
    rgw = RadosGW(memstore_bytes=int((args.gb + 1.5) * 2**30)).start()
    try:
        s3c = client(rgw.endpoint_url)
        s3c.create_bucket(Bucket="bench")
        size = make_set(work / "src", args.gb)
        subprocess.run(
            [
                DFLASH,
                "s3",
                "push",
                str(work / "src"),
                "s3://bench/set",
                "--endpoint-url",
                rgw.endpoint_url,
                "--no-progress",
            ],
            env=s3_env(),
            check=True,
            capture_output=True,
        )
        print(
            f"set: {size / 2**30:.2f} GiB in {len(list((work / 'src').iterdir()))} files, radosgw on "
            "loopback, "
            f"{WORKERS} workers each"
        )
        times = {"plain": [], "verified": []}
        for rnd in range(2):  # alternate, so neither side always runs on a warmer server
            for kind in ("plain", "verified") if rnd == 0 else ("verified", "plain"):
                dest = work / f"{kind}-{rnd}"
                t0 = time.monotonic()
                if kind == "plain":
                    plain(s3c, "bench", "set", dest)
                else:
                    rep = pull("s3://bench/set", dest, rgw.endpoint_url)
                    assert rep["ok"] and rep["downloaded_bytes"] == size, rep
                times[kind].append(time.monotonic() - t0)
                shutil.rmtree(dest)
        p, v = min(times["plain"]), min(times["verified"])
        ratio = (size / v) / (size / p)
        print(f"plain boto3 download_file: {size / p / 2**20:.0f} MiB/s (best of {times['plain']})")
        print(f"dflash s3 pull (verified): {size / v / 2**20:.0f} MiB/s (best of {times['verified']})")
        print(
            f"throughput ratio verified/plain: {ratio:.2f} (goal >= 0.8: "
            f"{'OK' if ratio >= 0.8 else 'MISSED'})"
        )

        # kill at 50 %: a rate cap makes the moment reproducible; the re-run is uncapped
        dest = work / "killed"
        cap_kbps = int(size / 2**10 / 20)  # ~20 s for the whole set
        proc = subprocess.Popen(
            [
                DFLASH,
                "s3",
                "pull",
                "s3://bench/set",
                str(dest),
                "--endpoint-url",
                rgw.endpoint_url,
                "--bwlimit-kbps",
                str(cap_kbps),
                "--workers",
                str(WORKERS),
                "--no-progress",
            ],
            env=s3_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

        def landed() -> int:
            return sum(
                f.stat().st_size for f in dest.rglob("*") if f.is_file() and not f.name.endswith(".etag")
            )

        while proc.poll() is None and landed() < size // 2:
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kept = landed()
        rep = pull("s3://bench/set", dest, rgw.endpoint_url)
        assert rep["ok"], rep
        extra = rep["downloaded_bytes"] - (size - kept)
        share = max(0, extra) / size
        print(
            f"killed at {kept / size:.0%} ({kept} bytes on disk); re-run fetched {rep['downloaded_bytes']} "
            "bytes, "
            f"{rep['resumed_bytes']} resumed from partial files, {rep['present']} files already complete"
        )
        print(
            f"re-sent beyond what was missing: {share:.1%} of the set (goal <= 10 %: "
            f"{'OK' if share <= 0.10 else 'MISSED'})"
        )
    finally:
        rgw.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
