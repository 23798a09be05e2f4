"""A model repo from the Hugging Face Hub onto this machine, every file proven (`dflash hub pull`).

`pull hf://REPO@REVISION DIR` (the data_sync role's `hf` source) runs on the node, so a 65 GB target
never travels through the controller. It asks the Hub for the repo's file list at REVISION with each
file's metadata (`model_info(files_metadata=True)`: size, git blob id, and for LFS files the LFS
object's sha256), resolves REVISION to its commit and downloads every file of that commit, pinned:

- a file already in DIR whose bytes match the Hub's digest is kept (a second pull moves 0 bytes);
- otherwise it is downloaded into `DIR/.hf-partial/<path>` with huggingface_hub's own HTTP download
  (`http_get`, resumable by Range). A pull killed mid-file leaves that partial and the file's ETag
  beside it; the next pull asks only for the missing bytes when the ETag is unchanged;
- the complete file is checked: an LFS file's sha256 against the Hub's `lfs.sha256`, any other file
  (small text: config.json, tokenizer files) against the Hub's git blob id (sha1 of `blob SIZE\\0` +
  bytes, git's object id). Only a match is renamed into place; a mismatch is deleted (never under
  its final name), named in the report, and the pull exits 1. A resumed file that fails is fetched
  once more from the start (the partial may be stale); a fresh one is not.

It finishes by writing the manifest beside DIR (`DIR.manifest.json`, the format of
trainer/store/manifest.py, `source: hf://REPO@COMMIT`), so `dflash manifest verify DIR DIR.manifest.json`
re-proves the copy any time. The token is read from a file (`--token-file`, 0600, written by the role
from the vault and removed afterwards): never in argv or the environment. HF_HUB_OFFLINE must be off
for this verb (the trainer keeps it on). Light side: huggingface_hub is imported lazily, no torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

from trainer.errors import DflashError, ExitCode
from trainer.store.fsutil import atomic_write_text
from trainer.store.manifest import MANIFEST_VERSION, ManifestError, check_rel, manifest_beside
from trainer.store.resumable import fetch_all, fetch_verified, nothing_fetched, plan_pull, resume_offset

PARTIAL_DIR = ".hf-partial"
MiB = 2**20
_REPO = r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}(?:/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?"
_SPEC = re.compile(rf"^(?:hf://)?(?P<repo>{_REPO})(?:@(?P<rev>[A-Za-z0-9][A-Za-z0-9._/-]{{0,199}}))?$")


class HubError(DflashError):
    """Bad input (a malformed spec, an unreadable token file, a repo or revision the Hub does not
    have): refused before anything is written."""


class HubFailed(DflashError):
    """The Hub could not be reached or answered wrongly part way."""

    exit_code = ExitCode.FAILED


# where huggingface_hub's transport errors come from (httpx2 in huggingface_hub 2.x, httpx before):
# a refused connection, a timeout, a bad URL are these, not HfHubHTTPError or OSError
NET_LIBRARIES = ("httpx", "httpx2", "httpcore", "httpcore2", "h11", "h2", "requests", "urllib3")


def unreachable(exc: BaseException) -> bool:
    """True for an error of the network below the Hub's API (refused, timed out, reset, a bad URL)."""
    return isinstance(exc, OSError) or type(exc).__module__.split(".")[0] in NET_LIBRARIES


def check_endpoint(endpoint: str | None, what: str = "--endpoint") -> None:
    """An endpoint must be http(s)://HOST[:PORT][/PATH]: anything else is refused before any request."""
    if endpoint is None:
        return
    from urllib.parse import urlsplit

    try:
        u = urlsplit(endpoint)
        ok = u.scheme in ("http", "https") and bool(u.hostname) and (u.port is None or u.port > 0)
    except ValueError:  # a port that is no number, a broken [IPv6]
        ok = False
    if not ok:
        raise HubError(f"{what} {endpoint!r}: expected http(s)://HOST[:PORT] (e.g. https://huggingface.co)")


def parse_spec(spec: str, revision: str | None = None) -> tuple[str, str]:
    """`hf://ORG/NAME@REV`, `ORG/NAME@REV` or `ORG/NAME` (+ `revision`) -> (repo, revision);
    the revision defaults to `main`. A revision both in the spec and in `revision` must agree."""
    m = _SPEC.match(spec or "")
    if not m or ".." in m["repo"] or (m["rev"] and ".." in m["rev"]):
        raise HubError(
            f"{spec!r} is not a Hub repo: expected hf://ORG/NAME@REVISION (or ORG/NAME with --revision)"
        )
    if m["rev"] and revision and m["rev"] != revision:
        raise HubError(f"{spec!r} names revision {m['rev']!r} but --revision says {revision!r}")
    return m["repo"], m["rev"] or revision or "main"


def read_token(path: str | os.PathLike | None) -> str | None:
    """The token in `path` (stripped), None without a path; a named file that is missing or empty is
    an error (exit 2), never a silent anonymous pull."""
    if path is None:
        return None
    p = Path(path)
    try:
        token = p.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise HubError(f"token file {p}: {exc.strerror if isinstance(exc, OSError) else exc}") from None
    if not token:
        raise HubError(f"token file {p} is empty")
    return token


def digests(path: Path) -> tuple[str, str]:
    """(sha256, git blob id) of a file in one read."""
    sha, blob = hashlib.sha256(), hashlib.sha1()  # noqa: S324 - git's object id, not a security hash
    blob.update(f"blob {path.stat().st_size}\0".encode())
    with open(path, "rb") as fh:
        while chunk := fh.read(MiB):
            sha.update(chunk)
            blob.update(chunk)
    return sha.hexdigest(), blob.hexdigest()


def _refusal(entry: dict[str, Any], got: dict[str, Any]) -> str | None:
    """Why a downloaded file is not the one the Hub lists (None: it is): its size, then its LFS sha256
    or, for a file kept in git, its blob id."""
    if got["size"] != entry["size"]:
        return f"{got['size']} bytes, the Hub says {entry['size']}"
    if entry["lfs_sha256"]:
        if got["sha256"] == entry["lfs_sha256"]:
            return None
        return f"sha256 {got['sha256'][:12]}..., the Hub's LFS sha256 is {entry['lfs_sha256'][:12]}..."
    if got["blob"] == entry["blob_id"]:
        return None
    return f"git blob id {got['blob'][:12]}..., the Hub's is {entry['blob_id'][:12]}..."


def listing(api, repo: str, revision: str) -> tuple[str, dict[str, dict[str, Any]]]:
    """(commit, rel -> {size, lfs_sha256, blob_id}) from the Hub's file metadata."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        info = api.model_info(repo, revision=revision, files_metadata=True)
    except (RepositoryNotFoundError, RevisionNotFoundError, GatedRepoError) as exc:
        raise HubError(f"hf://{repo}@{revision}: {type(exc).__name__}: {str(exc).splitlines()[0]}") from None
    except Exception as exc:  # noqa: BLE001 - the HTTP and network errors only, the rest re-raised
        if not isinstance(exc, HfHubHTTPError) and not unreachable(exc):
            raise
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise HubFailed(
            f"hf://{repo}@{revision}: the Hub at {api.endpoint} did not answer: {type(exc).__name__}: {first}"
        ) from None
    files: dict[str, dict[str, Any]] = {}
    for s in info.siblings or []:
        try:
            check_rel(s.rfilename, f"hf://{repo}")
        except ManifestError as exc:
            raise HubFailed(str(exc)) from None
        lfs = s.lfs
        size = lfs.size if lfs else s.size
        if size is None or (not lfs and not s.blob_id):
            raise HubFailed(f"hf://{repo}@{revision}: the Hub gave no size or blob id for {s.rfilename}")
        files[s.rfilename] = {"size": size, "lfs_sha256": lfs.sha256 if lfs else None, "blob_id": s.blob_id}
    if not info.sha:
        raise HubFailed(f"hf://{repo}@{revision}: the Hub did not name the commit")
    return info.sha, files


def local_state(path: Path, entry: dict[str, Any]) -> tuple[str, str | None]:
    """('same', sha256) | ('missing', None) | ('differs', None) for a destination file."""
    if path.is_symlink() or not path.is_file():
        return ("missing" if not path.exists() and not path.is_symlink() else "differs"), None
    if path.stat().st_size != entry["size"]:
        return "differs", None
    sha, blob = digests(path)
    same = _refusal(entry, {"size": entry["size"], "sha256": sha, "blob": blob}) is None
    return ("same", sha) if same else ("differs", None)


def _fetch(url: str, token: str | None, entry: dict[str, Any], part: Path, endpoint: str) -> dict[str, Any]:
    """Download one file into `part`, resuming a partial of the same ETag (huggingface_hub's
    get_hf_file_metadata + http_get); returns what moved and the file's digests."""
    from huggingface_hub import get_hf_file_metadata
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    meta = get_hf_file_metadata(url, token=token, endpoint=endpoint)
    offset = resume_offset(part, json.dumps({"url": url, "etag": meta.etag}), entry["size"])
    headers = build_hf_headers(token=token)
    headers["Accept-Encoding"] = "identity"
    with open(part, "ab") as fh:
        http_get(
            meta.location,
            fh,
            resume_size=offset,
            headers=headers,
            expected_size=entry["size"],
            displayed_filename=part.name,
        )
        fh.flush()
        os.fsync(fh.fileno())  # on disk before a rename makes it the real file
    size = part.stat().st_size
    sha, blob = digests(part)
    return {"resumed_from": offset, "bytes": size - offset, "size": size, "sha256": sha, "blob": blob}


def pull(
    spec: str,
    dest: Path,
    revision: str | None = None,
    token_file: str | None = None,
    endpoint: str | None = None,
    check: bool = False,
    workers: int = 4,
    progress: bool = True,
) -> dict[str, Any]:
    """Copy the Hub repo `spec` at its revision into `dest`, resumable, every file proven. Returns the
    report (`ok` false when a file was refused); raises HubError on bad input before writing."""
    repo, rev = parse_spec(spec, revision)
    check_endpoint(endpoint)
    token = read_token(token_file)
    dest = Path(dest)
    if dest.exists() and not dest.is_dir():
        raise HubError(f"destination {dest} exists and is not a folder")
    from huggingface_hub import HfApi, constants, hf_hub_url
    from huggingface_hub.utils import disable_progress_bars

    if constants.HF_HUB_OFFLINE:
        raise HubError(
            "HF_HUB_OFFLINE is set: `dflash hub pull` downloads, so run it without it (the trainer keeps it)"
        )
    if not progress:
        disable_progress_bars()
    endpoint = (endpoint or constants.ENDPOINT).rstrip("/")
    api = HfApi(endpoint=endpoint, token=token if token else False)
    commit, files = listing(api, repo, rev)

    t0 = time.monotonic()
    plan = plan_pull(dest, files, PARTIAL_DIR, local_state, workers)
    partial_root = dest / PARTIAL_DIR
    report: dict[str, Any] = {"hub": f"hf://{repo}@{rev}", "commit": commit}
    report.update(plan.report(dest, files, check))
    if plan.shortfall(dest):
        raise HubError(plan.shortfall(dest))
    if check:
        report.update(nothing_fetched(), ok=True, seconds=round(time.monotonic() - t0, 3))
        return report

    dest.mkdir(parents=True, exist_ok=True)
    sums = {r: sha for r, (s, sha) in plan.states.items() if s == "same"}
    lock = threading.Lock()

    def one(rel: str) -> dict[str, Any]:
        entry, part = files[rel], partial_root / rel
        url = hf_hub_url(repo, rel, revision=commit, endpoint=endpoint)

        def place(got: dict[str, Any]) -> None:
            os.chmod(part, 0o644)
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            os.replace(part, dest / rel)
            with lock:
                sums[rel] = got["sha256"]

        fetch = partial(_fetch, url, token, entry, part, endpoint)
        return fetch_verified(rel, part, fetch, partial(_refusal, entry), place)

    totals, failed = fetch_all(plan.todo, one, workers)
    if not failed:
        shutil.rmtree(partial_root, ignore_errors=True)
        entries = {}
        for rel in sorted(files):
            st = (dest / rel).stat()
            entries[rel] = {"size": st.st_size, "sha256": sums[rel], "mtime_ns": st.st_mtime_ns}
        manifest = {
            "manifest_version": MANIFEST_VERSION,
            "created": round(time.time(), 3),
            "source": f"hf://{repo}@{commit}",
            "file_count": len(entries),
            "total_bytes": sum(e["size"] for e in entries.values()),
            "files": entries,
        }
        atomic_write_text(manifest_beside(dest), json.dumps(manifest, indent=1) + "\n")
    report.update(
        totals,
        failed=failed,
        manifest=None if failed else str(manifest_beside(dest)),
        ok=not failed,
        seconds=round(time.monotonic() - t0, 3),
    )
    return report


def fetch_file(spec: str, filename: str = "config.json", endpoint: str | None = None) -> Path:
    """One file of a Hub repo on this machine (huggingface_hub's cache; its token: HF_TOKEN or the
    login): `dflash plan --target-config hf://REPO@REVISION` reads the target's config.json without a
    copy of the target on the controller. With HF_HUB_OFFLINE set, only a cached copy is found."""
    repo, rev = parse_spec(spec)
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(hf_hub_download(repo, filename, revision=rev, endpoint=endpoint))
    except Exception as exc:  # noqa: BLE001 - the Hub's and the network's errors only, the rest re-raised
        known = (EntryNotFoundError, LocalEntryNotFoundError, HfHubHTTPError)
        if not isinstance(exc, known) and not unreachable(exc):
            raise
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise HubError(f"{filename} of hf://{repo}@{rev}: {type(exc).__name__}: {first}") from None
