"""`dflash monitor`: the run page and its API over plain HTTP (stdlib ThreadingHTTPServer + SSE).

Read-only and safe by default: binds 127.0.0.1; any other address needs `allow_remote` and a token;
without a token only requests whose Host is a loopback name are served (no DNS rebinding); only GET;
static files come from a fixed list shipped in the package; a run is named by its id from the list
of discovered runs, never by a path. Light side: no torch."""

from __future__ import annotations

import hmac
import ipaddress
import json
import re
import threading
import time
from http import HTTPStatus
from http.cookies import CookieError, SimpleCookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from trainer.errors import DflashError
from trainer.monitor import metrics
from trainer.monitor.runs import Hub
from trainer.store.events import json_safe

COOKIE = "dflash_monitor_token"
MIN_TOKEN = 16
TOKEN_CHARS = re.compile(r"[A-Za-z0-9._~+/=-]+")  # safe in a cookie and a header, as is
LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1", "[::1]"}
CURVE_KEYS = ("loss", "eal", "lr")
CURVE_POINTS = 4000  # per curve in a full (init) message: min/max decimated beyond that
HEARTBEAT_S = 2.0
TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
}
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
    "img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


class MonitorError(DflashError, ValueError):
    """A refused configuration (bind address, token): the CLI prints it and exits 2."""


def is_loopback(host: str) -> bool:
    if host.strip("[]") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost: treated as reachable from outside


def check_bind(host: str, allow_remote: bool, token: str | None) -> None:
    if token is not None and len(token) < MIN_TOKEN:
        raise MonitorError(f"the token must be at least {MIN_TOKEN} characters (try: openssl rand -hex 16)")
    if token is not None and not TOKEN_CHARS.fullmatch(token):
        raise MonitorError(
            "the token may hold only letters, digits and . _ ~ + / = - (try: openssl rand -hex 16)"
        )
    if is_loopback(host):
        return
    if not allow_remote:
        raise MonitorError(
            f"refusing to bind {host}: the monitor listens on 127.0.0.1 only, reach it with "
            "`ssh -L 8080:127.0.0.1:8080 NODE`; to expose it anyway pass --allow-remote and a token"
        )
    if token is None:
        raise MonitorError(
            f"--allow-remote on {host} needs a token (--token-file FILE or DFLASH_MONITOR_TOKEN)"
        )


def load_static() -> dict[str, tuple[bytes, str]]:
    """The page's assets, read once from the package: the only files the server ever sends."""
    base = resources.files("trainer.monitor") / "static"
    files = {}
    for entry in base.iterdir():
        suffix = Path(entry.name).suffix
        if entry.is_file() and suffix in TYPES:
            files[entry.name] = (entry.read_bytes(), TYPES[suffix])
    if "index.html" not in files:
        raise MonitorError("the monitor's static/index.html is missing from the package")
    return files


def dumps(value: Any) -> bytes:
    return json.dumps(json_safe(value), separators=(",", ":"), allow_nan=False).encode()


class MonitorServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64

    def __init__(
        self,
        hub: Hub,
        host: str = "127.0.0.1",
        port: int = 8080,
        token: str | None = None,
        allow_remote: bool = False,
    ):
        check_bind(host, allow_remote, token)
        self.hub = hub
        self.token = token
        self.static = load_static()
        self.stopping = threading.Event()
        if ":" in host.strip("[]"):
            import socket

            self.address_family = socket.AF_INET6
        super().__init__((host.strip("[]"), port), Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{'[' + host + ']' if ':' in host else host}:{port}/"

    def serve(self) -> None:
        self.hub.start()
        try:
            self.serve_forever(poll_interval=0.2)
        finally:
            self.stopping.set()
            self.hub.stop()

    def stop(self) -> None:
        self.stopping.set()
        self.hub.stop()
        self.shutdown()
        self.server_close()


class Handler(BaseHTTPRequestHandler):
    server: MonitorServer
    protocol_version = "HTTP/1.0"
    server_version = "dflash-monitor"
    sys_version = ""

    def log_message(self, format: str, *args: Any) -> None:
        pass  # no access log: query strings may carry the token

    # ------------------------------------------------------------------ plumbing
    def _send(self, status: int, body: bytes, ctype: str, extra: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in {**SECURITY_HEADERS, **(extra or {})}.items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, value: Any, status: int = 200) -> None:
        self._send(status, dumps(value), "application/json")

    def _error(self, status: int, message: str) -> None:
        self._json({"error": message}, status)

    def _authorized(self, query: dict[str, list[str]]) -> bool:
        token = self.server.token
        if token is None:
            return host_name(self.headers.get("Host") or "") in LOOPBACK_NAMES
        offered = []
        if "token" in query:
            offered.append(query["token"][0])
        auth = self.headers.get("Authorization") or ""
        if auth.lower().startswith("bearer "):
            offered.append(auth[7:].strip())
        cookie = SimpleCookie()
        try:
            cookie.load(self.headers.get("Cookie") or "")
        except CookieError:
            cookie = SimpleCookie()  # a malformed Cookie header offers no token
        if COOKIE in cookie:
            offered.append(cookie[COOKIE].value)
        return any(hmac.compare_digest(o.encode(), token.encode()) for o in offered)

    def _run(self, query: dict[str, list[str]]) -> str | None:
        hub = self.server.hub
        rid = query.get("run", [None])[0] or hub.default_run()
        return rid if rid in hub.runs else None

    # ------------------------------------------------------------------ methods
    def do_POST(self) -> None:
        self._error(HTTPStatus.METHOD_NOT_ALLOWED, "the monitor is read-only")

    do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_POST

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        parts = urlsplit(self.path)
        path = parts.path
        query = parse_qs(parts.query)
        if not self._authorized(query):
            self._error(HTTPStatus.FORBIDDEN, "forbidden: pass the monitor token (or use a loopback address)")
            return
        try:
            self._route(path, query)
        except (BrokenPipeError, ConnectionResetError):
            pass
        except ValueError as exc:
            self._error(HTTPStatus.BAD_REQUEST, str(exc))

    def _route(self, path: str, query: dict[str, list[str]]) -> None:
        hub = self.server.hub
        if path == "/" or path == "/index.html":
            token = self.server.token
            if token and hmac.compare_digest(query.get("token", [""])[0].encode(), token.encode()):
                # keep the token out of the address bar and history: a cookie from now on
                self._send(
                    HTTPStatus.FOUND,
                    b"",
                    "text/plain",
                    {"Location": "/", "Set-Cookie": f"{COOKIE}={token}; HttpOnly; SameSite=Strict; Path=/"},
                )
                return
            body, ctype = self.server.static["index.html"]
            self._send(200, body, ctype)
        elif path.startswith("/static/"):
            name = path[len("/static/") :]
            if name not in self.server.static:
                self._error(HTTPStatus.NOT_FOUND, "no such file")
                return
            body, ctype = self.server.static[name]
            self._send(200, body, ctype)
        elif path == "/metrics":
            snaps = [hub.snapshot(rid) for rid in sorted(hub.runs)]
            self._send(200, metrics.render(snaps).encode(), metrics.CONTENT_TYPE)
        elif path == "/api/runs":
            self._json({"runs": hub.run_list(), "default": hub.default_run()})
        elif path.startswith("/api/"):
            rid = self._run(query)
            if rid is None:
                self._error(HTTPStatus.NOT_FOUND, "no such run (see /api/runs)")
                return
            run = hub.runs[rid]
            if path == "/api/status":
                self._json(hub.snapshot(rid))
            elif path == "/api/events":
                since = _int(query, "since", 0)
                limit = min(max(1, _int(query, "limit", 500)), 5000)
                self._json(run.events_since(since, limit))
            elif path == "/api/log":
                n = min(max(0, _int(query, "lines", 200)), 10000)
                self._json({"run": rid, "lines": run.log_tail(n), "seq": run.log_seq})
            elif path == "/api/curves":
                points = min(max(10, _int(query, "points", CURVE_POINTS)), 100000)
                with run.lock:
                    self._json({"run": rid, "curves": {k: run.state.curve(k, points) for k in CURVE_KEYS}})
            elif path == "/api/stream":
                self._stream(rid)
            else:
                self._error(HTTPStatus.NOT_FOUND, "no such endpoint")
        else:
            self._error(HTTPStatus.NOT_FOUND, "no such page")

    # ------------------------------------------------------------------ live
    def _stream(self, rid: str) -> None:
        """Server-sent events: `init` (everything the page needs), then `update`s with what is new."""
        hub, run = self.server.hub, self.server.hub.runs[rid]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        for k, v in SECURITY_HEADERS.items():
            self.send_header(k, v)
        self.send_header("X-Accel-Buffering", "no")
        self.end_headers()
        if self.command == "HEAD":
            return
        gen = hub.generation
        epoch = None
        cursor = log_seq = 0
        last_sent = 0.0
        while not self.server.stopping.is_set() and hub.runs.get(rid) is run:  # ends if the run goes away
            with run.lock:
                now_epoch = (run.events.resets, run.state.rewinds)
                n = len(run.state.steps)
                if epoch != now_epoch or n < cursor:
                    msg = {
                        "status": hub.snapshot(rid),
                        "curves": {k: run.state.curve(k, CURVE_POINTS) for k in CURVE_KEYS},
                        "log": run.log_tail(200),
                        "runs": hub.run_list(),
                    }
                    log_seq = run.log_seq
                    kind = "init"
                    epoch = now_epoch
                else:
                    log_seq, new_lines = run.log_since(log_seq)
                    msg = {
                        "status": hub.snapshot(rid),
                        "points": {k: run.state.curve(k, None, cursor) for k in CURVE_KEYS},
                        "log": new_lines,
                    }
                    kind = "update"
                cursor = n
            if (
                kind == "init"
                or msg["log"]
                or any(msg.get("points", {}).values())
                or time.monotonic() - last_sent >= HEARTBEAT_S
            ):
                msg["runs"] = hub.run_list()
                self.wfile.write(b"event: " + kind.encode() + b"\ndata: " + dumps(msg) + b"\n\n")
                self.wfile.flush()
                last_sent = time.monotonic()
            gen = hub.wait(gen, HEARTBEAT_S)


HOST_HEADER = re.compile(r"(\[[0-9a-f:.]+\]|[a-z0-9.-]+)(?::[0-9]{1,5})?")


def host_name(header: str) -> str:
    """The name part of a Host header: `localhost:8080` -> `localhost`, `[::1]:8080` -> `[::1]`; a header
    that is not strictly HOST[:PORT] (`localhost:evil.com`, `[::1]x`) has no name: ""."""
    m = HOST_HEADER.fullmatch(header.strip().lower())
    return m.group(1) if m else ""


def _int(query: dict[str, list[str]], key: str, default: int) -> int:
    raw = query.get(key, [None])[0]
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{key} must be an integer, not {raw!r}") from None


def serve(
    run_dir: Path,
    host: str = "127.0.0.1",
    port: int = 8080,
    token: str | None = None,
    allow_remote: bool = False,
    thresholds=None,
    poll_s: float = 0.2,
) -> None:
    hub = Hub(run_dir, thresholds, poll_s=poll_s)
    server = MonitorServer(hub, host, port, token, allow_remote)
    runs = ", ".join(sorted(hub.runs))
    print(f"dflash monitor: watching {Path(run_dir).absolute()} (runs: {runs}) on {server.url}", flush=True)
    if not is_loopback(host):
        print("dflash monitor: remote access enabled; open the page with ?token=... once", flush=True)
    try:
        server.serve()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
