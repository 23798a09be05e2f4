"""A local stand-in for the Hugging Face Hub's HTTP endpoint (`HF_ENDPOINT=http://HOST:PORT`).

The internet is the one thing these tests cannot reach, so this answers the few requests
huggingface_hub makes for `model_info(files_metadata=True)`, `get_hf_file_metadata` and `http_get`,
the way the Hub does (huggingface_hub 2.x, read from its source):

- `GET /api/models/REPO/revision/REV?blobs=true` -> `{"id", "sha", "siblings": [{"rfilename", "size",
  "blobId", "lfs": {"sha256", "size", "pointerSize"}}]}`; an unknown repo or revision is a 404 with
  the Hub's `X-Error-Code` (RepoNotFound / RevisionNotFound);
- `HEAD|GET /REPO/resolve/REV/PATH` with `X-Repo-Commit`, `ETag` (the git blob id; for an LFS file
  `X-Linked-Etag` = its sha256 and `X-Linked-Size`), `Accept-Ranges` and `Range` -> 206.

- `GET /datasets/REPO/resolve/REV/PATH` the same for a dataset repo (`add_folder(..., repo_type="dataset")`).

Uploads, as `HfApi.create_repo`, `create_branch` and `create_commit` make them without Xet (the test
sets `HF_HUB_DISABLE_XET=1`: the stand-in speaks Git LFS, the Hub's other upload protocol):

- `POST /api/repos/create` (409 when it exists), `POST /api/models/REPO/branch/BRANCH`,
  `POST /api/validate-yaml` (a README.md's metadata);
- `POST /api/models/REPO/preupload/REV` -> per file `uploadMode` (lfs / regular), `shouldIgnore` and
  the `oid` of the file already at that path (sha256 for LFS, git blob id otherwise): the client
  drops an unchanged file from the commit, and commits nothing when nothing changed;
- `POST /REPO.git/info/lfs/objects/batch` -> an upload action only for objects the stand-in lacks;
  `PUT /lfs-upload/OID` stores the bytes (refused unless their sha256 is OID);
- `POST /api/models/REPO/commit/REV` (NDJSON: header, file, lfsFile, deletedFile) -> a new commit
  on that branch. `commits` lists them; `received` counts the file bytes uploaded.

Files of a served folder at least `lfs_from` bytes, or named *.safetensors / *.bin, are LFS files.
Test levers: `stall_after[path] = N` (after N body bytes of that file the server stops sending and
holds the connection: a download killed mid-file), `corrupt[path] = bytes` (served in place of the
real bytes while the metadata still names the real ones), `token` (every request must carry it),
`served[path]` (body bytes sent so far).
"""

from __future__ import annotations

import base64
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
        self.heads: dict[str, dict[str, str]] = {}  # repo key -> branch -> commit
        self.snapshots: dict[tuple[str, str], dict[str, bytes]] = {}  # (repo key, commit) -> files
        self.lfs_store: dict[str, bytes] = {}  # sha256 -> bytes uploaded through LFS
        self.commits: list[dict] = []  # commits made through the commit API
        self.received = 0  # file bytes uploaded (LFS bodies and regular files in commits)
        self.httpd = ThreadingHTTPServer((host, 0), _handler(self))
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def add_folder(self, repo: str, folder: Path, repo_type: str = "model") -> None:
        folder = Path(folder)
        files = {
            p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
        }
        self.set_head(repo if repo_type == "model" else f"{repo_type}s/{repo}", "main", COMMIT, files)

    def set_head(self, key: str, branch: str, commit: str, files: dict[str, bytes]) -> None:
        self.heads.setdefault(key, {})[branch] = commit
        self.snapshots[(key, commit)] = files
        if branch == "main":
            self.repos[key] = files

    def files_at(self, repo: str, branch: str = "main") -> dict[str, bytes]:
        return self.snapshots[(repo, self.heads[repo][branch])]

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

        def _repo_rev(self, repo: str, rev: str) -> tuple[str, dict[str, bytes]] | None:
            """(commit, files) of a branch or commit of `repo`, or None after a 404."""
            if repo not in hub.heads:
                self._err(404, "RepoNotFound", f"Repository Not Found for url: {self.path}")
                return None
            commit = hub.heads[repo].get(rev, rev)
            if (repo, commit) not in hub.snapshots:
                self._err(404, "RevisionNotFound", f"Invalid rev id: {rev}")
                return None
            return commit, hub.snapshots[(repo, commit)]

        def _json(self, obj, code: int = 200) -> None:
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                out = bytearray()
                while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
                    out += self.rfile.read(size)
                    self.rfile.readline()
                self.rfile.readline()
                return bytes(out)
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

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
            m = re.fullmatch(r"/api/(models|datasets)/(.+?)/revision/([^/]+)", path)
            if m:
                key = m[2] if m[1] == "models" else f"datasets/{m[2]}"
                found = self._repo_rev(key, m[3])
                if found is None:
                    return
                commit, files = found
                body = json.dumps(
                    {"id": m[2], "sha": commit, "siblings": [hub.sibling(r, d) for r, d in files.items()]}
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command == "GET":
                    self.wfile.write(body)
                return
            # the tree listing (`hf download REPO FILE...` and snapshot_download list it): one page, all files
            m = re.fullmatch(r"/api/(models|datasets)/(.+?)/tree/([^/]+)(/.*)?", path)
            if m:
                found = self._repo_rev(m[2] if m[1] == "models" else f"datasets/{m[2]}", m[3])
                if found is None:
                    return
                tree = []
                for rel, data in found[1].items():
                    s = hub.sibling(rel, data)
                    entry = {"type": "file", "oid": s["blobId"], "size": s["size"], "path": rel}
                    if "lfs" in s:
                        entry["lfs"] = {"oid": s["lfs"]["sha256"], "size": s["size"], "pointerSize": 134}
                    tree.append(entry)
                return self._json(tree)
            m = re.fullmatch(r"/(.+?)/resolve/([^/]+)/(.+)", path)
            if not m:
                return self._err(404, "EntryNotFound", f"no route {path}")
            found = self._repo_rev(m[1], m[2])
            if found is None:
                return
            commit, files = found
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
            self.send_header("X-Repo-Commit", commit)
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

        # ---------------------------------------------------------------- uploads
        def do_PUT(self):
            path = unquote(urlsplit(self.path).path)
            body = self._body()
            with hub.lock:
                hub.requests.append((self.command, path, dict(self.headers)))
            m = re.fullmatch(r"/lfs-upload/([0-9a-f]{64})", path)
            if not m:
                return self._err(404, "EntryNotFound", f"no route {path}")
            if hashlib.sha256(body).hexdigest() != m[1]:
                return self._err(400, "BadRequest", "the bytes do not hash to the oid")
            with hub.lock:
                hub.lfs_store[m[1]] = body
                hub.received += len(body)
            self._json({})

        def do_POST(self):
            path = unquote(urlsplit(self.path).path)
            body = self._body()
            with hub.lock:
                hub.requests.append((self.command, path, dict(self.headers)))
            if not self._authorized():
                return
            if path == "/api/validate-yaml":
                return self._json({"errors": [], "warnings": []})
            if path == "/api/repos/create":
                req = json.loads(body)
                key = "/".join(x for x in (req.get("organization"), req["name"]) if x)
                if key in hub.heads:  # the Hub's 409 names the repo; create_repo(exist_ok=True) reads it
                    return self._json(
                        {"error": "You already created this model repo", "url": f"{hub.endpoint}/{key}"}, 409
                    )
                hub.set_head(key, "main", hashlib.sha1(key.encode()).hexdigest(), {})  # noqa: S324
                return self._json({"url": f"{hub.endpoint}/{key}", "name": key})
            m = re.fullmatch(r"/api/models/(.+?)/(branch|preupload|commit)/([^/]+)", path)
            if m:
                found = self._repo_rev(m[1], "main" if m[2] == "branch" else m[3])
                if found is None:
                    return
                head, files = found
                if m[2] == "branch":
                    if m[3] in hub.heads[m[1]]:
                        return self._err(409, "Conflict", f"branch {m[3]} exists")
                    hub.heads[m[1]][m[3]] = head
                    return self._json({})
                if m[2] == "preupload":
                    out = []
                    for f in json.loads(body)["files"]:
                        lfs = f["size"] >= hub.lfs_from or f["path"].endswith((".safetensors", ".bin"))
                        have = files.get(f["path"])
                        oid = None
                        if have is not None:
                            sib = hub.sibling(f["path"], have)
                            oid = sib["lfs"]["sha256"] if "lfs" in sib else sib["blobId"]
                        mode = "lfs" if lfs else "regular"
                        out.append({"path": f["path"], "uploadMode": mode, "shouldIgnore": False, "oid": oid})
                    return self._json({"files": out})
                return self._commit(m[1], m[3], head, files, body)
            m = re.fullmatch(r"/(.+?)\.git/info/lfs/objects/batch", path)
            if m:
                objects = []
                for o in json.loads(body)["objects"]:
                    entry = {"oid": o["oid"], "size": o["size"]}
                    if o["oid"] not in hub.lfs_store:
                        entry["actions"] = {"upload": {"href": f"{hub.endpoint}/lfs-upload/{o['oid']}"}}
                    objects.append(entry)
                return self._json({"transfer": "basic", "objects": objects})
            self._err(404, "EntryNotFound", f"no route {path}")

        def _commit(self, repo: str, branch: str, head: str, files: dict[str, bytes], body: bytes) -> None:
            new = dict(files)
            lines = [json.loads(x) for x in body.splitlines() if x.strip()]
            for item in lines[1:]:
                v = item["value"]
                if item["key"] == "file":
                    new[v["path"]] = base64.b64decode(v["content"])
                    with hub.lock:
                        hub.received += len(new[v["path"]])
                elif item["key"] == "lfsFile":
                    if v["oid"] not in hub.lfs_store:
                        return self._err(400, "BadRequest", f"LFS object {v['oid']} was never uploaded")
                    new[v["path"]] = hub.lfs_store[v["oid"]]
                elif item["key"] == "deletedFile":
                    new.pop(v["path"], None)
            oid = hashlib.sha1(head.encode() + body).hexdigest()  # noqa: S324 - a commit id
            with hub.lock:
                hub.set_head(repo, branch, oid, new)
                paths = [i["value"]["path"] for i in lines[1:]]
                summary = lines[0]["value"]["summary"]
                hub.commits.append(
                    {"repo": repo, "branch": branch, "oid": oid, "summary": summary, "paths": paths}
                )
            self._json(
                {"commitUrl": f"{hub.endpoint}/{repo}/commit/{oid}", "commitOid": oid, "pullRequestUrl": None}
            )

    return H


if __name__ == "__main__":  # `python tests/hubserver.py REPO DIR [HOST]`: serve a folder until killed
    import sys

    srv = HubStandIn(*(sys.argv[3:4]))
    srv.add_folder(sys.argv[1], Path(sys.argv[2]))
    with srv:
        print(srv.endpoint, flush=True)
        threading.Event().wait()
