"""Unit tests of salvage's decisions: process classification, how a trainer is asked to stop, the
nvidia-smi compute-apps format, S3 addresses, the prefix table, and the light-side import rule."""

from __future__ import annotations

from pathlib import Path

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
    from trainer.store.manifest import ManifestError, check_manifest

    with pytest.raises(ManifestError, match=why):
        check_manifest({"manifest_version": 1, "files": {rel: {"size": 1, "sha256": SHA}}}, "s3://b/p")


def test_a_manifest_entry_under_a_symlink_entry_or_with_a_bad_entry_is_refused():
    from trainer.store.manifest import ManifestError, check_manifest

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
    from trainer.store.manifest import ManifestError, inside

    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "out").symlink_to(tmp_path)
    assert inside(tmp_path / "root", "a/b.json") == tmp_path / "root" / "a" / "b.json"
    with pytest.raises(ManifestError, match="resolves outside"):
        inside(tmp_path / "root", "out/x.json")


def test_content_digest_names_the_bytes_not_when_or_where():
    from trainer.store.manifest import content_digest

    a = {"created": 1.0, "source": "h:/a", "files": {"x": {"size": 1, "sha256": SHA, "mtime_ns": 5}}}
    b = {"created": 2.0, "source": "h:/b", "set": {"id": "1"}, "files": {"x": {"size": 1, "sha256": SHA}}}
    assert content_digest(a) == content_digest(b)
    c = {"files": {"x": {"size": 1, "sha256": SHA}, "late.txt": {"size": 0, "sha256": SHA}}}
    assert content_digest(c) != content_digest(a)


def _steps(collected="a", pushed="a", verified="a", local="a", sid="S1", where="s3://b/p", **over):
    steps = {
        "stop": {"ok": True},
        "collect": {"manifest_digest": collected, "salvage_id": sid},
        "push": {"ok": True, "manifest_digest": pushed, "s3": "s3://b/p", "salvage_id": sid},
        "verify": {
            "ok": True,
            "manifest_digest": verified,
            "set_digest": local,
            "where": where,
            "salvage_id": sid,
        },
    }
    for step, fields in over.items():
        steps[step] = {**steps[step], **fields} if fields is not None else None
    return {k: v for k, v in steps.items() if v is not None}


def test_the_verdict_wants_collect_push_and_verify_to_name_the_same_set():
    from trainer.salvage.notes import verdict

    assert verdict(_steps(), "a", "S1") == (True, [])
    ok, reasons = verdict(_steps(collected="b"), "b", "S1")  # a file collected after the push
    assert not ok and "describe different sets" in reasons[0] and "collect b" in reasons[0]
    ok, reasons = verdict(_steps(local=None), "a", "S1")  # a verify that never saw the collected set
    assert not ok and "named no manifest digest" in reasons[0]
    ok, reasons = verdict(_steps(), "c", "S1")  # the set changed after collect
    assert not ok and "different sets" in reasons[0]


def test_the_verdict_wants_every_report_of_this_salvage_and_one_s3_address():
    """The review's hole: reports of an earlier salvage (to another prefix) certified a refused one."""
    from trainer.salvage.notes import verdict

    ok, reasons = verdict(_steps(), "a", "S2")  # every report is of salvage S1; S2 is open
    assert not ok and len(reasons) == 3 and all("of an earlier salvage" in r for r in reasons), reasons
    ok, reasons = verdict(_steps(push={"salvage_id": "S0"}), "a", "S1")
    assert not ok and reasons == ["the push report is of an earlier salvage (S0, not S1): run push again"]
    ok, reasons = verdict(_steps(where="s3://b/other"), "a", "S1")  # verified another prefix than pushed
    assert not ok and "different S3 addresses (push s3://b/p, verify s3://b/other)" in reasons[0]
    ok, reasons = verdict(_steps(verify={"where": None}), "a", "S1")
    assert not ok and "named no S3 address" in reasons[0]
    refused = {"ok": False, "refused": "no such bucket", "s3": "s3://nosuchbucket/x", "manifest_digest": None}
    ok, reasons = verdict(_steps(push=refused), "a", "S1")
    assert not ok and reasons == ["push to s3://nosuchbucket/x was refused: no such bucket"]
    ok, reasons = verdict(_steps(), "a", None)  # no salvage was ever started in the set
    assert not ok and "no salvage was started" in reasons[0]
    ok, reasons = verdict(_steps(verify=None), "a", "S1")
    assert not ok and reasons == ["the upload was not verified (no verify report)"]


def test_the_node_can_go_only_once_the_last_push_carried_exactly_these_notes():
    import hashlib

    from trainer.salvage.verdict import notes_in_s3

    written = {"NOTES.md": b"notes", "salvage-report.json": b"{}"}
    recs = {n: {"sha256": hashlib.sha256(b).hexdigest()} for n, b in written.items()}
    assert notes_in_s3(_steps(push={"records": recs}), written, "S1") == []
    assert (
        "S3 does not hold these notes yet (NOTES.md, salvage-report.json)"
        in notes_in_s3(_steps(), written, "S1")[0]
    )  # the push before the notes were written
    old = {**recs, "NOTES.md": {"sha256": hashlib.sha256(b"older notes").hexdigest()}}
    assert "(NOTES.md)" in notes_in_s3(_steps(push={"records": old}), written, "S1")[0]
    failed = _steps(push={"records": recs, "ok": False})  # the final notes push failed (exit 1)
    assert "did not complete in this salvage" in notes_in_s3(failed, written, "S1")[0]
    assert "did not complete" in notes_in_s3(_steps(push={"records": recs}), written, "S2")[0]


def test_begin_moves_the_earlier_salvages_reports_aside_and_keeps_them(tmp_path):
    import json

    from trainer.salvage.session import begin, current_id, previous_reports

    state = tmp_path / ".salvage"
    first = begin(tmp_path)
    assert first["moved_aside"] is None and current_id(tmp_path) == first["id"]
    for step in ("stop", "collect", "push", "verify"):
        (state / f"{step}.json").write_text(json.dumps({"step": step, "salvage_id": first["id"]}))
    second = begin(tmp_path)
    assert second["id"] != first["id"] and current_id(tmp_path) == second["id"]
    assert sorted(p.name for p in state.glob("*.json")) == ["salvage.json"]
    kept = sorted(p.name for p in Path(second["moved_aside"]).iterdir())
    assert kept == ["collect.json", "push.json", "salvage.json", "stop.json", "verify.json"]
    assert previous_reports(tmp_path, "verify") == [Path(second["moved_aside"]) / "verify.json"]


def test_a_stale_pid_start_is_never_proof(tmp_path):
    """The trainer records its pid and /proc start ticks; anything else behind that pid is not it."""
    import subprocess

    from trainer.salvage.proc import identity, same_process, start_ticks
    from trainer.salvage.stop import proven

    me = identity()
    assert me["pid_start"] == start_ticks(me["pid"]) and me["boot_id"]
    assert proven({"pid": me["pid"], "pid_start": me["pid_start"], "boot_id": me["boot_id"]}) == (True, "")
    ok, why = proven({"pid": me["pid"], "pid_start": me["pid_start"] - 1})
    assert not ok and "its pid was reused" in why
    assert not same_process(me["pid"], me["pid_start"], "another-boot")[0]
    # an older run_start without pid_start: only a dflash trainer by its command line could be it
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        ok, why = proven({"pid": sleeper.pid, "time": 4e9})
        assert not ok and "is not a dflash trainer" in why
    finally:
        sleeper.kill()
        sleeper.wait()
    assert proven({"pid": sleeper.pid, "pid_start": 1})[1] == f"pid {sleeper.pid} is gone"


def test_start_ticks_reads_field_22_after_a_command_name_with_spaces_and_parens(tmp_path):
    import subprocess

    from trainer.salvage.proc import start_ticks

    odd = tmp_path / "a b) (c"  # a command name that breaks a naive split of /proc/PID/stat
    odd.symlink_to("/bin/sleep")
    proc = subprocess.Popen([str(odd), "30"])
    try:
        fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        assert start_ticks(proc.pid) == int(fields[19]) > 0
        assert Path(f"/proc/{proc.pid}/stat").read_text().split()[1].startswith("(a")
    finally:
        proc.kill()
        proc.wait()
    assert start_ticks(proc.pid) is None


def test_an_unparseable_events_line_is_skipped_and_named_not_a_failure(tmp_path):
    from trainer.salvage.loadable import check_text_files

    (tmp_path / "events.jsonl").write_text('{"event": "run_start"}\n{not json\n' + "[" * 100000 + "\n{}\n")
    failures, warnings = check_text_files(tmp_path, ["events.jsonl"])
    assert failures == []
    assert warnings == ["events.jsonl: 2 line(s) that are not JSON skipped (line 2, 3)"]
    (tmp_path / "bad.json").write_text("[" * 100000)  # deeply nested: a RecursionError, not a traceback
    failures, _ = check_text_files(tmp_path, ["bad.json"])
    assert failures and failures[0]["path"] == "bad.json"


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


def _role_tasks(name: str) -> list[dict]:
    import yaml

    return yaml.safe_load((Path(__file__).parents[2] / "roles" / "salvage" / "tasks" / name).read_text())


def test_the_roles_verdict_reads_the_final_notes_push_and_the_notes_after_it():
    """The review's hole: the role accepted exit 1 from the final notes push and its verdict read the
    notes written before it, so the play said "can go" while S3 kept earlier notes. The verdict's own
    conditions are evaluated here (jinja2, as Ansible does) over registered results."""
    import json

    import jinja2
    import yaml

    push = _role_tasks("push.yml")
    registered = [t.get("register") for t in push]
    # the verdict's notes are the ones run after the final notes push
    assert registered.index("_salvage_notes") > registered.index("_salvage_push_notes")
    (verdict,) = [t for t in _role_tasks("main.yml") if t.get("name") == "The verdict"]
    conds = verdict["ansible.builtin.assert"]["that"]
    codes = yaml.safe_load((Path(__file__).parents[2] / "roles/salvage/vars/main.yml").read_text())
    env = jinja2.Environment()
    env.filters["from_json"] = json.loads

    def holds(**results) -> bool:
        ctx = {**codes, **results}
        return all(env.from_string("{{ (" + c + ") | string }}").render(ctx) == "True" for c in conds)

    good = {
        "_salvage_stop": {"rc": 0, "stdout": "{}"},
        "_salvage_push": {"rc": 0},
        "_salvage_verify": {"rc": 0},
        "_salvage_push_notes": {"rc": 0, "stderr": ""},
        "_salvage_notes": {"rc": 0, "stdout": json.dumps({"node_can_go": True})},
    }
    assert holds(**good)
    for rc in (1, 2):  # the final notes push failed or was refused: S3 keeps earlier notes
        assert not holds(**{**good, "_salvage_push_notes": {"rc": rc, "stderr": "x"}})
    assert not holds(**{**good, "_salvage_push": {"rc": 1}})
    assert not holds(**{**good, "_salvage_notes": {"rc": 1, "stdout": json.dumps({"node_can_go": False})}})
    fetch_only = {"_salvage_stop": good["_salvage_stop"]}  # no S3: no push ran
    assert holds(**fetch_only)
