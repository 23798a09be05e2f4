"""The cached speculative-decoding loop `dflash eval` runs (z-lab's procedure, greedy):

1. prefill the target on the prompt: its greedy token after the prompt is the first anchor, and its
   aux-layer features of the prompt are the drafter's first context;
2. each round, the drafter runs one block `[anchor, MASK x (B-1)]` at positions a..a+B-1 against the
   features of every committed position before a (new ones appended to its KV cache); the argmax of
   slots 1..B-1 are the draft tokens;
3. the target verifies `[anchor, drafts]` in one forward on its KV cache; `accepted` = the length of
   the prefix of drafts equal to the target's own greedy tokens; the accepted drafts and the
   target's bonus token are committed (accepted + 1 tokens); both caches are cropped to the
   committed context (a hybrid target's linear-attention states restored and advanced over the
   committed tokens: trainer/eval/recurrent.py) and the verify forward's features of the newly
   committed positions become context;
4. until max_new_tokens are committed or a stop token is.

Lossless by construction: every committed token is the target's greedy token at its position.
tau = mean(accepted + 1) over rounds. Full-attention draft layers see the whole context without a
mask (the block is bidirectional, no other block exists); sliding-window layers get a mask limiting
the context to the last `window` positions before the anchor and, unless the config says
`sliding_window_non_causal`, causal attention inside the block (speculators' training mask).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial

import torch

from trainer.eval.lossless import TOP_K, GreedyReference
from trainer.eval.models import HookedTarget, crop_cache


@dataclass
class PromptResult:
    prompt_tokens: int
    tokens: list[int]  # committed new tokens (truncated at max_new_tokens / after a stop token)
    accepted: list[int] = field(default_factory=list)  # accepted drafts per round (0..B-1)
    wall_s: float = 0.0
    stopped: str = "length"  # length | stop_token
    tree_nodes: list[int] = field(default_factory=list)  # per round, tree verification only
    verified: list[int] = field(default_factory=list)  # the verify forward's own choice per committed token
    target_forwards: list[int] = field(default_factory=list)  # per round, tree verification only

    @property
    def rounds(self) -> int:
        return len(self.accepted)

    @property
    def tau(self) -> float | None:
        return (sum(self.accepted) + len(self.accepted)) / len(self.accepted) if self.accepted else None


def draft_to_target_ids(drafter, ids: torch.Tensor) -> torch.Tensor:
    """Map draft-vocabulary argmaxes to target ids (identity for a full-vocabulary drafter)."""
    if getattr(drafter, "use_draft_vocab", False):
        return ids + drafter.d2t[ids]
    return ids


def sliding_mask(
    drafter, layer_idx: int, ctx_len: int, block: int, anchor_pos: int, device
) -> torch.Tensor | None:
    """The boolean attention mask [1, 1, B, ctx_len + B] of draft layer `layer_idx` for a block at
    `anchor_pos` whose context holds positions 0..ctx_len-1 (= 0..anchor_pos-1); None for a
    full-attention layer."""
    if layer_idx not in drafter.sliding_window_indices:
        return None
    window = int(drafter.sliding_window)
    pos = torch.arange(ctx_len, device=device)
    ctx_ok = (pos >= anchor_pos - window) & (pos < anchor_pos)
    mask = torch.zeros(block, ctx_len + block, dtype=torch.bool, device=device)
    mask[:, :ctx_len] = ctx_ok
    if drafter.sliding_window_non_causal:
        mask[:, ctx_len:] = True
    else:
        mask[:, ctx_len:] = torch.ones(block, block, dtype=torch.bool, device=device).tril()
    return mask[None, None]


class CachedDrafter:
    """The drafter with a KV cache over its context (the projected target features)."""

    def __init__(self, drafter, block_size: int):
        from transformers import DynamicCache

        self.m = drafter
        self.block = block_size
        self.cache = DynamicCache()  # plain full layers: sliding windows are applied by the mask
        self.ctx_len = 0

    @torch.no_grad()
    def block_logits(self, new_feats: torch.Tensor, anchor_token: int, anchor_pos: int) -> torch.Tensor:
        """Append `new_feats` (positions ctx_len..anchor_pos-1) to the context, run the block at
        `anchor_pos` and return the logits of slots 1..B-1 ([B-1, V]); the block leaves the cache."""
        m, B, dev = self.m, self.block, new_feats.device
        n_new = new_feats.shape[1]
        if self.ctx_len + n_new != anchor_pos:
            raise RuntimeError(
                f"drafter context {self.ctx_len}+{n_new} does not end before anchor {anchor_pos}"
            )
        target_hidden = m.hidden_norm(m.fc(new_feats))
        block_ids = torch.full((1, B), m.mask_token_id, dtype=torch.long, device=dev)
        block_ids[0, 0] = anchor_token
        noise = m.embed_tokens(block_ids)
        positions = torch.arange(self.ctx_len, anchor_pos + B, device=dev).unsqueeze(0)
        pos_emb = m.rotary_emb(noise, positions)
        for i, layer in enumerate(m.layers):
            mask = sliding_mask(m, i, anchor_pos, B, anchor_pos, dev)
            noise = layer(
                hidden_states=noise,
                target_hidden=target_hidden,
                attention_mask=mask,
                position_ids=positions,
                past_key_value=self.cache,
                use_cache=True,
                position_embeddings=pos_emb,
            )
        self.ctx_len = anchor_pos
        crop_cache(self.cache, self.ctx_len)  # keep the context, drop the block
        return m.lm_head(m.norm(noise[0, 1:]))

    def propose(self, new_feats: torch.Tensor, anchor_token: int, anchor_pos: int) -> list[int]:
        """The B-1 draft tokens of the block at `anchor_pos` (see block_logits)."""
        logits = self.block_logits(new_feats, anchor_token, anchor_pos)
        return draft_to_target_ids(self.m, logits.argmax(-1)).tolist()


def finish_generation(tokens: list[int], max_new: int, stop_ids: set[int]) -> tuple[list[int], str]:
    """The committed tokens cut at `max_new` and after the first stop token, and why it ended
    ("stop_token" or "length")."""
    out = tokens[:max_new]
    for i, t in enumerate(out):
        if t in stop_ids:
            return out[: i + 1], "stop_token"
    return out, "length"


def accepted_count(drafts: list[int], verdict: list[int], block_size: int) -> int:
    """How many drafts the target accepts: the longest prefix of `drafts` equal to the target's own
    greedy tokens at the same positions (at most block_size - 1)."""
    return next((i for i in range(block_size - 1) if drafts[i] != verdict[i]), block_size - 1)


def generation_done(tokens: list[int], max_new: int, stop_ids: set[int]) -> bool:
    """`max_new` tokens are committed, or a stop token is."""
    return len(tokens) >= max_new or any(t in stop_ids for t in tokens)


class CachedRounds:
    """The harness's rounds on one prompt: the target and the drafter each on a KV cache (steps 1-3 of the
    module's docstring); `speculate` runs the loop around them."""

    def __init__(self, target: HookedTarget, drafter, prompt: list[int], block_size: int):
        self.target, self.block = target, block_size
        ids = torch.tensor([prompt], dtype=torch.long, device=target.device)
        greedy, self.pending, self.cache = target.forward(ids)  # pending: features not yet in the context
        self.first = int(greedy[-1])  # the target's greedy token after the prompt: the first anchor
        self.draft = CachedDrafter(drafter, block_size)
        self.n = len(prompt)  # position of the current anchor

    def round(self, tokens: list[int]) -> tuple[list[int], list[int]]:
        """(the drafts after the anchor `tokens[-1]`, the target's greedy token after the anchor and
        after each draft) from one drafter block and one verify forward on the caches."""
        dev, anchor = self.target.device, tokens[-1]
        drafts = self.draft.propose(self.pending.to(dev), anchor, self.n)
        block = torch.tensor([[anchor, *drafts]], dtype=torch.long, device=dev)
        greedy, self.feats, self.cache = self.target.forward(block, self.cache)
        return drafts, greedy.tolist()

    def commit(self, acc: int) -> None:
        """The anchor and `acc` accepted drafts (positions n..n+acc) join the context: their features are
        the drafter's next context, the target's cache keeps them (a hybrid's linear layers rolled back:
        trainer/eval/recurrent.py)."""
        self.pending = self.feats[:, : acc + 1]
        self.target.keep(self.cache, self.n, acc + 1, self.block)
        self.n += acc + 1


@torch.no_grad()
def speculate(
    target,
    drafter,
    prompt: list[int],
    max_new: int,
    block_size: int,
    stop_ids: set[int] = frozenset(),
) -> PromptResult:
    """One prompt through the verify loop: on a `HookedTarget` the cached rounds (`CachedRounds`), on a
    `ReferenceTarget` the reference's, everything recomputed each round (trainer/eval/reference.py). Each
    round the target's greedy tokens decide how many drafts are accepted, and those plus the target's
    bonus token are committed: the one place both paths count rounds, accepted drafts and tau."""
    t0 = time.perf_counter()
    start = getattr(target, "rounds", None)  # the reference target makes its own rounds
    rounds = (start or partial(CachedRounds, target))(drafter, prompt, block_size)
    tokens = [rounds.first]
    verified = list(tokens)  # the lossless check's record: what the verifier chose at each position
    accepted: list[int] = []
    while not generation_done(tokens, max_new, stop_ids):
        drafts, verdict = rounds.round(tokens)
        acc = accepted_count(drafts, verdict, block_size)
        accepted.append(acc)
        tokens.extend(drafts[:acc] + [verdict[acc]])
        verified.extend(verdict[: acc + 1])
        rounds.commit(acc)
    out, why = finish_generation(tokens, max_new, stop_ids)
    return PromptResult(len(prompt), out, accepted, time.perf_counter() - t0, why, verified=verified)


@torch.no_grad()
def greedy_reference(
    target: HookedTarget, prompt: list[int], max_new: int, stop_ids: set[int] = frozenset()
) -> GreedyReference:
    """The target's own greedy decoding, one token per forward on its KV cache: the lossless check's
    ground truth and the speed baseline, with each position's top logits (trainer/eval/lossless.py)."""
    t0 = time.perf_counter()
    ids = torch.tensor([prompt], dtype=torch.long, device=target.device)
    out = target.model(input_ids=ids, use_cache=True)
    tops, scales = [], []

    def pick(row: torch.Tensor) -> int:  # the greedy token; its top logits kept on the device till the end
        row = row.float()
        tops.append(row.topk(min(TOP_K, row.shape[-1])))
        scales.append(row.abs().max())
        return int(row.argmax())

    tokens = [pick(out.logits[0, -1])]
    while not generation_done(tokens, max_new, stop_ids):
        nxt = torch.tensor([[tokens[-1]]], dtype=torch.long, device=target.device)
        out = target.model(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True)
        tokens.append(pick(out.logits[0, -1]))
    tokens, _ = finish_generation(tokens, max_new, stop_ids)
    secs = time.perf_counter() - t0
    dtype = target.model.dtype
    return GreedyReference(
        tokens,
        secs,
        torch.stack([t.indices for t in tops]).tolist(),
        torch.stack([t.values for t in tops]).tolist(),
        torch.stack(scales).tolist(),
        str(dtype).removeprefix("torch."),
        torch.finfo(dtype).eps,
    )


def target_greedy(
    target: HookedTarget, prompt: list[int], max_new: int, stop_ids: set[int] = frozenset()
) -> tuple[list[int], float]:
    """(tokens, seconds) of `greedy_reference`."""
    ref = greedy_reference(target, prompt, max_new, stop_ids)
    return ref.tokens, ref.seconds
