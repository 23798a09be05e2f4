"""The vLLM source's pure parts: document spans of a packed batch, the layer ids a server keeps, the
`vllm serve` command (the CPU connector where there is no CUDA), the request-ahead sampler's resume
position. The server itself is tested for real in tests/integration/test_vllm_source.py."""

import json
from concurrent.futures import Future

import numpy as np
import pytest

from tests.conftest import wait_for
from trainer.data import PackedSampler
from trainer.sources.vllm import PrefetchingSampler, document_spans
from trainer.sources.vllm_server import CPU_CONNECTOR, serve_command, server_layer_ids


def test_document_spans_follow_the_position_resets():
    pos = np.array([0, 1, 2, 0, 1, 0, 1, 2, 3])
    assert document_spans(pos) == [(0, 3), (3, 5), (5, 9)]
    assert document_spans(np.arange(4)) == [(0, 4)]
    with pytest.raises(ValueError, match="position 0"):
        document_spans(np.array([1, 2, 0]))


def test_the_server_keeps_the_aux_ids_then_the_verifiers_last_state():
    assert server_layer_ids([1, 3], 4) == [1, 3, 4]
    assert server_layer_ids([2, 4], 4) == [2, 4], "the last state is already an aux layer: not twice"


def _arg(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def test_the_serve_command_binds_loopback_and_extracts_the_run_layers(tmp_path):
    cpu = serve_command(tmp_path / "m", [1, 3, 4], tmp_path / "hs", port=8123, cpu=True, dtype="float32")
    assert _arg(cpu, "--host") == "127.0.0.1" and _arg(cpu, "--port") == "8123"
    spec = json.loads(_arg(cpu, "--speculative-config"))
    assert spec["method"] == "extract_hidden_states"
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    kv = json.loads(_arg(cpu, "--kv-transfer-config"))
    assert (kv["kv_connector"], kv["kv_connector_module_path"]) == CPU_CONNECTOR
    assert kv["kv_connector_extra_config"]["shared_storage_path"] == str(tmp_path / "hs")
    assert "--kv-cache-memory-bytes" in cpu and "--gpu-memory-utilization" not in cpu
    gpu = serve_command(tmp_path / "m", [1, 3, 4], tmp_path / "hs", port=1, cpu=False, tensor_parallel_size=2)
    kv = json.loads(_arg(gpu, "--kv-transfer-config"))
    assert kv["kv_connector"] == "ExampleHiddenStatesConnector" and "kv_connector_module_path" not in kv
    assert _arg(gpu, "--tensor-parallel-size") == "2" and "--dtype" not in gpu


def _sampler():
    """Twelve samples of 5..16 tokens packed 32 tokens a batch."""
    import datasets

    rng = np.random.default_rng(0)
    rows = [rng.integers(3, 90, size=int(rng.integers(5, 17))).tolist() for _ in range(12)]
    ds = datasets.Dataset.from_dict({"input_ids": rows, "loss_mask": [[1] * len(r) for r in rows]})
    return PackedSampler(ds, np.ones(len(rows), dtype=bool), 32, seed=3)


def test_requests_go_out_ahead_and_a_resume_draws_the_in_flight_batches_again():
    submitted = []

    def submit(b):
        submitted.append(b["input_ids"].tolist())
        f = Future()
        f.set_result(None)
        return f

    plain = _sampler()
    want = [plain.next_batch()["input_ids"].tolist() for _ in range(8)]
    ahead = PrefetchingSampler(_sampler(), 3, submit)
    got = [ahead.next_batch()["input_ids"].tolist() for _ in range(2)]
    assert got == want[:2] and submitted == want[:5], "2 handed out, 3 more requested ahead"
    state = ahead.state_dict()  # what a checkpoint after 2 batches records
    resumed = PrefetchingSampler(_sampler(), 3, submit)
    resumed.load_state_dict(state)
    assert [resumed.next_batch()["input_ids"].tolist() for _ in range(6)] == want[2:8]


def test_a_server_left_behind_by_a_killed_trainer_is_stopped_and_a_reused_pid_never_hit(tmp_path):
    """Real processes: a 'server' with a worker child, orphaned as a trainer killed -9 leaves its own; the
    next start of the run stops both. A pid file whose start time is not the process's is ignored."""
    import subprocess
    import sys

    import psutil

    from trainer.sources.vllm_server import PID_FILE, stop_left_behind

    sleep = "import time; time.sleep(300)"
    code = (
        f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', '{sleep}']); time.sleep(300)"
    )
    pid = int(subprocess.run(["sh", "-c", f'{sys.executable} -c "{code}" >/dev/null 2>&1 & echo $!'],
                             capture_output=True, text=True, check=True).stdout)  # fmt: skip
    server = psutil.Process(pid)
    try:
        assert wait_for(lambda: len(server.children()) == 1)
        worker = server.children()[0]
        assert stop_left_behind(tmp_path) is None, "no pid file: nothing to stop"
        (tmp_path / PID_FILE).write_text(json.dumps({"pid": pid, "started": server.create_time() - 100}))
        assert stop_left_behind(tmp_path) is None and server.is_running(), "another process under that pid"
        (tmp_path / PID_FILE).write_text(json.dumps({"pid": pid, "started": server.create_time()}))
        said = stop_left_behind(tmp_path)
        assert said and f"pid {pid}" in said
        assert not server.is_running() and not worker.is_running()
        assert not (tmp_path / PID_FILE).exists()
    finally:
        for p in [server, *server.children(recursive=True)] if server.is_running() else []:
            p.kill()


@pytest.mark.parametrize(
    ("var", "value", "kept"),
    [
        ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True", None),
        ("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64, expandable_segments:True", "max_split_size_mb:64"),
        ("PYTORCH_ALLOC_CONF", "expandable_segments:True,roundup_power2_divisions:[256:1,512:2]",
         "roundup_power2_divisions:[256:1,512:2]"),
        ("PYTORCH_CUDA_ALLOC_CONF", "garbage_collection_threshold:0.6", "garbage_collection_threshold:0.6"),
    ],
)  # fmt: skip
def test_the_servers_environment_drops_expandable_segments_and_keeps_the_rest(var, value, kept):
    """vLLM 0.32 refuses any KV connector with expandable_segments:True (the unit sets it for the
    trainer): the server's environment leaves it out, keeps the variable's other options, says so."""
    from trainer.sources.vllm_server import server_environment

    base = {"PATH": "/usr/bin", var: value}
    env, said = server_environment(base, {"CUDA_VISIBLE_DEVICES": "3"})
    assert env["CUDA_VISIBLE_DEVICES"] == "3" and env["PATH"] == "/usr/bin"
    assert env.get(var) == kept and base[var] == value, "the trainer's own environment is unchanged"
    if kept == value:
        assert said == []
    else:
        assert len(said) == 1 and var in said[0] and "expandable_segments:True" in said[0]
        assert ("kept: " + kept if kept else "unset") in said[0]


def test_an_owned_server_starts_without_expandable_segments_and_its_log_says_so(tmp_path, monkeypatch):
    """The process OwnedServer starts (a stand-in printing its environment) gets the cleaned one."""
    import sys

    from trainer.sources.vllm_server import OwnedServer

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    code = "import os; print('CONF=' + os.environ.get('PYTORCH_CUDA_ALLOC_CONF', 'unset'))"
    server = OwnedServer([sys.executable, "-c", code], "http://127.0.0.1:9", tmp_path / "s.log")
    server.proc.wait(30)
    server.stop()
    log = (tmp_path / "s.log").read_text()
    assert "CONF=unset" in log and "without PYTORCH_CUDA_ALLOC_CONF expandable_segments:True" in log
    assert server.env_notes and "trainer keeps them" in server.env_notes[0]
