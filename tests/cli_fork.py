"""`dflash VERB ...` for a test as a process of its own that does not pay the heavy imports again.

Each heavy verb (train, eval, export, regenerate, preflight, capture, demo) imports torch, transformers
and speculators before its first line of work: ~10 CPU-s a process on the 2-core test machine, paid by
every such subprocess of the suite. A fork server (a "zygote", as gunicorn's `--preload` or Android's)
imports those libraries once per pytest process, then forks one child per command. The command still
runs in a process of its own, with its own pid, exit code, environment, working directory, stdin/stdout/
stderr, default signal handlers, fresh random seeds and the interpreter's exit (threads joined, atexit);
only the libraries' import is inherited.

What an import reads is measured, not assumed: while it imports, the server records every environment
variable the libraries look up (`os.environ`'s `__getitem__`, missing ones included) and who walked the
whole environment. A command is forked only by a server whose recorded variables have the command's
values (plus the prefixes C libraries read when they load: OpenMP, BLAS, the allocator, Python's own);
another environment gets a server of its own, and past `MAX_SERVERS`, or where an unknown library walked
the environment, a plain subprocess. Not forked either: the light verbs (status, salvage, s3, ...: no
heavy import to save) and what a test asks `fork=False` of (a test of what a fresh process imports, of
its start-up, of its command line as `ps` shows it, or of its CPU time as its parent's rusage sees it).

    from tests.cli_fork import run_dflash
    res = run_dflash(["train", "--config", cfg], env=env, timeout=600)   # a subprocess.CompletedProcess
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HEAVY_VERBS = frozenset({"train", "eval", "export", "regenerate", "preflight", "capture", "demo"})
PRELOAD = ("numpy", "torch", "safetensors", "datasets", "transformers", "speculators")
# read by C libraries as they load (libgomp, OpenBLAS, MKL, glibc's allocator, the interpreter): never
# seen by os.environ, so always part of a server's signature
C_PREFIXES = (
    "OMP_",
    "GOMP_",
    "KMP_",
    "MKL_",
    "OPENBLAS_",
    "GOTO",
    "MALLOC_",
    "LD_",
    "PYTHON",
    "CUDA",
    "NVIDIA",
)
# the libraries seen walking the whole environment at import, and the variables each then reads
WALKERS = {"tqdm": "TQDM_", "networkx": "NETWORKX_", "fsspec": "FSSPEC_"}
MAX_SERVERS = 4
SERVER_ENV = "DFLASH_TEST_FORK_SERVER"  # the folder of the server a rank's tests/fork_exec.py asks
_SERVERS: list[_Server] = []


# ------------------------------------------------------------------------------------------------ wire
def _send(sock: socket.socket, obj) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(struct.pack("!I", len(data)) + data)


def _recv(sock: socket.socket):
    head = _recv_exact(sock, 4)
    body = None if head is None else _recv_exact(sock, struct.unpack("!I", head)[0])
    return None if body is None else json.loads(body)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


# ------------------------------------------------------------------------------------------------ client
class _Server:
    """One fork server: its process, its socket, the environment it imported under."""

    def __init__(self, env: dict[str, str], preload: tuple[str, ...]):
        self.env, self.preload = env, preload
        self.dir = Path(tempfile.mkdtemp(prefix="dflash-fork-"))
        self.sock_path, self.ready_path = self.dir / "sock", self.dir / "ready.json"
        (self.dir / "env.json").write_text(json.dumps(env))
        self.proc = subprocess.Popen(
            [sys.executable, __file__, str(self.dir), *preload],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=open(self.dir / "server.log", "wb"),  # noqa: SIM115 (open for the server's life)
            start_new_session=True,
        )
        self.read: dict | None = None

    def ready(self, deadline: float) -> bool:
        """Wait until it has imported; False if it died or took past `deadline`."""
        while self.read is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                return False
            if self.ready_path.exists():
                self.read = json.loads(self.ready_path.read_text())
            else:
                time.sleep(0.05)
        return True

    def serves(self, env: dict[str, str]) -> bool:
        """Whether a command with `env` sees, through this server's imports, what its own would."""
        if self.read is None:
            return env == self.env
        if self.walked_unknown():
            return False
        prefixes = C_PREFIXES + tuple(WALKERS[w] for w in self.read["walked_by"])
        keys = set(self.read["keys"]) | {k for k in (*env, *self.env) if k.startswith(prefixes)}
        return all(env.get(k) == self.env.get(k) for k in keys)

    def walked_unknown(self) -> bool:
        """An unknown library walked the whole environment while this imported: no command is forked by a
        server of these imports (what it read cannot be named), so none is started for them again."""
        return self.read is not None and any(w not in WALKERS for w in self.read["walked_by"])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@atexit.register
def _close_all() -> None:
    for srv in _SERVERS:
        srv.close()


class _Attached(_Server):
    """A server another process started, reached from its folder (`SERVER_ENV`): a rank's view."""

    def __init__(self, folder: str):  # noqa: D107 (no process of its own to start)
        self.dir = Path(folder)
        self.sock_path, self.ready_path = self.dir / "sock", self.dir / "ready.json"
        self.env = json.loads((self.dir / "env.json").read_text())
        self.read = json.loads(self.ready_path.read_text())


def _server_for(env: dict[str, str], preload: tuple[str, ...]) -> _Server | None:
    for srv in _SERVERS:
        if srv.preload == preload and srv.proc.poll() is None and srv.serves(env):
            return srv
    if len(_SERVERS) >= MAX_SERVERS or any(s.preload == preload and s.walked_unknown() for s in _SERVERS):
        return None
    _SERVERS.append(srv := _Server(env, preload))
    return srv


def fork_env(env: dict[str, str], preload=PRELOAD) -> dict[str, str]:
    """`env` for a launcher (torchrun) whose ranks run `-m tests.fork_exec MODULE ARGS`: it names a ready
    server for `env`, through which each rank is forked (tests/fork_exec.py), or none (they exec)."""
    srv = _server_for(dict(env), tuple(preload))
    if srv is None or not srv.ready(time.monotonic() + 300):
        return dict(env)
    return {**env, SERVER_ENV: str(srv.dir)}


def run_dflash(args, *, env=None, cwd=None, timeout: float | None = None, fork: bool = True):
    """`python -m trainer.cli ARGS` with stdout and stderr captured as text: what `subprocess.run(...,
    capture_output=True, text=True, check=False)` returns, and `subprocess.TimeoutExpired` past `timeout`
    (the process killed). Forked from a server for the heavy verbs (`HEAVY_VERBS`) unless `fork=False`."""
    argv = [str(a) for a in args]
    heavy = bool(argv) and argv[0] in HEAVY_VERBS
    preload = PRELOAD if fork and heavy else ()
    return run_module("trainer.cli", argv, env=env, cwd=cwd, timeout=timeout, preload=preload)


def run_module(module: str, args, *, env=None, cwd=None, timeout: float | None = None, preload=PRELOAD):
    """`python -m MODULE ARGS`, forked from a server that imported `preload` first (none: a plain
    subprocess); the result as `run_dflash`'s."""
    argv = [str(a) for a in args]
    env = dict(os.environ if env is None else env)
    cmd = [sys.executable, "-m", module, *argv]
    start = time.monotonic()
    srv = _server_for(env, tuple(preload)) if preload else None
    if srv is None or not srv.ready(start + 300) or not srv.serves(env):
        return subprocess.run(
            cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
        )
    with tempfile.TemporaryDirectory(prefix="dflash-run-") as tmp:
        out, err = Path(tmp) / "out", Path(tmp) / "err"
        with open(os.devnull, "rb") as fin, open(out, "wb") as fout, open(err, "wb") as ferr:
            sock = _start(srv, module, argv, env, cwd, [fin.fileno(), fout.fileno(), ferr.fileno()])
        with sock:
            pid = _recv(sock)["pid"]
            if timeout is not None:
                sock.settimeout(max(0.1, start + timeout - time.monotonic()))
            try:
                status = _recv(sock)
            except TimeoutError:
                os.kill(pid, signal.SIGKILL)
                sock.settimeout(60)
                _recv(sock)
                raise subprocess.TimeoutExpired(cmd, timeout, out.read_bytes(), err.read_bytes()) from None
        code = status["code"] if status else -int(signal.SIGKILL)
        stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
        return subprocess.CompletedProcess(cmd, code, stdout, stderr)


def _start(srv: _Server, module: str, argv: list[str], env: dict, cwd, fds: list[int]) -> socket.socket:
    """Ask `srv` to fork `python -m MODULE ARGV` with `fds` as its stdin, stdout and stderr."""
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(str(srv.sock_path))
    socket.send_fds(sock, [b"f"], fds)
    _send(sock, {"module": module, "argv": argv, "env": env, "cwd": str(cwd or os.getcwd())})
    return sock


# ------------------------------------------------------------------------------------------------ server
def _import_recording(names) -> dict:
    """Import `names`, recording the environment variables read meanwhile and who walked all of them."""
    import importlib
    import traceback

    keys: set[str] = set()
    walked_by: set[str] = set()
    cls = type(os.environ)
    getitem, iterate = cls.__getitem__, cls.__iter__

    def recorded_getitem(self, key):
        keys.add(key)
        return getitem(self, key)

    def recorded_iter(self):
        for frame in reversed(traceback.extract_stack()[:-1]):  # the innermost library walked it
            parts = Path(frame.filename).parts
            if "site-packages" in parts:
                walked_by.add(parts[parts.index("site-packages") + 1].removesuffix(".py"))
                break
        return iterate(self)

    cls.__getitem__, cls.__iter__ = recorded_getitem, recorded_iter
    try:
        for name in names:
            importlib.import_module(name)
        if "transformers" in names:
            from transformers import AutoModelForCausalLM  # noqa: F401  (its models import lazily)
    finally:
        cls.__getitem__, cls.__iter__ = getitem, iterate
    return {"keys": sorted(keys), "walked_by": sorted(walked_by)}


def _serve(folder: str, preload: list[str]) -> None:
    read = _import_recording(preload)
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(f"{folder}/sock")
    srv.listen(16)
    tmp = Path(folder) / "ready.json.tmp"
    tmp.write_text(json.dumps(read))
    tmp.rename(Path(folder) / "ready.json")
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    parent = os.getppid()
    srv.settimeout(2.0)
    while True:
        try:
            conn, _ = srv.accept()
        except TimeoutError:  # the pytest process that started it is gone (killed): so is the server
            if os.getppid() != parent:
                os._exit(0)
            continue
        if os.fork() == 0:
            srv.close()
            try:
                _handle(conn)
            finally:
                os._exit(0)
        conn.close()
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:  # reap the handlers that are done
                pass
        except ChildProcessError:
            pass


def _handle(conn: socket.socket) -> None:
    """One command: fork the process that runs it, tell the client its pid, wait, send its exit status.
    A client gone before the command ends (its test killed, timed out, or a rank's launcher killed it)
    takes the command with it: SIGKILL, as a parent's death would through its pipes."""
    import select

    _, fds, _, _ = socket.recv_fds(conn, 1, 3)
    req = _recv(conn)
    req["fds"] = fds
    pid = os.fork()
    if pid == 0:
        conn.close()
        _run(req)  # never returns
    for fd in fds:  # the command's now: a reader of its pipes sees their end when the command ends
        os.close(fd)
    _send(conn, {"pid": pid})
    pidfd = os.pidfd_open(pid)
    ready, _, _ = select.select([pidfd, conn], [], [])
    if pidfd not in ready:  # the client closed its end: nobody waits for this command any more
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    _send(conn, {"code": os.waitstatus_to_exitcode(status)})


def _run(req: dict) -> None:
    """In the forked child: become the command's process, run `dflash ARGV`, exit as the interpreter does."""
    import io
    import random
    import runpy
    import threading
    import traceback

    code = 1
    try:
        os.setsid()  # a group of its own: a signal to its group reaches it and its children only
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        for fd, theirs in enumerate(req["fds"]):  # the client's stdin, stdout and stderr
            os.dup2(theirs, fd)
            os.close(theirs)
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
        unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
        sys.stdout = io.TextIOWrapper(
            io.FileIO(1, "w", closefd=False), encoding="utf-8", write_through=unbuffered
        )
        sys.stderr = io.TextIOWrapper(
            io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace", write_through=True
        )
        for sig in (signal.SIGTERM, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        random.seed()  # a process of its own draws its own numbers (numpy's global state as a fresh one)
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        sys.argv = ["-m", *req["argv"]]  # runpy puts the module's file first, as `python -m` does
        try:
            runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            if exc.code is None or isinstance(exc.code, int):
                code = exc.code or 0
            else:
                print(exc.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 (what the interpreter prints of an uncaught exception)
            traceback.print_exc()
        threading._shutdown()  # the interpreter's exit: non-daemon threads joined, then atexit
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 (a reader gone: the exit code stands)
                pass
        os._exit(code if isinstance(code, int) else 1)


if __name__ == "__main__":
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # the repository, not tests/, as `-m` would
    _serve(sys.argv[1], sys.argv[2:])
