"""Named benchmark sets fetched from the Hub (`dflash eval --prompts gsm8k|mt-bench`) and
`dflash export --push-to-hub`, against a local stand-in for the Hugging Face Hub (tests/hubserver.py).

The internet is the one thing that cannot run here: the stand-in serves two tiny benchmark files in
the real repos' layout and columns (GSM8K's test parquet, MT-Bench's raw/question.jsonl) and takes
the upload. huggingface_hub, the verbs, the evaluation and the export are the real ones. The
stand-in speaks Git LFS, not Xet, so the client runs with HF_HUB_DISABLE_XET=1 (the Hub takes both).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hubserver import COMMIT, HubStandIn

pytestmark = pytest.mark.slow

DFLASH = [sys.executable, "-m", "trainer.cli"]
GSM8K, MT_BENCH, REPO = "openai/gsm8k", "HuggingFaceH4/mt_bench_prompts", "me/tiny-dflash"
TOKEN = "hf_write_token_for_the_stand_in"
GSM8K_FILE = "main/test-00000-of-00001.parquet"
MT_ROWS = [
    {"question_id": 81, "category": "writing", "prompt": ["w12 w13 w14 w15", "w16 w17"], "reference": []},
    {"question_id": 82, "category": "math", "prompt": ["w30 w31 w32", "w33"], "reference": ["w34"]},
]


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("hub-sets")
    (root / "gsm8k" / "main").mkdir(parents=True)
    questions = ["w5 w9 w11 w40 w7 w8", "w100 w3 w8 w21 w60"]
    pq.write_table(
        pa.table({"question": questions, "answer": ["#### 1", "#### 2"]}), root / "gsm8k" / GSM8K_FILE
    )
    (root / "mt" / "raw").mkdir(parents=True)
    (root / "mt" / "raw" / "question.jsonl").write_text("".join(json.dumps(r) + "\n" for r in MT_ROWS))
    with HubStandIn() as srv:
        srv.add_folder(GSM8K, root / "gsm8k", repo_type="dataset")
        srv.add_folder(MT_BENCH, root / "mt", repo_type="dataset")
        srv.token = TOKEN
        yield srv, root


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hf-home")


def env(srv: HubStandIn, hf_home: Path, **extra) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}  # conftest sets HF_HUB_OFFLINE
    out |= {
        "HF_HOME": str(hf_home),
        "HF_ENDPOINT": srv.endpoint,
        "HF_TOKEN": TOKEN,
        "HF_HUB_DISABLE_XET": "1",
    }
    out |= {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return {k: v for k, v in (out | extra).items() if v is not None}


def dflash(e: dict[str, str], *args, rc: int = 0) -> subprocess.CompletedProcess:
    res = subprocess.run([*DFLASH, *map(str, args)], env=e, capture_output=True, text=True, timeout=300)
    assert res.returncode == rc, res.stdout[-3000:] + res.stderr[-3000:]
    return res


def test_named_sets_are_fetched_cached_and_hashed(hub, hf_home, tmp_path):
    srv, root = hub
    code = (
        "import json; from trainer.eval import prompts as P; "
        "print(json.dumps([[x.kind, x.value] for x in P.read_prompt_file('mt-bench')])); "
        "print(json.dumps(P.describe_prompts('mt-bench')))"
    )
    for offline in (None, "1"):  # fetched online, then read from the cache with the Hub off
        res = subprocess.run(
            [sys.executable, "-c", code],
            env=env(srv, hf_home, HF_HUB_OFFLINE=offline),
            capture_output=True,
            text=True,
        )
        assert res.returncode == 0, res.stderr
        lines, info = map(json.loads, res.stdout.splitlines())
        assert lines == [["prompt", r["prompt"][0]] for r in MT_ROWS]  # the first turn of each question
        assert info == {
            "name": "mt-bench",
            "sha256": hashlib.sha256((root / "mt" / "raw" / "question.jsonl").read_bytes()).hexdigest(),
            "source": f"hf://datasets/{MT_BENCH}@{COMMIT}/raw/question.jsonl",
        }
    # offline with an empty cache: refused before any model loads
    res = dflash(
        env(srv, tmp_path / "empty-hf-home", HF_HUB_OFFLINE="1"),
        *(
            "eval",
            "--drafter",
            tmp_path,
            "--target",
            tmp_path,
            "--prompts",
            "gsm8k",
            "--out",
            tmp_path / "r.json",
        ),
        rc=2,
    )
    assert f"hf://datasets/{GSM8K}@main/{GSM8K_FILE} is not in the Hugging Face cache" in res.stderr
    assert "HF_HUB_OFFLINE is set" in res.stderr and "Traceback" not in res.stderr


@pytest.fixture(scope="module")
def run_and_target(trained_drafter, tiny_target, tmp_path_factory):
    """A copy of the shared trained run (its events get an `eval`), and the tiny target with a word-level
    tokenizer (`w<i>` is token i) so that the benchmarks' text prompts encode."""
    from trainer.demo.synth import servable_tiny_target

    root = tmp_path_factory.mktemp("push")
    run = root / "run"
    shutil.copytree(trained_drafter, run)
    target = root / "target"
    shutil.copytree(tiny_target, target)
    tok = servable_tiny_target(root / "tok")
    for p in tok.iterdir():
        if p.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(p, target / p.name)
    return run, target


def test_eval_on_gsm8k_then_push_with_card_resumable_and_idempotent(hub, hf_home, run_and_target, tmp_path):
    srv, root = hub
    run, target = run_and_target
    e = env(srv, hf_home)
    report = tmp_path / "gsm8k.json"
    dflash(
        e,
        "eval",
        "--drafter",
        run,
        "--target",
        target,
        "--prompts",
        "gsm8k",
        "--max-new-tokens",
        8,
        "--out",
        report,
    )
    rep = json.loads(report.read_text())
    digest = hashlib.sha256((root / "gsm8k" / GSM8K_FILE).read_bytes()).hexdigest()
    assert rep["prompt_set"] == {
        "name": "gsm8k",
        "sha256": digest,
        "source": f"hf://datasets/{GSM8K}@{COMMIT}/{GSM8K_FILE}",
    }
    assert rep["num_prompts"] == 2 and rep["lossless"]["ok"]

    # no token: refused before the export is written
    no_token = env(srv, tmp_path / "no-login", HF_TOKEN=None)
    res = dflash(
        no_token, "export", "--checkpoint", run, "--out", tmp_path / "x", "--push-to-hub", REPO, rc=2
    )
    assert "needs a Hub token" in res.stderr and not (tmp_path / "x").exists()

    out = tmp_path / "export"
    push = ["export", "--checkpoint", run, "--out", out, "--push-to-hub", REPO]
    res = dflash(e, *push)
    assert "pushed" in res.stdout and len(srv.commits) == 1
    sent = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert {"config.json", "model.safetensors", "dflash_export.json", "README.md"} <= set(sent)
    assert srv.files_at(REPO) == sent  # every file arrived, byte for byte
    card = sent["README.md"].decode()
    assert f'"model": "{REPO}", "num_speculative_tokens": 7' in card and "vllm serve " in card
    row = next(line for line in card.splitlines() if line.startswith("| gsm8k |"))
    assert f"| {rep['tau']:.3f} |" in row and "| 2 | 8 |" in row  # the eval's τ, its prompts and block
    assert "num_layers 1" in card and "steps | 150 of 150" in card
    assert TOKEN not in card and TOKEN not in " ".join(map(str, push))
    auth = {
        {k.lower(): v for k, v in h.items()}.get("authorization") for m, _, h in srv.requests if m == "POST"
    }
    assert auth == {f"Bearer {TOKEN}"}  # from HF_TOKEN, never from argv

    # the same command again: the export is reused, nothing is sent, no commit is made
    received, puts = srv.received, sum(m == "PUT" for m, _, _ in srv.requests)
    res = dflash(e, *push)
    assert "already holds the export" in res.stdout and "nothing sent" in res.stdout
    assert len(srv.commits) == 1 and srv.received == received
    assert sum(m == "PUT" for m, _, _ in srv.requests) == puts
    res = dflash(e, *push, "--revision", "v1")  # a new branch starts from main: nothing to send either
    assert f"hf://{REPO}@v1 already has" in res.stdout and srv.heads[REPO]["v1"] == srv.heads[REPO]["main"]

    # a push that died after uploading the weights but before its commit: the rerun commits them
    # without sending their bytes again (the Hub already holds the LFS object)
    files = dict(srv.files_at(REPO))
    weights = files.pop("model.safetensors")
    srv.set_head(REPO, "main", "f" * 40, files)
    res = dflash(e, *push)
    assert srv.files_at(REPO)["model.safetensors"] == weights and srv.commits[-1]["paths"] == [
        "model.safetensors"
    ]
    assert srv.received == received  # the commit names the object; its bytes were not uploaded again
