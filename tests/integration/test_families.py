"""The family matrix (issue #47): one tiny target per model family, built on the spot with the
family's own transformers config class (tests/families.py), taken through the product's commands as
a user runs them: `dflash init` -> `dflash preflight` (the config as init wrote it) -> `dflash train`
(hooked source, a few steps) -> `dflash eval` chain and tree (`--tree-budget`), `--check-lossless all`
-> `dflash export` -> reload (speculators' `SpeculatorModel.from_pretrained`).

Each family's target, data, run and export are made once per pytest process (session fixtures per
family, tests/families.py) and shared by the phases and by the vLLM column's test_families_vllm.py.
Each phase's outcome is checked against docs/families.md's table: the test is red when the table and
what the product does disagree. A family the product cannot take must be refused by
preflight (exit 2, its reason on one line), never a traceback mid-run.

What the sliding-window families (gpt-oss, Gemma 3) exercise: the eval's rollback of a cache longer
than the window and a tree's mask per layer type (trainer/eval/layer_masks.py); gpt-oss also loads
with eager attention (its attention sinks have no sdpa path)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

import tests.families as fam
from tests.integration.conftest import dflash_here as dflash
from trainer.config.run import load_config
from trainer.store.checkpoint import read_latest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "families.md"
CPU = torch.device("cpu")
PHASES = ("init", "preflight", "train", "eval chain", "eval tree", "export", "reload", "vLLM")
NEW_TOKENS = 40  # past the sliding windows (16) of gpt-oss and Gemma 3 from an 8-token prompt


def doc_table() -> dict[str, dict[str, str]]:
    """docs/families.md's matrix: family id (the backticked name in the first cell) -> phase -> cell."""
    rows: dict[str, dict[str, str]] = {}
    lines = [ln for ln in DOC.read_text().splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert tuple(header[1:]) == PHASES, f"docs/families.md's columns are {header[1:]}, expected {PHASES}"
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        name = re.search(r"`([^`]+)`", cells[0])
        assert name, f"docs/families.md: no `family id` in {cells[0]!r}"
        rows[name.group(1)] = dict(zip(PHASES, cells[1:]))
    return rows


def agree(run: fam.Run, phase: str, observed: str) -> None:
    """The observed outcome ("works" or "refused: why") is what the docs' table says for this cell."""
    cell = doc_table()[run.name][phase]
    kind = observed.split(":")[0]
    assert cell.lower().startswith(kind), (
        f"{run.name} × {phase}: the product {observed!r}, docs/families.md says {cell!r}"
    )


# The family's run, trained and exported drafter: session fixtures (tests/families.py) that this matrix and
# its vLLM column (test_families_vllm.py) share, so that nothing is trained twice in one process.
@pytest.fixture
def run(family_run) -> fam.Run:
    return family_run


@pytest.fixture
def trained(family_trained) -> subprocess.CompletedProcess:
    return family_trained


@pytest.fixture
def exported(family_exported) -> subprocess.CompletedProcess:
    return family_exported


def test_init(run):
    if run.init.returncode == 2:
        agree(run, "init", "refused: " + run.init.stderr.strip())
        return
    assert run.init.returncode == 0, run.init.stdout + run.init.stderr
    agree(run, "init", "works")
    text = run.config.read_text()
    assert "mask_token_id: 500" in text, text  # the first row past the 500-id tokenizer


def test_preflight_takes_the_config_init_wrote(run):
    res = dflash("preflight", "--config", run.config, "--json")
    report = json.loads(res.stdout)
    if res.returncode == 2:
        reasons = [e["message"] for e in report["errors"]]
        agree(run, "preflight", "refused: " + "; ".join(reasons))
        return
    assert res.returncode == 0, res.stdout + res.stderr
    assert report["warnings"] == [], report["warnings"]
    agree(run, "preflight", "works")


def test_train_hooked(run, trained):
    from trainer.store.events import load_events

    res = trained
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = run.root / "out"
    events = load_events(out / "events.jsonl")
    steps = [e for e in events if e["event"] == "step"]
    assert len(steps) == run.sizes()["train.max_steps"] and all(np.isfinite(e["loss"]) for e in steps)
    assert read_latest(out) is not None
    agree(run, "train", "works")


def test_training_targets_are_the_targets_own_greedy_tokens(run, trained):
    """The drafter's frozen verifier head on the hooked source's last hidden state (the final norm's
    input) gives the target's own greedy tokens: the family's final norm convention (Gemma's 1 + w),
    tied head and hidden-state capture are what the training targets are made of."""
    from transformers import AutoModelForCausalLM

    from trainer.eval.models import load_drafter
    from trainer.sources.hooked import base_model

    drafter = load_drafter(read_latest(run.root / "out"), run.target, CPU)
    model = AutoModelForCausalLM.from_pretrained(str(run.target)).eval()
    seen = {}
    base_model(model).norm.register_forward_pre_hook(lambda _m, args: seen.update(h=args[0]))
    ids = torch.tensor([[5 + (7 * i) % 480 for i in range(40)]])
    with torch.no_grad():
        greedy = model(input_ids=ids).logits.argmax(-1)
        mine = drafter.verifier_lm_head(drafter.verifier_norm(seen["h"])).argmax(-1)
    assert torch.equal(mine, greedy), f"{run.name}: {(mine != greedy).float().mean():.0%} of targets differ"


def test_eval_chain_and_tree_are_lossless(run, trained):
    out = run.root / "eval" / "report.json"
    args = ["eval", "--drafter", run.root / "out", "--target", run.target, "--prompts", run.prompts]
    more = ["--max-new-tokens", NEW_TOKENS, "--ignore-eos", "--check-lossless", "all", "--tree-budget", 8]
    res = dflash(*args, *more, "--out", out)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["lossless"]["ok"] and rep["lossless"]["checked"] == 3, rep["lossless"]
    assert rep["rounds"] > 0 and len(rep["per_position_acceptance"]) == 3
    agree(run, "eval chain", "works")
    (tree,) = rep["trees"]
    assert tree["budget"] == 8 and tree["lossless"]["ok"] and tree["lossless"]["checked"] == 3
    assert tree["tau"] >= 1.0 and tree["target_tokens_per_round"] > rep["block_size"]
    agree(run, "eval tree", "works")


def test_export_and_reload(run, exported):
    from speculators import SpeculatorModel

    from trainer.eval.models import load_drafter
    from trainer.export import probe_logits

    exp, res = run.root / "export", exported
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "reload check: bit-identical drafter logits" in res.stdout
    agree(run, "export", "works")
    model = SpeculatorModel.from_pretrained(str(exp))
    saved = load_config(run.config).drafter.aux_ids
    assert type(model).__name__ == "DFlashDraftModel" and model.config.aux_hidden_state_layer_ids == saved
    ckpt = read_latest(run.root / "out")
    assert torch.equal(
        probe_logits(load_drafter(ckpt, run.target, CPU)), probe_logits(load_drafter(exp, run.target, CPU))
    )
    agree(run, "reload", "works")


# Where the vLLM hidden-state source and vLLM-served tau run for a family (a vLLM start costs most of a
# minute here, so they live in their own test files, not in this one); the rest: not run here.
VLLM_TESTED = {
    "qwen3": ("tests/integration/test_vllm_source.py", "tests/integration/test_eval_served.py"),
    "qwen3.5": ("tests/integration/test_hybrid_vllm.py",),
    **{name: ("tests/integration/test_families_vllm.py",) for name in fam.SERVED},
}


def test_vllm_column_is_what_vllm_can_take_and_where_it_is_tested(run):
    """The vLLM cell: refused where vLLM 0.32 cannot give the target's aux hidden states (the product's
    own check, trainer/preflight/vllm_family.py, which preflight, export --vllm-check and eval --engine
    vllm call before any model loads); works, naming the tests that run it, where a test does; else
    "not run here" rather than a claim."""
    from trainer.preflight.vllm_family import aux_states_problem

    conf = json.loads((run.target / "config.json").read_text())
    problem = aux_states_problem(conf, "the hidden-state source")
    cell = doc_table()[run.name]["vLLM"]
    if problem:
        agree(run, "vLLM", f"refused: {problem}")
        assert "aux hidden states" in cell, cell
    elif run.name in VLLM_TESTED:
        agree(run, "vLLM", "works")
        for test in VLLM_TESTED[run.name]:
            assert (REPO / test).is_file() and Path(test).name in cell, (test, cell)
    else:
        assert cell.lower().startswith("not run"), cell


def test_the_table_holds_exactly_the_matrix():
    assert set(doc_table()) == set(fam.FAMILIES), "docs/families.md's rows are not the matrix's families"
