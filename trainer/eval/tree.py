"""Tree verification (DDTree) for `dflash eval --tree-budget N`: greedy, lossless.

One DFlash forward gives the drafter's distribution at every draft depth 1..B-1 (slot k of the block).
A tree of at most N draft nodes is grown best-first by joint log-probability: a node at depth d holding
token t scores its parent's score + log p_d(t); the frontier is every node's top-k children at depth
d+1 (top-k of p_{d+1}: the depths are predicted independently, so every node of a depth has the same
candidate children). The parent of a node always scores at least as high as the node (log p <= 0), so
best-first adds parents first and the tree stays connected.

The target verifies the whole tree in one forward: [anchor, node_1 .. node_N] after the committed
context, each node at position anchor_pos + depth, attending to the context, the anchor and its own
ancestors only (a 4D boolean mask, which transformers takes as is). Walking from the anchor, the child
holding the target's greedy token is accepted while one exists; the target's greedy token after the
last accepted node is the bonus. The committed tokens are therefore the target's greedy ones: lossless
exactly as the chain is. Both caches keep only the committed path: the target's KV entries of the
accepted nodes are gathered in order (the rejected branches dropped), and the verify forward's
features at those nodes become the drafter's new context.

The chain is always in the tree (it is grown first), so a budget of B-1 is the chain itself (the same
tokens, the same acceptance as `speculate`) and a larger one never accepts less on the same round.

A hybrid target (linear-attention layers, Qwen3.5/3.6) cannot verify a tree in one forward: a recurrent
layer folds every token it sees into one state, with no mask to hide a sibling branch. Its tree is
walked (`walk_tree`): the target verifies one root-to-leaf path as a chain (the best-scoring child at
each step, the chain first); where the target's greedy token differs from the path's node but is another
child of the last accepted node, the cache is rolled back to that node (trainer/eval/recurrent.py) and
the walk goes on with a forward over that child and the best path below it. The same tokens are
accepted as by the one-forward tree (the walk follows the target's greedy token through the same tree),
at the cost of one more target forward per branch switch (`PromptResult.target_forwards`), each over a
path, not the whole tree. Lossless as the chain: every committed token is the greedy token of a forward
over the committed context.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass

import torch

from trainer.eval.harness import (
    CachedDrafter,
    PromptResult,
    draft_to_target_ids,
    finish_generation,
    generation_done,
)
from trainer.eval.models import HookedTarget, crop_cache


@dataclass(frozen=True)
class TreeNode:
    parent: int  # index of the parent node, -1 for the anchor
    depth: int  # 1..B-1: the draft slot whose distribution it came from
    token: int  # target vocabulary id
    score: float  # joint log-probability of the path from the anchor


def build_tree(logprobs: torch.Tensor, budget: int, top_k: int | None = None) -> list[TreeNode]:
    """Up to `budget` nodes from per-depth log-probabilities [B-1, V] (draft vocabulary ids; the caller
    maps them). The chain (the argmax at every depth) comes first, so with a budget of at least B-1 the
    tree holds every path the chain would try and never accepts less; the rest of the budget goes
    best-first by joint log-probability, each node's children among the top-k of the next depth
    (default: the budget, so any node may be expanded fully)."""
    depths = logprobs.shape[0]
    k = min(int(top_k or budget), logprobs.shape[1])
    top_lp, top_ids = (t.tolist() for t in logprobs.topk(k, dim=-1))
    nodes: list[TreeNode] = []
    frontier: list[tuple[float, int, int, int, int]] = []  # (-score, order, parent, depth, rank)

    def push(score: float, parent: int, depth: int, rank: int) -> None:
        heapq.heappush(frontier, (-score, len(frontier) + len(nodes), parent, depth, rank))

    def add(parent: int, depth: int, rank: int, score: float, child: bool) -> int:
        nodes.append(TreeNode(parent, depth, int(top_ids[depth - 1][rank]), score))
        me = len(nodes) - 1
        if rank + 1 < k:  # its next sibling (same parent, next rank) may come next
            base = 0.0 if parent < 0 else nodes[parent].score
            push(base + top_lp[depth - 1][rank + 1], parent, depth, rank + 1)
        if child and depth < depths:  # and its best child
            push(score + top_lp[depth][0], me, depth + 1, 0)
        return me

    chain = min(depths, budget)
    parent, score = -1, 0.0
    for depth in range(1, chain + 1):
        score += top_lp[depth - 1][0]
        parent = add(parent, depth, 0, score, child=depth == chain)  # the chain's own children are in
    while frontier and len(nodes) < budget:
        neg, _, parent, depth, rank = heapq.heappop(frontier)
        add(parent, depth, rank, -neg, child=True)
    return nodes


def tree_mask(nodes: list[TreeNode], ctx_len: int, device) -> torch.Tensor:
    """The boolean mask [1, 1, 1+N, ctx_len+1+N] of the verify forward: every query sees the committed
    context; the anchor (query 0) sees itself; node i sees the anchor, its ancestors and itself."""
    n = len(nodes)
    mask = torch.zeros(1 + n, ctx_len + 1 + n, dtype=torch.bool, device=device)
    mask[:, : ctx_len + 1] = True  # context + anchor
    for i, node in enumerate(nodes):
        j = i
        while j >= 0:
            mask[1 + i, ctx_len + 1 + j] = True
            j = nodes[j].parent
    return mask[None, None]


def accept_path(nodes: list[TreeNode], greedy: list[int]) -> list[int]:
    """Indices of the accepted nodes, anchor excluded: from the anchor, follow the child holding the
    target's greedy token (greedy[0] after the anchor, greedy[1 + i] after node i) while one exists."""
    children: dict[int, dict[int, int]] = {}
    for i, node in enumerate(nodes):
        children.setdefault(node.parent, {}).setdefault(node.token, i)
    path, here = [], -1
    while True:
        want = greedy[0] if here < 0 else greedy[1 + here]
        nxt = children.get(here, {}).get(want)
        if nxt is None:
            return path
        path.append(nxt)
        here = nxt


def keep_cache_positions(cache, past: int, keep: list[int]) -> None:
    """Keep the first `past` positions of every layer of a transformers cache, then the positions
    `past + keep[i]` in that order (the accepted path of a tree forward); drop the rest."""
    idx = torch.tensor(list(range(past)) + [past + j for j in keep], dtype=torch.long)
    for layer in cache.layers:  # under a device_map the layers' caches sit on several GPUs
        if idx.device != layer.keys.device:
            idx = idx.to(layer.keys.device)
        layer.keys = layer.keys.index_select(-2, idx)
        layer.values = layer.values.index_select(-2, idx)


def best_path(nodes: list[TreeNode], children: dict[int, list[int]], here: int) -> list[int]:
    """The path below node `here` (-1: the anchor) taking the best-scoring child at every step."""
    path = []
    while children.get(here):
        here = max(children[here], key=lambda i: nodes[i].score)
        path.append(here)
    return path


def walk_tree(target: HookedTarget, nodes: list[TreeNode], anchor: int, n: int, tcache):
    """Verify the tree of a round on a hybrid target by chains (module doc). `anchor` at position `n`
    is the committed token not yet in `tcache`. Returns (accepted node indices, bonus token, the
    verify forwards' own choice per committed token, their features at the committed positions
    [1, len(path)+1, ...], the cache, forwards run)."""
    children: dict[int, list[int]] = {}
    for i, node in enumerate(nodes):
        children.setdefault(node.parent, []).append(i)
    accepted: list[int] = []
    verified: list[int] = []
    feats_parts = []
    here, head, forwards = -1, anchor, 0
    while True:
        path = best_path(nodes, children, here)
        ids = [head, *[nodes[i].token for i in path]]
        block = torch.tensor([ids], dtype=torch.long, device=target.device)
        greedy, feats, tcache = target.forward(block, tcache)
        forwards += 1
        pred = greedy.tolist()
        acc = next((j for j, i in enumerate(path) if nodes[i].token != pred[j]), len(path))
        accepted += path[:acc]
        verified += pred[: acc + 1]
        feats_parts.append(feats[:, : acc + 1])
        target.keep(tcache, n, acc + 1, len(path) + 1)
        n += acc + 1
        here = path[acc - 1] if acc else here
        nxt = next((i for i in children.get(here, []) if nodes[i].token == pred[acc]), None)
        if nxt is None:
            return accepted, pred[acc], verified, torch.cat(feats_parts, dim=1), tcache, forwards
        accepted.append(nxt)  # the target's own token, a node of the tree: the walk goes on below it
        here, head = nxt, nodes[nxt].token


@torch.no_grad()
def speculate_tree(
    target: HookedTarget,
    drafter,
    prompt: list[int],
    max_new: int,
    block_size: int,
    budget: int,
    stop_ids: set[int] = frozenset(),
    top_k: int | None = None,
) -> PromptResult:
    """One prompt through the tree loop: like `speculate`, with the chain replaced by a tree of at most
    `budget` drafted nodes per round. `PromptResult.accepted` holds the accepted depth per round,
    `tree_nodes` the tree size per round (the target verifies 1 + that many tokens)."""
    t0 = time.perf_counter()
    dev = target.device
    ids = torch.tensor([prompt], dtype=torch.long, device=dev)
    greedy, feats, tcache = target.forward(ids)
    tokens = [int(greedy[-1])]
    verified = list(tokens)  # the verify forward's own choice at each committed position
    pending = feats
    draft = CachedDrafter(drafter, block_size)
    accepted: list[int] = []
    sizes: list[int] = []
    calls: list[int] = []  # target forwards per round: 1, more on a hybrid target (walk_tree)
    n = len(prompt)  # position of the current anchor = committed context length
    while not generation_done(tokens, max_new, stop_ids):
        anchor = tokens[-1]
        logits = draft.block_logits(pending.to(dev), anchor, n)  # [B-1, V_draft]
        nodes = build_tree(torch.log_softmax(logits.float(), dim=-1), budget, top_k)
        draft_ids = torch.tensor([nd.token for nd in nodes], dtype=torch.long, device=dev)
        node_tokens = draft_to_target_ids(drafter, draft_ids).tolist()
        nodes = [TreeNode(nd.parent, nd.depth, t, nd.score) for nd, t in zip(nodes, node_tokens)]
        if target.hybrid:
            path, bonus, chose, new_feats, tcache, forwards = walk_tree(target, nodes, anchor, n, tcache)
            accepted.append(len(path))
            sizes.append(len(nodes))
            calls.append(forwards)
            tokens.extend([node_tokens[i] for i in path] + [bonus])
            verified.extend(chose)
            pending = new_feats
            n += len(path) + 1
            continue
        block = torch.tensor([[anchor, *node_tokens]], dtype=torch.long, device=dev)
        positions = torch.tensor([[n] + [n + nd.depth for nd in nodes]], dtype=torch.long, device=dev)
        greedy, feats, tcache = target.forward(
            block, tcache, attention_mask=tree_mask(nodes, n, dev), position_ids=positions
        )
        pred = greedy.tolist()
        path = accept_path(nodes, pred)
        last = path[-1] + 1 if path else 0  # index in the verified block of the last accepted token
        accepted.append(len(path))
        sizes.append(len(nodes))
        tokens.extend([node_tokens[i] for i in path] + [pred[last]])
        verified.extend([pred[0]] + [pred[1 + i] for i in path])
        keep = [0] + [1 + i for i in path]
        keep_cache_positions(tcache, n, keep)
        pending = feats[:, keep]
        n += len(path) + 1
        crop_cache(tcache, n)
        calls.append(1)
    out, why = finish_generation(tokens, max_new, stop_ids)
    return PromptResult(
        len(prompt),
        out,
        accepted,
        time.perf_counter() - t0,
        why,
        tree_nodes=sizes,
        verified=verified,
        target_forwards=calls,
    )
