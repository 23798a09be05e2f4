"""Unit tests of salvage's decisions: process classification, how a trainer is asked to stop, the
nvidia-smi compute-apps format, S3 addresses, the prefix table, and the light-side import rule."""

from __future__ import annotations

import pytest

from trainer.s3 import S3Error
from trainer.s3.client import parse_s3_url
from trainer.salvage.inventory import classify, parse_compute_apps
from trainer.salvage.stop import stop_method
from trainer.salvage.verify import prefix_table


@pytest.mark.parametrize(
    ("cmd", "want"),
    [
        (
            ["/venv/bin/python3", "-m", "trainer.cli", "train", "--config", "run.yaml"],
            ("trainer", "dflash train"),
        ),
        (
            ["/venv/bin/python3", "/venv/bin/dflash", "train", "--config", "r.yaml"],
            ("trainer", "dflash train"),
        ),
        (
            [
                "/venv/bin/python",
                "/venv/bin/torchrun",
                "--nproc-per-node",
                "4",
                "-m",
                "trainer.cli",
                "train",
                "--config",
                "r",
            ],
            ("trainer", "torchrun (dflash train)"),
        ),
        (["/venv/bin/torchrun", "--standalone", "other.py"], ("unknown", "torchrun")),
        (
            ["/venv/bin/python3", "/venv/bin/dflash", "monitor", "--runs", "/data"],
            ("monitor", "dflash monitor"),
        ),
        (["python3", "-m", "sglang.launch_server", "--model-path", "Qwen/Qwen3"], ("server", "sglang")),
        (["/usr/bin/vllm", "serve", "Qwen/Qwen3"], ("server", "vllm")),
        (["python", "-m", "vllm.entrypoints.openai.api_server"], ("server", "vllm")),
        (["grep", "sglang"], None),  # mentions a server, is not one
        (["python3", "-c", "print('vllm')"], ("unknown", "python")),
        (["tmux", "new", "-s", "work"], ("session", "tmux")),
        (["SCREEN", "-S", "gen"], ("session", "SCREEN")),
        (["/usr/sbin/sshd", "-D"], None),
    ],
)
def test_classify(cmd, want):
    assert classify(cmd, cmd[0].rsplit("/", 1)[-1]) == want


def test_parse_compute_apps():
    # the documented output of `nvidia-smi --query-compute-apps=pid,process_name,used_gpu_memory,gpu_uuid
    # --format=csv,noheader,nounits` (hand-written sample: no GPU on this machine)
    text = (
        "2211, /usr/bin/python3, 80123, GPU-17921e6c-4ffc-af9b-5119-2d6f4e613a36\n"
        "2212, sglang::scheduler, [N/A], GPU-cc7c6d81-1404-a076-261c-b06db89c4e56\n"
        "No running processes found\n"
    )
    rows = parse_compute_apps(text)
    assert rows == [
        {
            "pid": 2211,
            "name": "/usr/bin/python3",
            "used_mib": 80123.0,
            "gpu": "GPU-17921e6c-4ffc-af9b-5119-2d6f4e613a36",
        },
        {
            "pid": 2212,
            "name": "sglang::scheduler",
            "used_mib": None,
            "gpu": "GPU-cc7c6d81-1404-a076-261c-b06db89c4e56",
        },
    ]


def test_stop_method_follows_how_the_trainer_was_started():
    m = stop_method(10, "0::/system.slice/dflash-train.service\n", {}, None, True, True)
    assert m == {
        "how": "systemd",
        "unit": "dflash-train.service",
        "command": ["systemctl", "stop", "--no-block", "dflash-train.service"],
    }
    env = {
        "SUPERVISOR_PROCESS_NAME": "train",
        "SUPERVISOR_GROUP_NAME": "dflash",
        "SUPERVISOR_SERVER_URL": "unix:///run/sv.sock",
    }
    m = stop_method(10, "0::/user.slice/user-0.slice/session-3.scope\n", env, None, True, True)
    assert m["how"] == "supervisor" and m["command"] == [
        "supervisorctl",
        "-s",
        "unix:///run/sv.sock",
        "stop",
        "dflash:train",
    ]
    m = stop_method(10, "0::/user.slice/user@0.service/app.slice\n", {}, None, True, False)
    assert m == {"how": "signal", "signal_pid": 10}, "a user manager is not the trainer's service"
    parent = [
        "/venv/bin/python",
        "/venv/bin/torchrun",
        "--nproc-per-node",
        "2",
        "-m",
        "trainer.cli",
        "train",
        "--config",
        "r",
    ]
    assert stop_method(10, "", {}, parent, False, False) == {"how": "torchrun", "signal_pid": "parent"}
    assert stop_method(10, "0::/system.slice/x.service", {}, None, False, False) == {
        "how": "signal",
        "signal_pid": 10,
    }


def test_parse_s3_url():
    loc = parse_s3_url("s3://my-bucket/nodes/pro6000/")
    assert (loc.bucket, loc.prefix, loc.key("a/b")) == ("my-bucket", "nodes/pro6000", "nodes/pro6000/a/b")
    assert parse_s3_url("s3://my-bucket").key("x") == "x"
    for bad, why in (
        ("https://b/p", "expected s3://"),
        ("s3:///p", "no bucket"),
        ("s3://B_ad/p", "not a valid bucket"),
        ("s3://bucket/a/../b", "'..'"),
    ):
        with pytest.raises(S3Error, match=why):
            parse_s3_url(bad)


def test_prefix_table():
    objs = [
        {"Key": "p/run/events.jsonl", "Size": 10},
        {"Key": "p/run/checkpoints/step-1/model.safetensors", "Size": 100},
        {"Key": "p/run/checkpoints/step-2/model.safetensors", "Size": 100},
        {"Key": "p/node/facts.json", "Size": 5},
    ]
    assert prefix_table(objs, "p") == [
        {"prefix": "node/", "objects": 1, "bytes": 5},
        {"prefix": "run/", "objects": 1, "bytes": 10},
        {"prefix": "run/checkpoints/", "objects": 2, "bytes": 200},
    ]
