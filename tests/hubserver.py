"""A local stand-in for the Hugging Face Hub's HTTP endpoint (`HF_ENDPOINT=http://HOST:PORT`).

The internet is the one thing these tests cannot reach, so this answers the few requests
huggingface_hub makes for `model_info(files_metadata=True)`, `get_hf_file_metadata` and `http_get`,
the way the Hub does (huggingface_hub 2.x, read from its source):

- `GET /api/models/REPO/revision/REV?blobs=true` -> `{"id", "sha", "siblings": [{"rfilename", "size",
  "blobId", "lfs": {"sha256", "size", "pointerSize"}}]}`; an unknown repo or revision is a 404 with
  the Hub's `X-Error-Code` (RepoNotFound / RevisionNotFound);
- `HEAD|GET /REPO/resolve/REV/PATH` with `X-Repo-Commit`, `ETag` (the git blob id; for an LFS file
  `X-Linked-Etag` = its sha256 and `X-Linked-Size`), `Accept-Ranges` and `Range` -> 206.

Files of a served folder at least `lfs_from` bytes, or named *.safetensors / *.bin, are LFS files.
Test levers: `stall_after[path] = N` (after N body bytes of that file the server stops sending and
holds the connection: a download killed mid-file), `corrupt[path] = bytes` (served in place of the
real bytes while the metadata still names the real ones), `token` (every request must carry it),
`served[path]` (body bytes sent so far).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class HubStandIn:
    def __init__(self, host: str = "127.0.0.1", lfs_from: int = 1 << 20):
        self.repos: dict[str, dict[str, bytes]] = {}
        self.lfs_from = lfs_from
        self.stall_after: dict[str, int] = {}
        self.corrupt: dict[str, bytes] = {}
        self.served: dict[str, int] = {}
        self.token: str | None = None
        self.release = threading.Event()  # a stalled response ends when set
        self.stalled = threading.Event()
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer((host, 0), _handler(self))
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def add_folder(self, repo: str, folder: Path) -> None:
        folder = Path(folder)
        self.repos[repo] = {
            p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
        }

    def is_lfs(self, rel: str, data: bytes) -> bool:
        return len(data) >= self.lfs_from or rel.endswith((".safetensors", ".bin"))

    def sibling(self, rel: str, data: bytes) -> dict:
        blob = hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()  # noqa: S324 - git's id
        out = {"rfilename": rel, "size": len(data), "blobId": blob}
        if self.is_lfs(rel, data):
            out["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        return out

    def __enter__(self) -> HubStandIn:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def _handler(hub: HubStandIn):
    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):  # quiet
            pass

        def _err(self, code: int, error_code: str, msg: str) -> None:
            body = json.dumps({"error": msg}).encode()
            self.send_response(code)
            self.send_header("X-Error-Code", error_code)
            self.send_header("X-Error-Message", msg)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _repo_rev(self, repo: str, rev: str) -> dict[str, bytes] | None:
            if repo not in hub.repos:
                self._err(404, "RepoNotFound", f"Repository Not Found for url: {self.path}")
                return None
            if rev not in ("main", COMMIT):
                self._err(404, "RevisionNotFound", f"Invalid rev id: {rev}")
                return None
            return hub.repos[repo]

        def _authorized(self) -> bool:
            if hub.token is None or self.headers.get("Authorization") == f"Bearer {hub.token}":
                return True
            self._err(
                401, "GatedRepo" if self.headers.get("Authorization") else "RepoNotFound", "Unauthorized"
            )
            return False

        def do_HEAD(self):
            self.do_GET()

        def do_GET(self):
            path = unquote(urlsplit(self.path).path)
            with hub.lock:
                hub.requests.append((self.command, path, dict(self.headers)))
            if not self._authorized():
                return
            m = re.fullmatch(r"/api/models/(.+?)/revision/([^/]+)", path)
            if m:
                files = self._repo_rev(m[1], m[2])
                if files is None:
                    return
                body = json.dumps(
                    {"id": m[1], "sha": COMMIT, "siblings": [hub.sibling(r, d) for r, d in files.items()]}
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command == "GET":
                    self.wfile.write(body)
                return
            m = re.fullmatch(r"/(.+?)/resolve/([^/]+)/(.+)", path)
            if not m:
                return self._err(404, "EntryNotFound", f"no route {path}")
            files = self._repo_rev(m[1], m[2])
            if files is None:
                return
            rel = m[3]
            if rel not in files:
                return self._err(404, "EntryNotFound", f"{rel} not in {m[1]}")
            real = files[rel]
            meta = hub.sibling(rel, real)
            data = hub.corrupt.get(rel, real)
            start = 0
            rng = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", ""))
            if rng and self.command == "GET":
                start = int(rng[1])
            self.send_response(206 if start else 200)
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("ETag", f'"{meta["blobId"]}"')
            if "lfs" in meta:
                self.send_header("X-Linked-Etag", f'"{meta["lfs"]["sha256"]}"')
                self.send_header("X-Linked-Size", str(len(real)))
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(len(data) - start))
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            if self.command == "HEAD":
                return
            limit = hub.stall_after.get(rel)
            pos = start
            while pos < len(data):
                n = min(256 * 1024, len(data) - pos)
                if limit is not None:
                    n = min(n, max(0, limit - pos))
                    if n == 0:
                        hub.stalled.set()
                        hub.release.wait(120)
                        return  # the connection dies with the response unfinished
                try:
                    self.wfile.write(data[pos : pos + n])
                except OSError:
                    return
                with hub.lock:
                    hub.served[rel] = hub.served.get(rel, 0) + n
                pos += n

    return H


if __name__ == "__main__":  # `python tests/hubserver.py REPO DIR [HOST]`: serve a folder until killed
    import sys

    srv = HubStandIn(*(sys.argv[3:4]))
    srv.add_folder(sys.argv[1], Path(sys.argv[2]))
    with srv:
        print(srv.endpoint, flush=True)
        threading.Event().wait()
