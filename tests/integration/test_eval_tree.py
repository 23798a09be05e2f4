"""Tree verification (DDTree, trainer/eval/tree.py) on tiny real models (CPU): lossless against the
target's own greedy decoding for several budgets and block sizes, a budget of B-1 is exactly the chain,
a tree never accepts less than the chain on the same round, and the KV caches stay consistent over long
generations (the cached tree loop equals a tree loop that recomputes everything each round)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from tests.conftest import tiny_prompts, train_tiny_drafter
from trainer.eval.harness import CachedDrafter, accepted_count, speculate, target_greedy
from trainer.eval.models import HookedTarget, aux_ids_of, load_drafter
from trainer.eval.tree import accept_path, build_tree, speculate_tree, tree_mask
from trainer.store.checkpoint import read_latest

pytestmark = pytest.mark.slow

STOP = {2}  # the tiny target's eos
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def trained_drafter(tiny_target, tiny_data, tmp_path_factory) -> Path:
    """tests/conftest.py's `trained_drafter` (the same `dflash train` run: train_tiny_drafter, aux ids
    [1, 2]) for this module: no other test of the served lane (scripts/test) uses it; forked like every
    `dflash train` of the tests (tests/cli_fork.py), so its imports are paid once per lane."""
    return train_tiny_drafter(tiny_target, tiny_data, tmp_path_factory.mktemp("trained-drafter"), [1, 2])


@pytest.fixture(scope="module")
def loaded(trained_drafter, tiny_target):
    folder = read_latest(trained_drafter)
    drafter = load_drafter(folder, tiny_target, CPU)
    return drafter, HookedTarget(tiny_target, aux_ids_of(folder), CPU)


@pytest.mark.parametrize("block", [4, 8])
def test_trees_are_lossless_and_budget_b_minus_1_is_the_chain(loaded, block, one_thread):
    drafter, target = loaded
    deeper = 0
    for prompt in tiny_prompts(4, seed=7):
        greedy, _ = target_greedy(target, prompt, 40, STOP)
        chain = speculate(target, drafter, prompt, 40, block, STOP)
        same = speculate_tree(target, drafter, prompt, 40, block, block - 1, STOP)
        assert same.tokens == chain.tokens == greedy
        assert same.accepted == chain.accepted and same.tree_nodes == [block - 1] * same.rounds
        for budget in (4, 16, 32):
            tree = speculate_tree(target, drafter, prompt, 40, block, budget, STOP)
            assert tree.tokens == greedy, f"budget {budget}: committed tokens differ from greedy"
            assert all(n <= budget for n in tree.tree_nodes) and len(tree.tree_nodes) == tree.rounds
            deeper += tree.tau > chain.tau
    assert deeper > 0, "no tree ever beat the chain: the comparison proves nothing"


def test_a_tree_never_accepts_less_than_the_chain_on_the_same_round(loaded, one_thread):
    """Property over random drafter distributions and the real target's verdicts: for a round state
    (context, anchor), the accepted depth of the tree (any budget >= B-1) is at least the chain's."""
    drafter, target = loaded
    gen = torch.Generator().manual_seed(0)
    block = 8
    checked = 0
    for prompt in tiny_prompts(6, seed=11):
        ids = torch.tensor([prompt])
        _, _, cache = target.forward(ids)
        past = len(prompt)
        greedy_run, _ = target_greedy(target, prompt, block, set())
        anchor = greedy_run[0]
        for _ in range(4):
            # sharp random distributions, so that chains and trees both accept something now and then
            logits = torch.randn(block - 1, 512, generator=gen) * 6
            logprobs = torch.log_softmax(logits, -1)
            # plant the target's continuation at rank 0, 1 or 2 of each depth, or nowhere, at random
            for d in range(block - 1):
                rank = int(torch.randint(0, 4, (1,), generator=gen))  # 3: not planted
                top = logprobs[d].topk(3).indices
                if rank < 3:
                    logprobs[d, greedy_run[d + 1]] = logprobs[d, top[rank]] + 1e-3
            chain_nodes = build_tree(logprobs, block - 1)
            chain_tokens = [n.token for n in chain_nodes]
            for budget in (block - 1, 12, 32):
                nodes = build_tree(logprobs, budget)
                assert [n.token for n in nodes[: block - 1]] == chain_tokens, "the chain comes first"
                block_ids = torch.tensor([[anchor, *[n.token for n in nodes]]])
                pos = torch.tensor([[past] + [past + n.depth for n in nodes]])
                mask = tree_mask(nodes, past, CPU)
                greedy, _, _ = target.forward(
                    block_ids, copy.deepcopy(cache), attention_mask=mask, position_ids=pos
                )
                depth = len(accept_path(nodes, greedy.tolist()))
                chain_depth = accepted_count(chain_tokens, greedy_run[1:], block)
                assert depth >= chain_depth, (budget, depth, chain_depth)
                checked += 1
    assert checked == 6 * 4 * 3


def test_tree_caches_stay_consistent_over_long_generations(loaded, one_thread):
    """The cached tree loop against the same tree procedure with no cache at all (the target and the
    drafter recompute the whole sequence every round): the same tokens and the same accepted depths
    over 160 new tokens."""
    drafter, target = loaded
    block, budget = 8, 16
    for prompt in tiny_prompts(2, seed=3):
        cached = speculate_tree(target, drafter, prompt, 160, block, budget, set())
        tokens, accepted = [], []
        seq = list(prompt)
        greedy0, _, _ = target.forward(torch.tensor([seq]))
        tokens.append(int(greedy0[-1]))
        while len(tokens) < 160:
            ctx = seq + tokens[:-1]
            _, feats, _ = target.forward(torch.tensor([ctx]))
            draft = CachedDrafter(drafter, block)
            logits = draft.block_logits(feats, tokens[-1], len(ctx))
            nodes = build_tree(torch.log_softmax(logits.float(), -1), budget)
            full = torch.tensor([[*ctx, tokens[-1], *[n.token for n in nodes]]])
            n = len(ctx)
            mask = torch.zeros(1, 1, full.shape[1], full.shape[1], dtype=torch.bool)
            mask[0, 0, : n + 1, : n + 1] = torch.ones(n + 1, n + 1, dtype=torch.bool).tril()
            mask[0, 0, n + 1 :, :] = tree_mask(nodes, n, CPU)[0, 0, 1:]
            pos = torch.tensor([list(range(n + 1)) + [n + nd.depth for nd in nodes]])
            greedy, _, _ = target.forward(full, None, attention_mask=mask, position_ids=pos)
            verdict = greedy[n:].tolist()
            path = accept_path(nodes, verdict)
            accepted.append(len(path))
            tokens.extend([nodes[i].token for i in path] + [verdict[path[-1] + 1 if path else 0]])
        assert cached.tokens == tokens[:160]
        assert cached.accepted == accepted[: len(cached.accepted)]


def test_eval_cli_reports_trees_beside_the_chain(trained_drafter, tiny_target, tmp_path, capsys, one_thread):
    import json

    from trainer.cli import main
    from trainer.eval.prompts import write_prompt_file
    from trainer.store.events import load_events

    prompts = write_prompt_file(tmp_path / "p.jsonl", [{"input_ids": p} for p in tiny_prompts(3, seed=5)])
    out = tmp_path / "r.json"
    args = ["eval", "--drafter", str(trained_drafter), "--target", str(tiny_target),
            "--prompts", str(prompts), "--max-new-tokens", "32", "--ignore-eos",
            "--out", str(out)]  # fmt: skip
    assert main([*args, "--tree-budget", "7", "--tree-budget", "24", "--check-lossless", "all"]) == 0
    said = capsys.readouterr().out
    rep = json.loads(out.read_text())
    trees = {t["budget"]: t for t in rep["trees"]}
    assert set(trees) == {7, 24} and all(
        t["lossless"]["ok"] and t["lossless"]["checked"] == 3 for t in trees.values()
    )
    assert trees[7]["tau"] == rep["tau"] and trees[7]["target_tokens_per_round"] == 8  # budget B-1: the chain
    assert trees[24]["tau"] >= rep["tau"] and 8 < trees[24]["target_tokens_per_round"] <= 25
    assert len(trees[24]["per_depth_acceptance"]) == rep["block_size"] - 1
    assert "tree budget 24: tau" in said
    md = out.with_suffix(".md").read_text()
    assert "## Tree verification (DDTree)" in md and "| 24 | **" in md
    ev = [e for e in load_events(trained_drafter / "events.jsonl") if e["event"] == "eval"][-1]
    assert ev["tree_tau"] == {"7": trees[7]["tau"], "24": trees[24]["tau"]}
    # not with the reference loop or vLLM alone; a budget is positive
    for extra in (["--reference"], ["--engine", "vllm"]):
        assert main([*args, "--tree-budget", "8", *extra]) == 2
        assert "--tree-budget runs in the harness's cached loop" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*args, "--tree-budget", "0"])
