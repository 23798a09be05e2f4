"""Every bad input is a clear refusal: each case runs `dflash` as a real subprocess and must exit with
its code (2: refused before any work; 1: a fault that is not bad input, such as an unreachable Hub),
print one line naming the cause, show no traceback and leave nothing on disk (issue #33: 14 tracebacks
and 6 silent acceptances in 53 tries; issue #48: 17 more).

Two tables: CASES, picked by hand, and GENERATED, made by walking the `dflash` parser: every argument
of every verb that takes a number gets `nan` and `inf`; every JSON or JSON-lines input (found by its
help or metavar saying JSON, or a MANIFEST) gets `[` * 100000, the wrong shape (a list) and, for prompt
lines, a lone surrogate; every file `--out` (type `out_file`) gets an existing folder; every Hub
`--endpoint` a closed port and a non-URL. A new argument of these kinds is covered without a new line
here. The generated cases run as subprocesses in one thread pool (a module fixture), so the whole set
costs a few seconds of wall time; each still asserts its own result.

The cases are the table "Bad inputs and what dflash says" in docs/troubleshooting.md: a test keeps
the page equal to `render_table()`; `DFLASH_WRITE_DOCS=1 pytest tests/integration/test_bad_inputs.py`
rewrites it after a case is added or a message changes. Only cheap cases (each well under 2 s)."""

from __future__ import annotations

import json
import os
import re
import resource
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "troubleshooting.md"
QWEN = REPO / "tests" / "fixtures" / "targets" / "qwen3.6-27b" / "config.json"
START, END = "<!-- bad-inputs: start (tests/integration/test_bad_inputs.py) -->", "<!-- bad-inputs: end -->"


@dataclass(frozen=True)
class Case:
    input: str  # what was wrong, as the docs table says it
    args: str  # dflash's arguments, shell words; files named here are made by `scratch` below
    message: str  # a part of what dflash prints (stderr; a result's stdout too), as the docs table shows it
    code: int = 2
    pipe: str = ""  # a command stdout is piped into (`true`: the reader is gone at once)
    s3: bool = False  # against the moto S3 server ({s3} in args: its endpoint), run in this process
    env: tuple[tuple[str, str | None], ...] = ()  # environment changes (None: unset)
    names: str = ""  # a word the one line must hold besides `message` (the file or option at fault)
    untouched: str = ""  # a folder the case names that must stay empty (nothing written, no temp file)
    one_line: bool = False  # stderr is exactly one line (the generated cases)
    in_process: bool = False  # refused by argparse: run through `main(argv)` here (no subprocess)


def _id(c: Case) -> str:
    return re.sub(r"[^a-z0-9]+", "-", c.input.lower()).strip("-")


CASES = [
    # the run config
    Case(
        "config file not UTF-8",
        "config --config latin1.yaml",
        "not UTF-8 text (byte 3): save the file as UTF-8",
    ),
    Case("config file is a folder", "config --config adir", "is a folder, not a YAML file"),
    Case("config file missing", "config --config nope.yaml", "run config nope.yaml does not exist"),
    Case("config file empty", "config --config empty.yaml", "target: required key is missing"),
    Case(
        "config file is a YAML list", "config --config list.yaml", "the top level must be a mapping, got list"
    ),
    Case("config YAML broken", "config --config broken.yaml", "not valid YAML"),
    Case(
        "unknown config key", "config --config good.yaml --set train.colour=red", "train.colour: unknown key"
    ),
    Case(
        "`max_steps: 1.0e+15` (a float)",
        "config --config good.yaml --set train.max_steps=1.0e+15",
        "train.max_steps: not a whole number",
    ),
    Case(
        "`max_steps: 10000000000`",
        "config --config good.yaml --set train.max_steps=10000000000",
        "train.max_steps: Input should be less than or equal to 1000000000",
    ),
    Case(
        "`max_steps: 1e30` (YAML reads a string)",
        "config --config good.yaml --set train.max_steps=1e30",
        "train.max_steps: Input should be a valid integer",
    ),
    Case(
        "`block_size: 1000000000000`",
        "config --config good.yaml --set drafter.block_size=1000000000000",
        "drafter.block_size: Input should be less than or equal to 256",
    ),
    Case(
        "`block_size: 16.0` (a float)",
        "config --config good.yaml --set drafter.block_size=16.0",
        "drafter.block_size: not a whole number",
    ),
    Case("`--set` without `=`", "config --config good.yaml --set train", "expected KEY.PATH=VALUE"),
    Case(
        "config file not UTF-8 (train)", "train --config latin1.yaml", "dflash train: latin1.yaml: not UTF-8"
    ),
    # a run config for a target (`dflash init`)
    Case(
        "`init --target` missing", "init --target nope --data d --out r.yaml", "--target nope does not exist"
    ),
    Case(
        "`init --target` a file", "init --target afile --data d --out r.yaml", "is a file, not a model folder"
    ),
    Case(
        "`init --target` a Hub repo id not on this machine",
        "init --target nobody/no-such-model --data d --out r.yaml",
        "no local copy: sync it first with data_sync",
    ),
    Case(
        "`init --target` without config.json",
        "init --target adir --data d --out r.yaml",
        "has no config.json",
    ),
    Case(
        "`init --target` not a causal LM",
        "init --target bert --data d --out r.yaml",
        "names no causal language model",
    ),
    Case(
        "`init --target` config without num_hidden_layers",
        "init --target nolayers --data d --out r.yaml",
        "lacks 'num_hidden_layers'",
    ),
    Case(
        "`init --out` exists",
        "init --target causal --data d --out good.yaml",
        "--out good.yaml exists: pass --force to overwrite it",
    ),
    Case(
        "`init --mask-token-id` the EOS id",
        "init --target causal --data d --out r.yaml --mask-token-id 2",
        "is the target's eos token id",
    ),
    # salvage
    Case(
        "`salvage push --workers 0`",
        "salvage push adir --s3 s3://bucket-x/p --workers 0",
        "--workers: must be at least 1, got 0",
    ),
    Case(
        "`salvage push --chunk-mib 0`",
        "salvage push adir --s3 s3://bucket-x/p --chunk-mib 0",
        "--chunk-mib: a part size is 1 to 5120 MiB, got 0",
    ),
    Case(
        "`salvage push --chunk-mib -1`",
        "salvage push adir --s3 s3://bucket-x/p --chunk-mib -1",
        "--chunk-mib: a part size is 1 to 5120 MiB, got -1",
    ),
    Case(
        "salvage push of a folder that is no set",
        "salvage push adir --s3 s3://bucket-x/p",
        "MANIFEST.json does not exist",
    ),
    Case(
        "`salvage verify --workers 0`",
        "salvage verify --s3 s3://bucket-x/p --workers 0",
        "--workers: must be at least 1, got 0",
    ),
    Case(
        "`salvage collect --keep -1`",
        "salvage collect --run-dir adir --out set --keep -1",
        "--keep: must be 0 or more, got -1",
    ),
    Case(
        "`salvage stop --timeout 0`",
        "salvage stop --run-dir adir --timeout 0",
        "--timeout: must be above 0 seconds, got 0",
    ),
    Case(
        "salvage collect of a missing run",
        "salvage collect --run-dir nope --out set",
        "run folder nope does not exist",
    ),
    Case("salvage stop of a folder that is no run", "salvage stop --run-dir adir", "not a dflash run folder"),
    Case("salvage notes before collect", "salvage notes adir", "adir/.salvage/ does not exist"),
    Case("an S3 URL that is not s3://", "s3 push adir http://x", "expected s3://BUCKET/PREFIX"),
    # watching a run
    Case(
        "`monitor --port 70000`",
        "monitor --run-dir adir --port 70000",
        "--port: a TCP port is 0 to 65535, got 70000",
    ),
    Case(
        "`monitor --port -1`", "monitor --run-dir adir --port=-1", "--port: a TCP port is 0 to 65535, got -1"
    ),
    Case("`monitor --run-dir` a file", "monitor --run-dir afile", "--run-dir afile is a file"),
    Case(
        "monitor token too short",
        "monitor --run-dir adir --token-file afile",
        "the token must be at least 16 characters",
    ),
    Case(
        "`monitor --stall-factor inf`",
        "monitor --run-dir adir --stall-factor inf",
        "'inf' is not a finite number",
    ),
    Case(
        "`status --interval 0`",
        "status --run-dir adir --interval 0",
        "--interval: must be above 0 seconds, got 0",
    ),
    Case("`summary --run-dir` missing", "summary --run-dir nope", "nope is not a folder"),
    Case("`summary --run-dir` with no events", "summary --run-dir adir", "events.jsonl is missing or empty"),
    Case(
        'an event line `"step": "abc"` (summary goes on)',
        "summary --run-dir badrun",
        "line skipped: `step` is 'abc'",
        code=0,
    ),
    Case(
        'an event line `"step": 2147483648` (a wide step)',
        "summary --run-dir widerun",
        "progress step 2147483649/2147483653",
        code=0,
    ),
    Case(
        "monitor token file not UTF-8",
        "monitor --run-dir adir --token-file binary.dat",
        "cannot read --token-file: 'utf-8' codec can't decode",
    ),
    # planning, manifests, GPU facts, prompts
    Case(
        "recon facts not UTF-8",
        f"plan --target-config {QWEN} --facts binary.dat",
        "recon facts binary.dat: 'utf-8' codec can't decode",
    ),
    Case(
        "prompt file not UTF-8",
        f"regenerate --target {QWEN.parent} --prompts binary.dat --out regen",
        "binary.dat: not UTF-8 text (byte 0)",
    ),
    Case(
        "`plan` piped into `head` (the reader goes away)",
        f"plan --target-config {QWEN} --gpu H200 --gpu-count 8",
        "",
        0,
        "true",
    ),
    Case(
        "`plan --gpu-count 0`",
        f"plan --target-config {QWEN} --gpu H200 --gpu-count 0",
        "--gpu-count: must be at least 1, got 0",
    ),
    Case(
        "`plan --samples nan`",
        f"plan --target-config {QWEN} --gpu H200 --gpu-count 8 --samples nan",
        "'nan' is not a whole number",
    ),
    Case(
        "target config not JSON",
        "plan --target-config notjson.json --gpu H200 --gpu-count 8",
        "is not readable JSON",
    ),
    Case(
        "target config a JSON list",
        "plan --target-config list.json --gpu H200 --gpu-count 8",
        "is not a JSON object",
    ),
    Case("manifest not JSON", "manifest verify adir notjson.json", "manifest notjson.json is not valid JSON"),
    Case("manifest a JSON list", "manifest verify adir list.json", "manifest list.json:"),
    Case("manifest missing", "manifest verify adir nope.json", "manifest nope.json does not exist"),
    Case("`manifest create -o` a folder", "manifest create adir -o adir", "-o/--output: adir is a folder"),
    Case("manifest of a missing folder", "manifest create nope -o m.json", "nope is not a folder"),
    Case(
        "S3 manifest not JSON",
        "s3 pull s3://bad-inputs/notjson dest --endpoint-url {s3}",
        "manifest s3://bad-inputs/notjson/MANIFEST.json is not valid JSON",
        s3=True,
    ),
    Case(
        "S3 manifest not UTF-8",
        "s3 pull s3://bad-inputs/latin dest --endpoint-url {s3}",
        "manifest s3://bad-inputs/latin/MANIFEST.json is not valid JSON",
        s3=True,
    ),
    Case(
        "S3 manifest a JSON list",
        "s3 pull s3://bad-inputs/list dest --endpoint-url {s3}",
        "manifest s3://bad-inputs/list/MANIFEST.json: expected manifest_version 1",
        s3=True,
    ),
    Case(
        "S3 manifest not JSON (`salvage verify`)",
        "salvage verify --s3 s3://bad-inputs/notjson --endpoint-url {s3} --no-load",
        "manifest s3://bad-inputs/notjson/MANIFEST.json is not valid JSON",
        s3=True,
    ),
    Case(
        "S3 manifest a JSON list (`salvage verify`)",
        "salvage verify --s3 s3://bad-inputs/list --endpoint-url {s3} --no-load",
        "manifest s3://bad-inputs/list/MANIFEST.json: expected manifest_version 1",
        s3=True,
    ),
    Case(
        "S3 prefix without a manifest",
        "s3 pull s3://bad-inputs/none dest --endpoint-url {s3}",
        "s3://bad-inputs/none/MANIFEST.json does not exist",
        s3=True,
    ),
    Case(
        "`s3 pull --bwlimit-kbps -5`",
        "s3 pull s3://bucket-x/p adir --bwlimit-kbps -5",
        "--bwlimit-kbps: must be 0 or more, got -5",
    ),
    Case("GPU facts not JSON", "gpu decide --facts notjson.json", "notjson.json: not JSON"),
    Case("`demo --steps 0`", "demo --steps 0", "--steps: must be at least 1, got 0"),
    # issue #48
    Case(
        "`demo --out` a folder that is not a demo's",
        "demo --tiny --prepare-only --out causal",
        "is not empty and not a demo's folder",
    ),
    Case(
        "`serve-target --host 0.0.0.0` (no --allow-remote)",
        "serve-target --config good.yaml --host 0.0.0.0 --print-command",
        "--host 0.0.0.0: refusing a non-loopback address",
    ),
    Case(
        "`export --push-to-hub` with the Hub unreachable (`HF_ENDPOINT` a closed port)",
        "export --checkpoint ck --out export --push-to-hub me/drafter --token-file hub.token",
        "the Hub at http://127.0.0.1:9 did not answer: ConnectError",
        code=1,
        env=(("HF_HUB_OFFLINE", None), ("HF_ENDPOINT", "http://127.0.0.1:9")),
        one_line=True,
    ),
    Case(
        "`export --push-to-hub` with `HF_ENDPOINT` not a URL",
        "export --checkpoint ck --out export --push-to-hub me/drafter --token-file hub.token",
        "HF_ENDPOINT 'nohost': expected http(s)://HOST[:PORT]",
        env=(("HF_HUB_OFFLINE", None), ("HF_ENDPOINT", "nohost")),
        one_line=True,
    ),
    Case("`eval --limit 0`", "eval --limit 0", "--limit: must be at least 1, got 0"),
]


# ---------------------------------------------------------------- the cases generated from the parser

DEEP = "DEEP_JSON"  # in args: `[` * 100000 as one argument (run_case puts it there)
NUMBER_TYPES = {
    "positive",
    "count",
    "port",
    "chunk_mib",
    "seconds",
    "nonnegative",
    "above_zero",
    "int",
    "_checks",
}
# the context a verb needs to reach the argument under test ({arg}: where it goes); default "{arg}"
CONTEXT = {
    "eval": "--drafter adir --target causal --out r.json {arg}",
    "regenerate": f"--target {QWEN.parent} --out regen {{arg}}",
    "prompts": "listrow.jsonl --format prompt {arg}",
    "prompts input": "{arg} --format prompt --out p.jsonl",
    "plan": f"--target-config {QWEN} {{arg}}",
    "plan --target-config": "--gpu H200 --gpu-count 8 {arg}",
    "manifest verify": "adir {arg}",
    "service sandbox": "--facts-json {{}} {arg}",
    "service sandbox --facts": "{arg}",
    "service sandbox --facts-json": "{arg}",
    "salvage verify": "--s3 s3://bucket-x/p {arg}",
    "capture": "--config good.yaml {arg}",
    "init": "--target causal --data d {arg}",
    "hub pull": "hf://nobody/model hub-dest {arg}",
}
# `--out`-like arguments that name a folder (not a file): the existing-folder case does not apply
FOLDER_OUTS = {
    "demo --out",  # the demo's own folder (refused when not a demo's: a hand case)
    "export --out",  # a new folder (must not exist)
    "regenerate --out",  # a datasets.save_to_disk folder
    "salvage inventory --out",
    "salvage stop --out",
    "salvage collect --out",
    "salvage verify --out",
    "salvage all --out",
    "init --out-dir",
}


def _arguments():
    """(verb words, action) for every argument of every `dflash` verb."""
    import argparse

    from trainer.cli import build_parser

    def walk(parser, words):
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if subs:
            for name, sp in subs[0].choices.items():
                yield from walk(sp, [*words, name])
            return
        for a in parser._actions:
            if not isinstance(a, argparse._HelpAction):
                yield " ".join(words), a

    return list(walk(build_parser(), []))


def _name(action) -> str:
    return action.option_strings[-1] if action.option_strings else action.dest


def _json_input(action) -> str:
    """'file' or 'text' when the argument reads JSON (its help or metavar says so), else '' (a flag such
    as --json, or a file it writes)."""
    help_, metavar = (action.help or ""), str(action.metavar or "")
    if action.nargs == 0 or getattr(action.type, "__name__", "") == "out_file":
        return ""
    if metavar == "JSON" or help_.startswith("JSON of"):
        return "text"
    if "JSON" in help_ or "JSON" in metavar or metavar == "MANIFEST":
        return "file"
    if metavar == "FILE" and "config.json" in help_:  # plan --target-config (not a model name or folder)
        return "file"
    return ""


def _argv(verb: str, action, value: str) -> str:
    arg = f"{_name(action)} {value}" if action.option_strings else value
    context = CONTEXT.get(f"{verb} {_name(action)}", CONTEXT.get(verb, "{arg}"))
    return f"{verb} {context.format(arg=arg)}"


def generated_cases() -> list[Case]:
    cases = []
    for verb, a in _arguments():
        name, kind = _name(a), getattr(a.type, "__name__", "")
        where = f"`{verb} {name}`"
        if kind in NUMBER_TYPES and a.option_strings:
            for bad in ("nan", "inf"):
                cases.append(
                    Case(
                        f"{where} {bad}",
                        _argv(verb, a, bad),
                        f"argument {'/'.join(a.option_strings)}",
                        names=bad,
                        one_line=True,
                        in_process=True,
                    )
                )
        json_kind = _json_input(a)
        if json_kind:
            prompts = "JSON lines" in (a.help or "")
            deep, shape = ("deep.jsonl", "listrow.jsonl") if prompts else ("deep.json", "list.json")
            if json_kind == "text":  # the wrong shape: a list, or an object where a list is wanted
                deep, shape = DEEP, ('{"a":1}' if "JSON list" in (a.help or "") else "[1,2]")

            def said(f: str, name: str = name, text: bool = json_kind == "text") -> str:
                return name if text else f"{f}|{name}"  # the file, or the option that named it

            cases.append(
                Case(
                    f"{where} nested 100000 deep",
                    _argv(verb, a, deep),
                    "nested too deeply",
                    names=said(deep),
                    one_line=True,
                )
            )
            cases.append(
                Case(f"{where} a JSON list", _argv(verb, a, shape), "", names=said(shape), one_line=True)
            )
            if prompts:
                cases.append(
                    Case(
                        f"{where} a lone surrogate (`\\ud800`)",
                        _argv(verb, a, "surrogate.jsonl"),
                        "a lone surrogate \\ud800",
                        names="surrogate.jsonl",
                        one_line=True,
                    )
                )
        if kind == "out_file":
            cases.append(
                Case(
                    f"{where} an existing folder",
                    _argv(verb, a, "emptydir"),
                    f"argument {'/'.join(a.option_strings)}: emptydir is a folder",
                    untouched="emptydir",
                    one_line=True,
                    in_process=True,
                )
            )
        if a.dest == "endpoint":  # the Hub's (S3's is --endpoint-url)
            off = (("HF_HUB_OFFLINE", None),)
            cases.append(
                Case(
                    f"{where} a closed port (the Hub unreachable)",
                    _argv(verb, a, "http://127.0.0.1:9"),
                    "did not answer: ConnectError",
                    code=1,
                    env=off,
                    names="http://127.0.0.1:9",
                    one_line=True,
                )
            )
            cases.append(
                Case(
                    f"{where} not a URL",
                    _argv(verb, a, "nohost"),
                    "expected http(s)://HOST[:PORT]",
                    env=off,
                    one_line=True,
                )
            )
    return cases


GENERATED = generated_cases()


def scratch(d: Path) -> None:
    """The files the cases name, in their working folder."""
    (d / "good.yaml").write_text(
        "target: {path: /nonexistent/target}\ndata: {path: /nonexistent/data}\n"
        "drafter: {aux_layer_ids: [1, 2], mask_token_id: 0}\nout_dir: out\n"
    )
    (d / "latin1.yaml").write_bytes(b"caf\xe9: 1\n")
    (d / "empty.yaml").write_text("")
    (d / "list.yaml").write_text("- a\n- b\n")
    (d / "broken.yaml").write_text("target: {path: [\n")
    (d / "notjson.json").write_text("not json\n")
    (d / "list.json").write_text("[1, 2]\n")
    (d / "afile").write_text("x\n")
    (d / "binary.dat").write_bytes(b"\xff\xfe\x00garbage")
    (d / "adir").mkdir()
    (d / "emptydir").mkdir()
    (d / "deep.json").write_text("[" * 100_000)
    (d / "deep.jsonl").write_text("[" * 100_000 + "\n")
    (d / "listrow.jsonl").write_text("[1, 2]\n")
    (d / "surrogate.jsonl").write_text('{"prompt": "\\ud800 hello"}\n')
    (d / "ck").mkdir()
    (d / "export").mkdir()
    export_info = {"source": str((d / "ck").resolve()), "verifier": "org/target", "block_size": 8}
    (d / "export" / "dflash_export.json").write_text(json.dumps(export_info))
    (d / "hub.token").write_text("hf_" + "x" * 30 + "\n")
    shape = {"hidden_size": 64, "num_attention_heads": 4, "vocab_size": 512, "eos_token_id": 2}
    for name, conf in (
        ("bert", {"architectures": ["BertModel"], "num_hidden_layers": 2, **shape}),
        ("nolayers", {"architectures": ["LlamaForCausalLM"], **shape}),
        ("causal", {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 4, **shape}),
    ):
        (d / name).mkdir()
        (d / name / "config.json").write_text(json.dumps(conf))
    for name, steps in (("badrun", ["abc", 7]), ("widerun", [2**31, 2**31 + 1])):
        lines = [{"event": "run_start", "time": 1.0, "run_id": "r", "totals": {"total_steps": 2**31 + 5}}] + [
            {
                "event": "step",
                "time": 2.0 + i,
                "run_id": "r",
                "step": s,
                "total_steps": 2**31 + 5,
                "loss": 1.0,
            }
            for i, s in enumerate(steps)
        ]
        (d / name).mkdir()
        (d / name / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("bad-inputs")
    scratch(d)
    return d


@pytest.fixture(scope="module")
def s3_server():
    """moto with the bucket `bad-inputs`: manifests that are not JSON, not UTF-8, a JSON list."""
    from tests.s3servers import MotoServer, client

    server = MotoServer().start()
    c = client(server.endpoint_url)
    c.create_bucket(Bucket="bad-inputs")
    for prefix, body in (("notjson", b"not json"), ("latin", b"\xff\xfe"), ("list", b"[1, 2]")):
        c.put_object(Bucket="bad-inputs", Key=f"{prefix}/MANIFEST.json", Body=body)
    yield server
    server.stop()


def run_in_process(case: Case, cwd: Path, endpoint: str, monkeypatch, capsys) -> tuple[int, str]:
    """An S3 case through `trainer.cli.main` here (a subprocess would spend seconds importing boto3):
    an exception that escapes fails the test as a traceback would."""
    from tests.s3servers import s3_env
    from trainer.cli import main

    monkeypatch.chdir(cwd)
    for key in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(key)
    for key, value in s3_env({}).items():
        monkeypatch.setenv(key, value)
    try:
        code = main(shlex.split(case.args.format(s3=endpoint)))
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


def run_case(case: Case, cwd: Path) -> subprocess.CompletedProcess:
    words = [("[" * 100_000 if w == DEEP else w) for w in shlex.split(case.args)]
    argv = [sys.executable, "-m", "trainer.cli", *words]
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "COLUMNS": "200"}
    for key, value in case.env:
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    if case.pipe:  # the first command's status, as `set -o pipefail` would see it
        script = f"{shlex.join(argv)} | {case.pipe}; exit ${{PIPESTATUS[0]}}"
        return subprocess.run(
            ["bash", "-c", script], cwd=cwd, env=env, capture_output=True, text=True, timeout=30
        )
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_bad_input_is_a_clear_refusal(case, workdir, request, monkeypatch, capsys):
    if case.s3:
        endpoint = request.getfixturevalue("s3_server").endpoint_url
        code, err = run_in_process(case, workdir, endpoint, monkeypatch, capsys)
        assert code == case.code and case.message in err and "Traceback" not in err, (code, err)
        assert f"dflash {case.args.split()[0]}" in err
        return
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    res = run_case(case, workdir)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    # the refusal's own CPU (user + system), not the wall clock: the suite's other lanes share the cores
    took = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert "Traceback" not in res.stderr and "Traceback" not in res.stdout, res.stderr[-3000:]
    assert res.returncode == case.code, (res.returncode, res.stderr[-2000:])
    said = res.stderr if case.code else res.stderr + res.stdout  # a result (exit 0) may be on stdout
    assert case.message in said, said[-2000:]
    if case.pipe:
        assert res.stderr == "", res.stderr  # the reader went away: nothing to say
    elif case.code == 2:
        assert f"dflash {case.args.split()[0]}" in res.stderr  # the verb names itself
    assert took < 5, f"{took:.1f} CPU-s: a bad-input case must stay cheap"
    check_one_line_and_nothing_left(case, res, workdir)


def check_one_line_and_nothing_left(case: Case, res, cwd: Path) -> None:
    if case.one_line:
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1, res.stderr[-3000:]
        assert lines[0].startswith(f"dflash {case.args.split()[0]}"), lines
    if case.names:  # the file or option at fault (`A|B`: either)
        assert any(n in res.stderr for n in case.names.split("|")), res.stderr[-2000:]
    if case.untouched:
        assert list((cwd / case.untouched).iterdir()) == [], f"{case.untouched} was written into"
    left = [p.name for p in cwd.iterdir() if p.name.endswith((".tmp", ".part")) or ".tmp." in p.name]
    assert not left, f"temp files left: {left}"


@pytest.fixture(scope="module")
def generated_results(workdir):
    """Every generated case, run as a subprocess, four at a time: {case: (result, seconds)}."""
    from concurrent.futures import ThreadPoolExecutor

    def one(case):
        t0 = time.monotonic()
        res = run_case(case, workdir)
        return case, (res, time.monotonic() - t0)

    t0 = time.monotonic()
    results = {c: (parse_in_process(c, workdir), 0.0) for c in GENERATED if c.in_process}
    with ThreadPoolExecutor(4) as pool:
        results.update(pool.map(one, [c for c in GENERATED if not c.in_process]))
    took = time.monotonic() - t0
    inside = sum(c.in_process for c in GENERATED)
    print(f"\n{len(GENERATED)} generated cases ({inside} in process) in {took:.1f} s")
    return results


def parse_in_process(case: Case, cwd: Path) -> subprocess.CompletedProcess:
    """A case argparse refuses, through `trainer.cli.main` in this process: the same stderr and exit
    code as the subprocess, without its ~0.3 s start (no handler runs: nothing to leak between cases)."""
    import contextlib
    import io

    from trainer.cli import main

    err, out = io.StringIO(), io.StringIO()
    here = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            try:
                code = main(shlex.split(case.args))
            except SystemExit as exc:
                code = exc.code
    finally:
        os.chdir(here)
    return subprocess.CompletedProcess(case.args, code, out.getvalue(), err.getvalue())


@pytest.mark.parametrize("case", GENERATED, ids=[_id(c) for c in GENERATED])
def test_generated_bad_input_is_one_clear_line(case, generated_results, workdir):
    res, took = generated_results[case]
    said = res.stderr + res.stdout
    assert "Traceback" not in said, res.stderr[-3000:]
    assert res.returncode == case.code, (res.returncode, res.stderr[-2000:])
    assert case.message in res.stderr, res.stderr[-2000:]
    check_one_line_and_nothing_left(case, res, workdir)
    assert took < 10, f"{took:.1f} s (four at a time): a bad-input case must stay cheap"


def test_the_walk_finds_every_kind_of_argument():
    """The generator is not vacuous: it found the numbers, the JSON inputs, the file outs and the Hub
    endpoint of the verbs this issue names, and every `--out`-like argument is a file out (refused as
    a folder by argparse) or a folder out on purpose."""
    made = {c.args.split(" DEEP_JSON")[0] for c in GENERATED}
    for needle in (
        "gpu facts --expected",
        "plan --target-config",
        "gpu decide --facts",
        "manifest verify adir",
        "hub pull hf://nobody/model hub-dest --endpoint",
        "capture --config good.yaml --out emptydir",
        "prompts listrow.jsonl --format prompt --out emptydir",
        "prompts surrogate.jsonl",
        "eval --drafter adir --target causal --out r.json --prompts surrogate.jsonl",
        "monitor --stall-factor nan",
    ):
        assert any(needle in m for m in made), needle
    for verb, a in _arguments():
        name = _name(a)
        if name in ("--out", "-o", "--output", "--report", "--out-dir"):
            kind = getattr(a.type, "__name__", "")
            assert kind == "out_file" or f"{verb} {name}" in FOLDER_OUTS, f"{verb} {name}: type {kind}"


def render_table(cases: list[Case] = CASES + GENERATED) -> str:
    """The docs table: input, exit code, what dflash says."""

    def code(text: str) -> str:
        return f"`` {text} ``" if "`" in text else f"`{text}`"

    rows = ["| input | exit | dflash says |", "| --- | --- | --- |"]
    for c in cases:
        if c.message:
            said = code(c.message)
        elif c.names:
            said = f"one line naming {code(c.names)}"
        else:
            said = "nothing (stdout closed: quiet)"
        rows.append(f"| {c.input} | {c.code} | {said} |")
    return "\n".join([START, *rows, END])


def test_troubleshooting_page_holds_the_table_of_these_cases():
    text = PAGE.read_text()
    table = render_table()
    if os.environ.get("DFLASH_WRITE_DOCS") == "1":
        if START in text:
            text = text[: text.index(START)] + table + text[text.index(END) + len(END) :]
        else:
            text = text.rstrip("\n") + "\n\n## Bad inputs and what dflash says\n\n" + table + "\n"
        PAGE.write_text(text)
    assert table in text, "docs/troubleshooting.md: rerun with DFLASH_WRITE_DOCS=1 to regenerate the table"
