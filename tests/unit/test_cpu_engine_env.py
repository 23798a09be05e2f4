"""trainer/vllm_engine.cpu_engine_env, the environment of a vLLM CPU engine's processes.

trainer/amx_site: each process asks Linux for the AMX tile state (vLLM's spawned CPU workers use AMX for
bf16 without asking and die with SIGILL on the first request: seen on a Xeon with amx_tile,
tests/integration/test_vllm_source.py's bf16 case). A fresh Python with the folder on its PYTHONPATH holds
the permission exactly when the CPU has AMX, and the sitecustomize it shadows still runs. The thread count
a service sets is kept (vLLM's default binding replaces it with every core, pinned)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from trainer.vllm_engine import AMX_SITE, cpu_engine_env

# a fresh interpreter's permitted extended features (arch_prctl ARCH_GET_XCOMP_PERM), as a bit mask
READ_PERM = (
    "import ctypes, json; m = ctypes.c_uint64(0); "
    "rc = ctypes.CDLL(None).syscall(158, 0x1022, ctypes.byref(m)); "
    "print(json.dumps({'rc': rc, 'tiles': bool(m.value >> 18 & 1)}))"
)


def cpu_has_amx() -> bool:
    return "amx_tile" in Path("/proc/cpuinfo").read_text().split()


def fresh_python(code: str, env: dict[str, str]) -> str:
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip().splitlines()[-1]


def test_a_process_started_with_the_engine_env_holds_the_amx_tiles_when_the_cpu_has_them(tmp_path):
    env = {**os.environ, **cpu_engine_env(os.environ)}
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(AMX_SITE)
    got = json.loads(fresh_python(READ_PERM, env))
    assert got == {"rc": 0, "tiles": cpu_has_amx()}, got
    plain = json.loads(fresh_python(READ_PERM, {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}))
    assert plain["tiles"] is False, "without the folder no process asks (the state vLLM's workers were in)"


def test_the_sitecustomize_it_shadows_still_runs_and_the_path_is_not_doubled(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import os\nos.environ['THEIRS_RAN'] = '1'\n")
    base = {**os.environ, "PYTHONPATH": os.pathsep.join([str(theirs), str(AMX_SITE)])}
    env = {**base, **cpu_engine_env(base)}
    assert env["PYTHONPATH"].split(os.pathsep) == [str(AMX_SITE), str(theirs)]
    code = "import os, sitecustomize; print(os.environ.get('THEIRS_RAN'), sitecustomize.__file__)"
    ran, first = fresh_python(code, env).split()
    assert ran == "1" and Path(first).parent == AMX_SITE


def test_the_owned_cpu_servers_environment_carries_it(make_config):
    from trainer.config.run import load_config
    from trainer.sources.vllm_server import owned_server_command, server_environment

    cfg = load_config(make_config(), ["target.source=vllm"])
    _, changes, _ = owned_server_command(cfg, port=1)
    env, _ = server_environment(os.environ, changes)
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(AMX_SITE)


def test_a_thread_count_the_environment_sets_is_kept_unless_a_binding_is_asked_for():
    """vLLM's default binding ("auto") sets OMP_NUM_THREADS to every core and pins a thread to each: an
    engine beside a trainer the service gave OMP_NUM_THREADS=1 took both cores of this machine."""
    assert cpu_engine_env({"OMP_NUM_THREADS": "1"})["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in cpu_engine_env({})  # no choice made: vLLM's own default
    mine = {"OMP_NUM_THREADS": "4", "VLLM_CPU_OMP_THREADS_BIND": "0-3"}
    assert "VLLM_CPU_OMP_THREADS_BIND" not in cpu_engine_env(mine)  # the user's binding stands
