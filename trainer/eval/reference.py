"""An independent reference path (`dflash eval --reference`): no caches, everything recomputed
each round, the drafter run through speculators' *training* forward (its anchor-block attention
mask, sliding windows included) and the target's features read from transformers'
`output_hidden_states` instead of hooks. Slow by design; it must commit the same tokens and give
the same tau as the cached harness (tests and bench/eval_speed.py check it).

Per round, with committed sequence S (prompt + new tokens, the last one the anchor at position a):
1. target forward over S (no cache): features of every position (speculators id k =
   hidden_states[k]; for k = the target's depth, the input of the final norm, as in training);
2. the drafter's training forward on S padded by B positions, with the loss mask selecting the
   single anchor a: the block's logits give the drafts;
3. target forward over S + drafts (no cache): accept the longest matching prefix, commit it and
   the target's bonus token.
"""

from __future__ import annotations

import torch

from trainer.eval.harness import draft_to_target_ids


class ReferenceTarget:
    """The target without caches or hooks on layers (one pre-hook reads the final norm's input
    when an aux id is the target's depth: HF's last hidden_states entry is post-norm)."""

    def __init__(self, hooked):
        self.model = hooked.model  # same weights as the harness's target; no cache is ever passed
        self.device = hooked.device
        self.aux_ids = hooked.aux_ids
        self.num_layers = hooked.num_layers
        self._pre_norm = None
        if self.num_layers in self.aux_ids:
            hooked.base.norm.register_forward_pre_hook(self._keep)

    def _keep(self, _module, args):
        self._pre_norm = args[0]

    def rounds(self, drafter, prompt: list[int], block_size: int) -> ReferenceRounds:
        """This target's rounds on `prompt` for `speculate` (trainer/eval/harness.py)."""
        return ReferenceRounds(self, drafter, prompt, block_size)

    @torch.no_grad()
    def run(self, ids: list[int]) -> tuple[list[int], torch.Tensor]:
        """(greedy next token per position, features [1, n, n_aux*H] fp32) of a full forward."""
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        out = self.model(input_ids=x, use_cache=False, output_hidden_states=True)
        parts = [self._pre_norm if k == self.num_layers else out.hidden_states[k] for k in self.aux_ids]
        return out.logits[0].argmax(-1).tolist(), torch.cat(
            [x.to(self.device) for x in parts], dim=-1
        ).float()


@torch.no_grad()
def training_path_logits(
    drafter, feats: torch.Tensor, seq: list[int], anchor_pos: int, block_size: int
) -> torch.Tensor:
    """Logits of slots 1..B-1 ([B-1, V]) of the block at `anchor_pos` from speculators' training
    forward; `feats` must cover positions 0..anchor_pos-1 (later ones are never visible)."""
    dev = feats.device
    B = block_size
    T = anchor_pos + 1 + B  # the training path never anchors in the last B positions
    H_aux = feats.shape[-1]
    hidden = torch.zeros(1, T, H_aux, device=dev)
    n = min(feats.shape[1], anchor_pos)
    hidden[:, :n] = feats[:, :n]
    input_ids = torch.full((1, T), drafter.mask_token_id, dtype=torch.long, device=dev)
    input_ids[0, : anchor_pos + 1] = torch.tensor(seq[: anchor_pos + 1], device=dev)
    loss_mask = torch.zeros(1, T, dtype=torch.long, device=dev)
    loss_mask[0, anchor_pos] = 1
    last = torch.zeros(1, T, drafter.config.transformer_layer_config.hidden_size, device=dev)
    trained_block = drafter.block_size
    drafter.block_size = B  # an eval may use a smaller (or larger) block than the drafter's config
    try:
        _, logits, _, _, idx = drafter._backbone_forward(
            hidden,
            input_ids,
            loss_mask,
            last,
            torch.zeros(1, T, dtype=torch.long, device=dev),
            torch.arange(T, device=dev).unsqueeze(0),
            max_anchors=1,
        )
    finally:
        drafter.block_size = trained_block
    if int(idx[0]) != anchor_pos:
        raise RuntimeError(f"training path anchored at {int(idx[0])}, expected {anchor_pos}")
    return logits[0, 1:]


def training_path_block(
    drafter, feats: torch.Tensor, seq: list[int], anchor_pos: int, block_size: int
) -> list[int]:
    """Draft tokens for the block at `anchor_pos` from speculators' training forward."""
    logits = training_path_logits(drafter, feats, seq, anchor_pos, block_size)
    return draft_to_target_ids(drafter, logits.argmax(-1)).tolist()


class ReferenceRounds:
    """The reference's rounds on one prompt (steps 1-3 of the module's docstring), run by the harness's
    verify loop (trainer/eval/harness.py `speculate`): nothing is kept between rounds."""

    def __init__(self, target: ReferenceTarget, drafter, prompt: list[int], block_size: int):
        self.target, self.drafter, self.prompt, self.block = target, drafter, list(prompt), block_size
        greedy, _ = target.run(self.prompt)
        self.first = greedy[-1]

    def round(self, tokens: list[int]) -> tuple[list[int], list[int]]:
        """(the drafts after the anchor `tokens[-1]`, the target's greedy token after the anchor and
        after each draft), from full forwards over the committed sequence."""
        seq = self.prompt + tokens
        anchor_pos = len(seq) - 1
        _, feats = self.target.run(seq)
        drafts = training_path_block(self.drafter, feats, seq, anchor_pos, self.block)
        greedy, _ = self.target.run(seq + drafts)
        return drafts, greedy[anchor_pos:]

    def commit(self, acc: int) -> None:
        """Nothing to keep: the next round recomputes everything from the committed tokens."""
