#!/usr/bin/env python3
"""Salvage upload throughput and the time verification adds, measured side by side (not a CI test).

(a) `dflash salvage push` (boto3 transfer manager: multipart, parts in parallel, Content-MD5 on every
    part, sha256 metadata) vs a plain single-stream `put_object` per file, on the same S3 server and
    the same salvage set, rounds interleaved (baseline, push, baseline, push, ...). Ratio =
    push MB/s / baseline MB/s (medians). Goal: >= 1.0 -- the integrity work must not make the upload
    slower than the naive loop the seed's team would have written.
(b) the time verify adds: `verify` reading every object back and hashing it (integrity only), as a
    share of the push time; and the loadability checks of a real tiny checkpoint set, in seconds.

The server is a single-node Ceph radosgw started on 127.0.0.1 (tests/s3servers.py; Debian ceph-mon
ceph-osd radosgw must be installed), or any S3 endpoint given with --endpoint-url and credentials in
the standard AWS variables. The set mixes large files (checkpoint-like) and many small ones (logs,
JSON).

Usage: .venv/bin/python bench/salvage.py [--large-mib 64] [--large 4] [--small 200] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def build_set(root: Path, large: int, large_mib: int, small: int) -> Path:
    from trainer.store.manifest import create_manifest

    set_dir = root / "set"
    for i in range(large):
        p = set_dir / "run" / "checkpoints" / f"step-{i:08d}" / "model.safetensors"
        p.parent.mkdir(parents=True, exist_ok=True)
        with open(p, "wb") as fh:
            fh.writelines(os.urandom(2**20) for _ in range(large_mib))
    for i in range(small):
        p = set_dir / "run" / "logs" / f"part-{i:05d}.json"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps({"line": i, "pad": "x" * 4000}) + "\n")
    create_manifest(set_dir, set_dir / "MANIFEST.json", exclude=(".salvage",))
    return set_dir


def baseline(
    client, bucket: str, prefix: str, set_dir: Path, files: list[str], sums: dict | None = None
) -> float:
    t0 = time.perf_counter()
    for rel in files:
        extra = {"Metadata": {"sha256": sums[rel]}} if sums else {}
        with open(set_dir / rel, "rb") as fh:
            client.put_object(Bucket=bucket, Key=f"{prefix}/{rel}", Body=fh, **extra)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--endpoint-url", help="an existing S3 endpoint (default: start radosgw on 127.0.0.1)")
    ap.add_argument("--bucket", default="salvage-bench")
    ap.add_argument("--large", type=int, default=4)
    ap.add_argument("--large-mib", type=int, default=64)
    ap.add_argument("--small", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args()

    from tests.s3servers import RadosGW, s3_env
    from trainer.s3.push import push
    from trainer.salvage.verify import verify_s3

    server = None
    if args.endpoint_url is None:
        os.environ.update(s3_env({}))
        t0 = time.perf_counter()
        server = RadosGW(
            memstore_bytes=(args.large * args.large_mib * (args.rounds * 2 + 1) + 512) * 2**20
        ).start()
        endpoint = server.endpoint_url
        print(f"radosgw up on {endpoint} in {time.perf_counter() - t0:.1f} s")
    else:
        endpoint = args.endpoint_url
    try:
        import boto3
        from botocore.config import Config

        # the baseline: a plain client, one put_object per file, nothing computed beyond what boto3 does
        plain = boto3.client(
            "s3",
            endpoint_url=endpoint,
            config=Config(request_checksum_calculation="when_required", s3={"addressing_style": "path"}),
        )
        # the same naive loop with the integrity push does: Content-MD5 on the request, sha256 metadata
        from trainer.s3.client import add_content_md5

        checked = boto3.client(
            "s3",
            endpoint_url=endpoint,
            config=Config(request_checksum_calculation="when_required", s3={"addressing_style": "path"}),
        )
        checked.meta.events.register("before-call.s3.PutObject", add_content_md5)
        try:
            plain.create_bucket(Bucket=args.bucket)
        except plain.exceptions.BucketAlreadyOwnedByYou:
            pass
        with tempfile.TemporaryDirectory(prefix="dflash-bench-salvage-") as tmp:
            set_dir = build_set(Path(tmp), args.large, args.large_mib, args.small)

            manifest = json.loads((set_dir / "MANIFEST.json").read_text())
            files = sorted(manifest["files"])
            total = sum(e["size"] for e in manifest["files"].values())
            print(
                f"set: {len(files)} files, {total / 2**20:.1f} MiB ({args.large} x {args.large_mib} MiB + "
                f"{args.small} small)"
            )
            sums = {rel: e["sha256"] for rel, e in manifest["files"].items()}
            base_t, md5_t, push_t, verify_t = [], [], [], []
            # a prefix of this bench run's own: a push refuses to overwrite another set's objects (an
            # earlier run's, on an --endpoint-url that keeps its buckets)
            tag = uuid.uuid4().hex[:8]
            for r in range(args.rounds):
                b = baseline(plain, args.bucket, f"base-{r}", set_dir, files)
                m = baseline(checked, args.bucket, f"md5-{r}", set_dir, files, sums)
                md5_t.append(m)
                t0 = time.perf_counter()
                rep = push(
                    set_dir,
                    f"s3://{args.bucket}/push-{tag}-{r}",
                    endpoint,
                    workers=args.workers,
                    progress=False,
                )
                p = time.perf_counter() - t0
                assert rep["ok"] and rep["uploaded"] == len(files), rep.get("failed")
                t0 = time.perf_counter()
                ver = verify_s3(
                    f"s3://{args.bucket}/push-{tag}-{r}",
                    endpoint,
                    load=False,
                    workers=args.workers,
                    local_manifest=manifest,  # what the role does: S3 compared with the collected set
                )
                v = time.perf_counter() - t0
                assert ver["ok"], ver["summary"]
                base_t.append(b)
                push_t.append(p)
                verify_t.append(v)
                print(
                    f"round {r}: put_object loop {total / 2**20 / b:7.1f} MiB/s ({b:.2f} s) | "
                    f"same + Content-MD5 {total / 2**20 / m:7.1f} MiB/s ({m:.2f} s) | "
                    f"salvage push {total / 2**20 / p:7.1f} MiB/s ({p:.2f} s) | verify read-back {v:.2f} s"
                )
            t0 = time.perf_counter()
            again = push(
                set_dir, f"s3://{args.bucket}/push-{tag}-0", endpoint, workers=args.workers, progress=False
            )
            second = time.perf_counter() - t0
            print(f"second push of an unchanged set: {again['uploaded_bytes']} bytes sent, {second:.2f} s")
        mb, mp, mv = statistics.median(base_t), statistics.median(push_t), statistics.median(verify_t)
        print(
            f"verify (integrity: read back + sha256 of every object) adds {mv:.2f} s = {mv / mp:.2f} x the "
            "push time"
        )
        load_s = _loadability_seconds()
        if load_s is not None:
            print(
                "loadability of a real tiny run set (2 checkpoints + dataset, speculators import included): "
                f"{load_s:.1f} s"
            )
        mm = statistics.median(md5_t)
        print(
            f"push vs the single-stream loop with the same integrity work (Content-MD5 + sha256 metadata): "
            f"{mm / mp:.2f} x"
        )
        ratio = mb / mp
        print(
            f"ratio: {ratio:.2f} (push MiB/s / single-stream put_object MiB/s, medians of {args.rounds}; "
            "goal: >= 1.0)"
        )
        return 0 if ratio >= 1.0 else 1
    finally:
        if server is not None:
            server.stop()


def _loadability_seconds() -> float | None:
    """verify_local's loadability checks on a salvage set of a real 4-step tiny run."""
    import subprocess

    import numpy as np

    from tests.conftest import write_config
    from trainer.demo.synth import greedy_dataset, tiny_target
    from trainer.salvage.collect import collect
    from trainer.salvage.verify import verify_local

    with tempfile.TemporaryDirectory(prefix="dflash-bench-load-") as tmp:
        root = Path(tmp)
        t = tiny_target(root / "target")
        rng = np.random.default_rng(0)
        d = greedy_dataset(t, [rng.integers(3, 500, size=8).tolist() for _ in range(16)], 32, root / "ds")
        cfg = write_config(
            root / "run.yaml",
            t,
            d,
            root / "run",
            train={"max_steps": 4, "checkpoint_every": 2, "max_tokens_per_batch": 256, "max_anchors": 32},
        )
        res = subprocess.run(
            [sys.executable, "-m", "trainer.cli", "train", "--config", str(cfg)],
            capture_output=True,
            text=True,
            check=False,
        )
        if res.returncode != 0:
            print("tiny run failed; loadability not measured:", res.stderr[-500:])
            return None
        collect(root / "run", root / "set")
        t0 = time.perf_counter()
        rep = verify_local(root / "set")
        assert rep["ok"], rep["summary"]
        return time.perf_counter() - t0


if __name__ == "__main__":
    sys.exit(main())
