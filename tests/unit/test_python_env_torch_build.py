"""python_env installs the torch (and vLLM) build `dflash gpu decide` chose (roles/python_env/vars/main.yml,
rendered as Ansible would; the decision itself: tests/unit/test_cuda_build.py)."""

import pytest

from tests.unit.test_role_contracts import render_role_var

BASE = {
    "dflash_root": "/opt/dflash",
    "dflash_repo": "/repo",
    "python_env_repo": "/repo",
    "python_env_engine": False,
    "python_env_engine_files": ["requirements/cuda-engine.txt", "requirements/cuda-engine-no-deps.txt"],
    "python_env_kernel_files": [],  # vars/main.yml: requirements/<kind>-kernels.txt where it exists
    "python_env_vllm_version": "0.32.0",  # vars/main.yml reads it from requirements/cuda-engine.txt
}
BUILD = {"action": "install", "kind": "cuda", "tag": "cu126", "pypi": False}


def args(name, **values):
    return render_role_var("python_env", name, {**BASE, "python_env_torch_kind": "cuda", **values})


def test_uv_gets_the_build_as_its_torch_backend():
    assert args("python_env_index_args", python_env_torch_build=BUILD) == ["--torch-backend", "cu126"]
    assert args("python_env_torch_build_args", python_env_torch_build=BUILD) == [
        "--reinstall-package",
        "torch",
    ]


def test_pypi_build_and_cpu_need_no_reinstall():
    pypi = {**BUILD, "tag": "cu130", "pypi": True}
    assert args("python_env_index_args", python_env_torch_build=pypi) == ["--torch-backend", "cu130"]
    assert args("python_env_torch_build_args", python_env_torch_build=pypi) == []
    cpu = {"action": "given", "tag": "cpu", "pypi": False}
    assert args("python_env_torch_build_args", python_env_torch_build=cpu) == []


def test_the_wheel_cache_decides_alone():
    cache = {"python_env_wheel_cache": "/cache", "python_env_torch_build": BUILD}
    assert args("python_env_index_args", **cache) == ["--no-index", "--find-links", "/opt/dflash/wheels"]
    assert args("python_env_torch_build_args", **cache) == []


def test_no_decision_yet_keeps_the_default_index():
    assert args("python_env_index_args") == []
    assert args("python_env_index_args", python_env_torch_backend="cu128") == ["--torch-backend", "cu128"]


@pytest.mark.parametrize("engine", [True, False])
def test_vllm_comes_as_its_cuda_build_with_the_engine(engine):
    got = args(
        "python_env_torch_build_args",
        python_env_torch_build=BUILD,
        python_env_engine=engine,
    )
    vllm = [
        "--reinstall-package",
        "vllm",
        "--find-links",
        "https://github.com/vllm-project/vllm/releases/expanded_assets/v0.32.0",
        "vllm==0.32.0+cu126",
    ]
    assert got == ["--reinstall-package", "torch", *(vllm if engine else [])]


@pytest.mark.parametrize(
    ("run_config", "trackers"),
    [({}, False), ({"report_to": []}, False), ({"report_to": ["wandb", "mlflow"]}, True)],
)
def test_the_trackers_clients_come_with_a_run_config_that_reports_to_them(run_config, trackers):
    """python_env_trackers follows the run config's report_to (preflight refuses a tracker whose client
    is missing, and a node's uv venv has no pip to add it by hand): requirements/trackers.txt is
    resolved with the runtime under its constraints, in the same uv call."""
    cpu = {"python_env_torch_kind": "cpu", "python_env_engine_files": []}
    values = {**BASE, **cpu, "trainer_service_run_config": run_config}
    assert render_role_var("python_env", "python_env_trackers", values) is trackers
    first = render_role_var("python_env", "python_env_install_steps", values)[0]
    assert first[:4] == [
        "-c",
        "/opt/dflash/src/requirements/cpu-constraints.txt",
        "-r",
        "/opt/dflash/src/requirements/runtime.txt",
    ]
    assert (first[4:] == ["-r", "/opt/dflash/src/requirements/trackers.txt"]) is trackers, first
