"""What the GPU check's stages share: the shapes and recipes of each mode, the scratch run configs,
running one `dflash` verb in its own process group under a time limit, sampling the device's memory
while it runs, and the memory model's prediction for a run config (trainer/layout/sizing.py through
preflight's `estimate_memory`, the model `dflash plan` uses)."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GIB = float(2**30)

# Random-weight targets shaped like the real ones (their config.json's sizes; Qwen3 architecture).
_QWEN3 = {"num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960, "rope_theta": 1e6}
SHAPES: dict[str, dict] = {
    # --quick's: 2.0 B parameters with an untied head (4 GB in bf16), built and saved in seconds
    "qwen3-1.7b": {
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        **_QWEN3,
    },
    "qwen3-8b": {
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        **_QWEN3,
    },
    # 65 GB in bf16: it fits one H200, but its saved folder needs that much disk (--work on a tmpfs)
    "qwen3-32b": {
        "vocab_size": 151936,
        "hidden_size": 5120,
        "intermediate_size": 25600,
        "num_hidden_layers": 64,
        "num_attention_heads": 64,
        **_QWEN3,
    },
    # --cpu-smoke's: head size 64, which vLLM's CPU attention needs (tests/integration/test_vllm_source.py)
    "tiny": {
        "vocab_size": 512,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "max_position_embeddings": 4096,
    },
}


@dataclass(frozen=True)
class Mode:
    """One mode's sizes: the shape, the drafter recipe, steps, eval size and time limits."""

    name: str
    shape: str
    recipe: dict  # draft_layers, block_size, anchors, tokens, chunk_rows
    steps: int  # the hooked stage's; the others run `other_steps`
    other_steps: int
    eval_prompts: int
    eval_tokens: int
    budget_s: float  # stages that would start past it are skipped
    stage_cap_s: float  # one stage's time limit
    min_left_s: float  # a stage starts only with this much of the budget left
    reps: int = 4  # the overhead stage's repetitions
    vllm_memory_fraction: float = 0.4  # target.source vllm: the server's share of the GPU (CUDA)


SEED_RECIPE = {"draft_layers": 5, "block_size": 16, "anchors": 512, "tokens": 4096, "chunk_rows": 2048}
MODES: dict[str, Mode] = {
    # the first call on a lent machine: ~4-5 minutes, a 600-second call's limit with margin
    "quick": Mode(
        "quick",
        "qwen3-1.7b",
        {"draft_layers": 5, "block_size": 16, "anchors": 256, "tokens": 2048, "chunk_rows": 1024},
        steps=8,
        other_steps=6,
        eval_prompts=2,
        eval_tokens=32,
        budget_s=390.0,  # a cold H200 spent 145 s compiling in stage 1; 390: the most a 600-s call holds
        stage_cap_s=150.0,
        min_left_s=45.0,
        reps=3,
    ),
    # the seeds' recipe on a Qwen3-8B shape: the calibration run (a second call, or a rented node)
    "full": Mode(
        "full",
        "qwen3-8b",
        SEED_RECIPE,
        steps=20,
        other_steps=10,
        eval_prompts=4,
        eval_tokens=48,
        budget_s=480.0,
        stage_cap_s=300.0,
        min_left_s=60.0,
    ),
    # the test suite's: every stage on the CPU with a tiny target, kept cheap
    "cpu-smoke": Mode(
        "cpu-smoke",
        "tiny",
        {"draft_layers": 1, "block_size": 4, "anchors": 16, "tokens": 128, "chunk_rows": 16},
        steps=4,
        other_steps=2,
        eval_prompts=2,
        eval_tokens=12,
        budget_s=1800.0,
        stage_cap_s=600.0,
        min_left_s=0.0,
        reps=2,
    ),
}


def log(msg: str) -> None:
    print(f"[gpu-check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def merged(base: dict, extra: dict) -> dict:
    """`base` with `extra` merged in, section by section (a deep copy)."""
    out = copy.deepcopy(base)
    for k, v in extra.items():
        out[k] = merged(out.get(k) or {}, v) if isinstance(v, dict) else v
    return out


@dataclass
class Ctx:
    """What every stage of one shape sees."""

    mode: Mode
    cuda: bool
    work: Path
    shape_name: str
    shape: dict
    target: Path
    data: Path
    deadline: float
    matmul_tflops: float | None
    logs: Path  # each stage's log tail is appended here (comes back with the report)
    done: dict = field(default_factory=dict)  # stage name -> its record, as they finish

    @property
    def recipe(self) -> dict:
        return self.mode.recipe

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def drafter_section(self) -> dict:
        from trainer.preflight.drafter import suggest_aux_ids

        return {
            "num_layers": self.recipe["draft_layers"],
            "block_size": self.recipe["block_size"],
            "aux_layer_ids": suggest_aux_ids(self.shape["num_hidden_layers"], 5),
            "mask_token_id": self.shape["vocab_size"] - 5,
        }

    def run_config(self, name: str, steps: int, extra: dict | None = None) -> Path:
        """A run config for stage `name` (its own out_dir), the mode's recipe with `extra` merged in."""
        import yaml

        raw = {
            "target": {"path": str(self.target)},
            "data": {"path": str(self.data), "max_length": self.recipe["tokens"]},
            "drafter": self.drafter_section(),
            "train": {
                "max_steps": steps,
                "warmup_steps": 1,
                "max_tokens_per_batch": self.recipe["tokens"],
                "max_anchors": self.recipe["anchors"],
                "checkpoint_every": steps,
                "keep_checkpoints": 1,
            },
            "out_dir": str(self.work / name),
        }
        if "optimizer" in self.recipe:  # --optimizer: every training stage's
            raw["train"]["optimizer"] = self.recipe["optimizer"]
        path = self.work / f"{name}.yaml"
        path.write_text(yaml.safe_dump(merged(raw, extra or {})))
        return path


class StageFailed(RuntimeError):
    """A stage's command failed: the message holds its exit code and the end of its log."""


class Skip(Exception):
    """The stage cannot run here; the message says why (a skip, not a failure)."""


class Service:
    """Where the stages run (check.py sets it): `unit` a unit.Unit (each command a transient unit with
    the product's sandbox) or None (outside a unit), `reason` the decision's words."""

    unit = None
    reason = "outside a unit"


def child_env(stage: str) -> dict[str, str]:
    """The stage's processes' environment: the repository on the path, and GPU_CHECK_STAGE naming the
    stage (the suite's import audit tells the stages that need vLLM apart by it)."""
    path = os.pathsep.join(p for p in [str(REPO), os.environ.get("PYTHONPATH", "")] if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", "GPU_CHECK_STAGE": stage}


def _kill_group(proc: subprocess.Popen, grace: float = 20.0) -> None:
    """SIGTERM to the child's process group (the trainer stops its own vLLM server on it), SIGKILL after
    `grace` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def kill_pid_file(path: Path) -> None:
    """End the process group named in a pid file (an owned vLLM server left by a killed trainer)."""
    try:
        pid = int(path.read_text().split()[0])
        os.killpg(pid, signal.SIGKILL)
    except (OSError, ValueError, IndexError):
        pass


def run_logged(
    label: str, cmd: list[str], log_path: Path, timeout: float, sampler: PeakSampler | None = None
) -> str:
    """Run `cmd` in its own process group, its output into `log_path` (named after the stage); the log's
    text. Past `timeout` the group is ended. A non-zero exit raises StageFailed (naming `label`) with
    the log's end."""
    env = child_env(log_path.stem)
    if ZYGOTE.proc is not None:  # --cpu-smoke: forked from the pre-imported interpreter
        rc = ZYGOTE.run(cmd, log_path, env, timeout, sampler)
    else:
        unit = Service.unit
        if unit is not None:  # the product's sandbox and environment (unit.py)
            cmd = unit.wrap(cmd, env, log_path.stem)
        with open(log_path, "wb") as out:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=REPO,
                start_new_session=True,
            )
            if sampler is not None:
                sampler.watch(proc.pid)
            try:
                rc = proc.wait(timeout=max(1.0, timeout))
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                if unit is not None:  # the service itself, not only systemd-run's client
                    unit.stop()
                rc = None
    text = log_path.read_text(errors="replace")
    if rc is None:
        raise StageFailed(
            f"{label} timed out after {timeout:.0f} s (its process group ended):\n{text[-3000:]}"
        )
    if rc != 0:
        raise StageFailed(f"{label} exited {rc}:\n{text[-3000:]}")
    return text


class Zygote:
    """The CPU smoke's launcher (zygote.py): started once, forks each stage's process."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.ready = False
        self.cpu_s = 0.0  # CPU seconds of the children it reaped (not this process's children)
        self._buf = b""

    def start(self) -> None:
        cmd = [sys.executable, str(REPO / "bench" / "gpu" / "zygote.py")]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=child_env("zygote"), cwd=REPO, bufsize=0
        )

    def _answer(self, timeout: float | None) -> dict | None:
        """The zygote's next answer line, None when none came within `timeout` (read from the pipe's
        descriptor with a buffer of our own: a line select() cannot see must not wait)."""
        import select

        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        end = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = None if end is None else max(0.0, end - time.monotonic())
            if not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                raise StageFailed(f"the smoke's launcher (zygote.py) ended, exit {self.proc.wait()}")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def run(self, cmd: list[str], log_path: Path, env: dict, timeout: float, sampler) -> int | None:
        """The command's exit code, None when it was ended past `timeout` (its process group)."""
        assert self.proc is not None and self.proc.stdin is not None
        while not self.ready:  # its imports done
            self.ready = bool((self._answer(None) or {}).get("ready"))
        self.proc.stdin.write((json.dumps({"cmd": cmd, "log": str(log_path), "env": env}) + "\n").encode())
        pid = self._answer(None)["pid"]
        if sampler is not None:
            sampler.watch(pid)
        answer = self._answer(max(1.0, timeout))
        if answer is None:
            for sig, wait in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
                try:
                    os.killpg(pid, sig)
                except ProcessLookupError:
                    break
                answer = self._answer(wait)
                if answer is not None:
                    break
            if answer is None:  # the zygote answers once its child is reaped
                answer = self._answer(None)
            self.cpu_s += answer["cpu_s"]
            return None
        self.cpu_s += answer["cpu_s"]
        return int(answer["rc"])

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
            self.proc = None


ZYGOTE = Zygote()


def dflash_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "trainer.cli", *args]


class PeakSampler:
    """The device's memory in use, sampled every `interval` s while a stage runs: on CUDA everything the
    device holds (`mem_get_info`: every process, the CUDA contexts, this check's own), on the CPU the
    resident memory of the watched process and all its children. `peak_gib` is the largest sample."""

    def __init__(self, cuda: bool, interval: float = 0.2):
        self.cuda, self.interval = cuda, interval
        self.peak = 0
        self._pids: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.baseline = self._sample()  # before the stage: this check's own share (CUDA)

    def watch(self, pid: int) -> None:
        self._pids.append(pid)

    def _sample(self) -> int:
        if self.cuda:
            import torch

            free, total = torch.cuda.mem_get_info()
            return int(total - free)
        import psutil

        used = 0
        for pid in self._pids:
            try:
                p = psutil.Process(pid)
                procs = [p, *p.children(recursive=True)]
            except psutil.Error:
                continue
            for q in procs:
                try:
                    used += q.memory_info().rss
                except psutil.Error:
                    pass
        return used

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self._sample())

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    @property
    def peak_gib(self) -> float | None:
        return round(self.peak / GIB, 3) if self.peak else None


def predict(cfg_path: Path, cuda: bool) -> dict:
    """The memory model's bytes per device for this run config (world size 1), by part, in GiB, and
    what torch's allocator can see of it (all but the runtime reserve: CUDA context, library
    workspaces)."""
    from trainer.config.run import load_config
    from trainer.preflight.machine import estimate_memory
    from trainer.target.info import TargetInfo

    run = load_config(cfg_path)
    parts = estimate_memory(run, TargetInfo.from_folder(run.target.path), cuda, world_size=1)
    total = sum(parts.values()) / GIB
    return {
        "predicted_memory_gib": round(total, 3),
        "predicted_allocated_gib": round(total - parts["runtime_reserve"] / GIB, 3),
        "predicted_by_part_gib": {k: round(v / GIB, 3) for k, v in parts.items()},
    }


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None
