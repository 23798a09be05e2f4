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


SHA = "0" * 64


@pytest.mark.parametrize(
    ("rel", "why"),
    [
        ("/tmp/x", "unsafe path"),
        ("../../x", "unsafe path"),
        ("a/../../x", "unsafe path"),
        ("a/./b", "unsafe path"),
        ("a//b", "unsafe path"),
        ("a\\..\\b", "unsafe path"),
        ("a\x00b", "unsafe path"),
        ("", "non-empty string"),
    ],
)
def test_a_manifest_path_that_could_leave_its_folder_is_refused(rel, why):
    from trainer.manifest import ManifestError, check_manifest

    with pytest.raises(ManifestError, match=why):
        check_manifest({"manifest_version": 1, "files": {rel: {"size": 1, "sha256": SHA}}}, "s3://b/p")


def test_a_manifest_entry_under_a_symlink_entry_or_with_a_bad_entry_is_refused():
    from trainer.manifest import ManifestError, check_manifest

    files = {"d": {"symlink": "/etc"}, "d/passwd": {"size": 1, "sha256": SHA}}
    with pytest.raises(ManifestError, match="lies under the symlink entry 'd'"):
        check_manifest({"manifest_version": 1, "files": files}, "m")
    for entry in ({"size": True, "sha256": SHA}, {"size": -1, "sha256": SHA}, {"size": 1, "sha256": "ab"}):
        with pytest.raises(ManifestError, match="needs size"):
            check_manifest({"manifest_version": 1, "files": {"a": entry}}, "m")
    with pytest.raises(ManifestError, match="records"):
        check_manifest({"manifest_version": 1, "files": {}, "records": {"../NOTES.md": {}}}, "m")
    ok = {"a/b.bin": {"size": 1, "sha256": SHA}, "ln": {"symlink": "a/b.bin"}}
    assert check_manifest({"manifest_version": 1, "files": ok}, "m")["files"] == ok


def test_inside_refuses_a_path_that_resolves_out_through_a_symlink(tmp_path):
    from trainer.manifest import ManifestError, inside

    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "out").symlink_to(tmp_path)
    assert inside(tmp_path / "root", "a/b.json") == tmp_path / "root" / "a" / "b.json"
    with pytest.raises(ManifestError, match="resolves outside"):
        inside(tmp_path / "root", "out/x.json")


def test_content_digest_names_the_bytes_not_when_or_where():
    from trainer.manifest import content_digest

    a = {"created": 1.0, "source": "h:/a", "files": {"x": {"size": 1, "sha256": SHA, "mtime_ns": 5}}}
    b = {"created": 2.0, "source": "h:/b", "set": {"id": "1"}, "files": {"x": {"size": 1, "sha256": SHA}}}
    assert content_digest(a) == content_digest(b)
    c = {"files": {"x": {"size": 1, "sha256": SHA}, "late.txt": {"size": 0, "sha256": SHA}}}
    assert content_digest(c) != content_digest(a)


def test_the_verdict_wants_collect_push_and_verify_to_name_the_same_set():
    from trainer.salvage.notes import verdict

    def steps(collect, push, verify, local):
        return {
            "stop": {"ok": True},
            "collect": {"manifest_digest": collect},
            "push": {"ok": True, "manifest_digest": push},
            "verify": {"ok": True, "manifest_digest": verify, "set_digest": local},
        }

    assert verdict(steps("a", "a", "a", "a"), "a") == (True, [])
    ok, reasons = verdict(steps("b", "a", "a", "a"), "b")  # a file collected after the push
    assert not ok and "describe different sets" in reasons[0] and "collect b" in reasons[0]
    ok, reasons = verdict(steps("a", "a", "a", None), "a")  # a verify that never saw the collected set
    assert not ok and "named no manifest digest" in reasons[0]
    ok, reasons = verdict(steps("a", "a", "a", "a"), "c")  # the set changed after collect
    assert not ok and "different sets" in reasons[0]


def test_compare_sets_names_every_difference():
    from trainer.salvage.verify import compare_sets

    local = {"files": {"a": {"size": 1, "sha256": SHA}, "late": {"size": 2, "sha256": SHA}}}
    remote = {"files": {"a": {"size": 3, "sha256": SHA}, "gone": {"symlink": "a"}}}
    assert compare_sets(local, remote) == [
        "late: in the collected set, not in S3's manifest",
        "gone: in S3's manifest, not in the collected set",
        "a: S3's manifest says {'size': 3, 'sha256': '" + SHA + "'}, the collected set {'size': 1, "
        "'sha256': '" + SHA + "'}",
    ]
    assert compare_sets(local, local) == []


def test_a_push_refuses_objects_of_another_set_only():
    from trainer.s3.push import SET_META, foreign_owner

    def obj(owner):
        return {"Metadata": {"sha256": SHA, **({SET_META: owner} if owner else {})}}

    assert foreign_owner(None, "mine") is None  # nothing there
    assert foreign_owner(obj("mine"), "mine") is None
    assert foreign_owner(obj("theirs"), "mine") == "theirs"
    assert foreign_owner(obj(None), "mine") == "none"  # not written by a salvage push of this set
    assert foreign_owner(obj(None), None) is None  # a plain folder push over plain objects
    assert foreign_owner(obj("theirs"), None) == "theirs"  # ... never over a salvage set's


def test_repairs_reads_what_the_last_verify_of_that_prefix_found(tmp_path):
    import json

    from trainer.salvage.verify import repairs

    (tmp_path / ".salvage").mkdir()
    rep = {
        "where": "s3://bkt/p",
        "ok": False,
        "missing": ["run/x", "NOTES.md (NoSuchKey)"],
        "differing": [{"path": "run/y", "why": "sha256"}],
        "set_mismatch": ["run/x: in the collected set, not in S3's manifest"],
    }
    (tmp_path / ".salvage" / "verify.json").write_text(json.dumps(rep))
    assert repairs(tmp_path, "s3://bkt/p/") == {"run/x", "NOTES.md", "run/y", "MANIFEST.json"}
    assert repairs(tmp_path, "s3://bkt/other") == set()  # another prefix's verify says nothing here
    (tmp_path / ".salvage" / "verify.json").write_text(json.dumps({**rep, "ok": True}))
    assert repairs(tmp_path, "s3://bkt/p") == set()
