"""What a regeneration tells the outside while it runs: the event stream (`RegenEvents`: monitor page,
`dflash status`) and the S3 pushes of finished batches and of the dataset (`BatchPusher`)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from trainer.redact import redact_text
from trainer.regenerate.meta import RegenerateError
from trainer.salvage.proc import identity


class BatchPusher:
    """The finished batches to `<url>/partial/` (at most once per `every_s`, and at the end), the
    dataset to `<url>/dataset/`, each with its sha256 manifest (trainer/s3/push.py); a fresh node pulls
    the batches back. A failed batch push is a warning (generation goes on; the next push catches up);
    a failed dataset push fails the command (a restart pushes again)."""

    def __init__(self, url: str, endpoint_url: str | None, every_s: float, events: RegenEvents):
        from trainer.s3.client import make_client

        self.url = url.rstrip("/")
        self.endpoint_url = endpoint_url
        self.every_s = every_s
        self.events = events
        self.client = make_client(endpoint_url)
        self.last = 0.0

    def restore(self, work: Path, out: Path) -> bool:
        """Pull what an earlier node pushed: the finished dataset (True), or the batches into `work`."""
        from trainer.s3.client import get_json, parse_s3_url
        from trainer.s3.pull import pull

        for part, dest in (("dataset", out), ("partial", work)):
            loc = parse_s3_url(f"{self.url}/{part}")
            if get_json(self.client, loc.bucket, loc.key("MANIFEST.json")) is None:
                continue
            print(f"dflash regenerate: pulling {loc.url()} (pushed by an earlier run)", flush=True)
            tmp = dest.parent / f".{dest.name}.s3-pull"
            report = pull(loc.url(), tmp, endpoint_url=self.endpoint_url, progress=False, client=self.client)
            if not report.get("ok"):
                raise RegenerateError(f"{loc.url()} could not be pulled intact: {report.get('failed')}")
            (tmp / "MANIFEST.json").unlink(missing_ok=True)
            tmp.rename(dest)
            return part == "dataset"
        return False

    def push(self, folder: Path, part: str, force: bool = False) -> None:
        from trainer.s3.push import push_folder
        from trainer.store.manifest import manifest_beside

        now = time.monotonic()
        if not force and now - self.last < self.every_s:
            return
        self.last = now
        try:
            report = push_folder(
                folder,
                f"{self.url}/{part}",
                endpoint_url=self.endpoint_url,
                progress=False,
                client=self.client,
            )
            ok, why = report["ok"], "; ".join(f["path"] + ": " + f["error"] for f in report["failed"][:3])
        except Exception as exc:  # noqa: BLE001 - S3 trouble must not stop the generation
            ok, why = False, f"{type(exc).__name__}: {exc}"
        finally:
            manifest_beside(folder).unlink(missing_ok=True)
        if ok:
            return
        msg = f"push of {folder.name} to {self.url}/{part} failed: {why}"
        if part == "dataset":
            raise RuntimeError(msg + " (run the command again: the push resumes)")
        self.events.warning("s3_push_failed", msg)


class RegenEvents:
    """The run's event stream (trainer/store/events.py) when `run_dir` is given: run_start with the batch
    count as total_steps, one step per finished batch (response tokens, tokens/s), run_end."""

    def __init__(self, run_dir: Path | None, run_id: str):
        from trainer.store.events import EventWriter

        self.writer = EventWriter(run_dir or Path("."), run_id, enabled=run_dir is not None)
        self.t0 = self.gen_t0 = time.time()
        self.step = self.tokens = self.tokens0 = 0  # the last finished batch's (what run_end reports)

    def start(self, plan: dict[str, Any], batches: int, done: int, tokens: int) -> None:
        self.tokens0 = self.tokens = tokens
        self.step = done
        self.writer.emit(
            "run_start",
            **identity(),  # pid, its start ticks, boot id: `salvage stop` proves it is this job
            start_step=done,
            tokens=tokens,
            totals={"total_steps": batches, "data": {"samples": plan["num_prompts"]}},
            config={
                "job": "regenerate",
                **{k: plan[k] for k in ("target", "prompts", "backend", "max_new_tokens")},
            },
        )

    def generation_started(self) -> None:
        """tokens/s counts from here: the engine's start-up and the wait for servers are not speed."""
        self.gen_t0 = time.time()

    def batch(self, step: int, batches: int, tokens: int, samples: int, empty: int) -> None:
        self.step, self.tokens = step, tokens
        elapsed = max(1e-9, time.time() - self.gen_t0)
        self.writer.emit(
            "step",
            step=step,
            total_steps=batches,
            tokens=tokens,
            tokens_per_s=round((tokens - self.tokens0) / elapsed, 2),
            samples=samples,
            empty=empty,
        )

    def warning(self, kind: str, message: str) -> None:
        print(f"dflash regenerate: WARNING {redact_text(message)}", file=sys.stderr, flush=True)
        self.writer.emit("warning", kind=kind, message=message)

    def end(self, status: str, error: str | None = None) -> None:
        """run_end with the last finished batch's step and tokens (a failed run's too)."""
        self.writer.emit(
            "run_end",
            status=status,
            step=self.step,
            tokens=self.tokens,
            wall_s=round(time.time() - self.t0, 3),
            error=error,
        )
