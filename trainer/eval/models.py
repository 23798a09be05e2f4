"""The two models of an evaluation, loaded for inference (heavy side).

- `HookedTarget`: the target as a causal LM (logits to verify with, its own KV cache) with forward
  hooks at the aux layers, so every verify forward also yields the drafter's context features.
  Aux id k follows speculators' convention (`trainer.sources.hooked.aux_module`): the output of
  decoder layer k-1, id 0 the embeddings.
- `load_drafter`: a speculators DFlash checkpoint (or a z-lab/SpecForge-format one, converted by
  speculators' converter) with the embedding, heads and final norm taken from `--target`, and sdpa
  attention (a reloaded drafter comes back with flex attention, which the harness does not use).
"""

from __future__ import annotations

import gc
import json
import logging
import tempfile
from pathlib import Path

import torch

from trainer.errors import DflashError
from trainer.eval.layer_masks import verify_cache, verify_mask
from trainer.eval.recurrent import RecurrentRollback, linear_mixers
from trainer.sources.hooked import aux_module, base_model, load_language_model, resolve_dtype


class ModelError(DflashError, ValueError):
    """A drafter/target pair that cannot be evaluated; the message says what to change."""


class HookedTarget:
    """`load_kwargs`: more arguments for `from_pretrained`, e.g. `device_map="auto"` and `max_memory`
    per GPU from trainer/layout/inference.py (`resolve_harness`) for a target larger than one GPU: its
    layers spread over the GPUs, and what a forward returns (greedy tokens, aux features) is brought to
    `device`, where the drafter runs.

    A hybrid target (linear-attention layers: Qwen3.5/3.6, Qwen3-Next) gets a `RecurrentRollback`
    (trainer/eval/recurrent.py): every forward continuing a cache snapshots its linear-attention states
    first, and `keep` rolls them back after a rejected draft. A multimodal wrapper is loaded as its
    language model alone (trainer/sources/hooked.py `load_language_model`)."""

    def __init__(
        self,
        target_dir: Path,
        aux_ids: list[int],
        device: torch.device,
        dtype: str = "auto",
        load_kwargs: dict | None = None,
    ):
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        kwargs = {"dtype": self.dtype, "attn_implementation": None, **(load_kwargs or {})}
        self.model = load_language_model(AutoModelForCausalLM, target_dir, **kwargs)  # a VLM: its LM alone
        if not (load_kwargs or {}).get("device_map"):
            self.model.to(self.device)
        self.model.eval().requires_grad_(False)
        self.base = base_model(self.model)
        self.num_layers = len(self.base.layers)
        self.aux_ids = list(aux_ids)
        bad = [k for k in self.aux_ids if not 0 <= k <= self.num_layers]
        if bad:
            raise ModelError(f"drafter aux ids {bad} are outside the target's depth [0, {self.num_layers}]")
        mixers = linear_mixers(self.model)
        self.rollback = RecurrentRollback(mixers) if mixers else None
        self._store: dict[int, torch.Tensor] = {}
        for k in sorted(set(self.aux_ids)):
            module = aux_module(self.base, k)
            module.register_forward_hook(self._hook(k))

    @property
    def hybrid(self) -> bool:
        """The target has linear-attention (recurrent) layers: no tree attention, rollback by re-run."""
        return self.rollback is not None

    def keep(self, cache, past: int, keep: int, forwarded: int) -> None:
        """After a forward of `forwarded` tokens continuing `past` cached positions: keep the first
        `keep` of them in `cache` (crop the KV; a hybrid's linear layers restored and re-run)."""
        if self.rollback is not None:
            self.rollback.rollback(cache, past, keep, forwarded)
        else:
            crop_cache(cache, past + keep)

    def _hook(self, key: int):
        def hook(_module, _args, output):
            self._store[key] = output[0] if isinstance(output, tuple) else output

        return hook

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, cache=None, attention_mask=None, position_ids=None):
        """One forward over `input_ids` [1, n] continuing `cache` (None: a fresh one); a 4D boolean
        `attention_mask` and `position_ids` for a tree (trainer/eval/tree.py), else causal.
        Returns (greedy next token per position [n], aux features [1, n, n_aux*H] fp32, cache)."""
        self._store.clear()
        extra, cache = {}, verify_cache(self.model, cache)  # sliding layers: trainer/eval/layer_masks.py
        if self.rollback is not None:  # a hybrid: its linear-attention states kept for `keep`
            if attention_mask is not None:
                raise ModelError("a tree's attention mask cannot go through linear-attention layers")
            self.rollback.arm(cache)
        if attention_mask is not None:
            extra = {
                "attention_mask": verify_mask(self.model, attention_mask, position_ids),
                "position_ids": position_ids,
            }
        out = self.model(input_ids=input_ids.to(self.device), past_key_values=cache, use_cache=True, **extra)
        # under a device_map each aux layer's output is on its layer's GPU: gathered where the drafter is
        feats = torch.cat([self._store[k].to(self.device) for k in self.aux_ids], dim=-1).float()
        self._store.clear()
        return out.logits[0].argmax(-1).to(self.device), feats, out.past_key_values

    def close(self) -> None:
        """Let the weights go: every hook on the model is removed (each closure refers back to this
        object or to a `ReferenceTarget` holding the model: cycles that `del` alone never frees) and
        the model is dropped."""
        model = self.__dict__.pop("model", None)
        if model is not None:
            for module in model.modules():
                module._forward_hooks.clear()
                module._forward_pre_hooks.clear()
        self.base = None
        self._store.clear()


def release(target: HookedTarget | None, device: torch.device) -> None:
    """Free `target`'s weights before something else needs the device (`--engine both`: vLLM starts
    only with ~0.9 of the GPU free, vllm/v1/worker/utils.py): close it, collect the cycles, and return
    the cached blocks to the driver on CUDA."""
    if target is not None:
        target.close()
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def crop_cache(cache, length: int) -> None:
    """Drop everything past the first `length` positions of a transformers cache."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def is_speculators_folder(folder: Path) -> bool:
    cfg = Path(folder) / "config.json"
    return cfg.is_file() and "speculators_model_type" in json.loads(cfg.read_text())


def resolve_drafter_dir(path: Path) -> Path:
    """A checkpoint folder, an export, a run's out_dir or its checkpoints/, or RUN/checkpoints/latest
    (then the checkpoint `latest` names): trainer/store/checkpoint.py's `resolve_checkpoint`."""
    from trainer.store.checkpoint import LATEST, resolve_checkpoint

    path = Path(path)
    found = resolve_checkpoint(path)
    if found is not None:
        return found
    if path.name == LATEST and path.is_file():
        raise ModelError(
            f"--drafter {path} names {path.read_text().strip()!r}, which is not a complete checkpoint in "
            f"{path.parent}"
        )
    raise ModelError(
        f"--drafter {path}: no config.json there and no checkpoints/latest (give a checkpoint folder, "
        "RUN/checkpoints/latest, an export of `dflash export`, or a run's out_dir)"
    )


def speculators_folder(drafter: Path, target_dir: Path, convert_dir: Path | None = None) -> Path:
    """The drafter as a speculators checkpoint folder: as given, or converted from a z-lab/SpecForge
    format by speculators' converter (which maps their layer ids, id i = output of decoder layer i,
    to speculators' id i+1) into `convert_dir` (default: a temp folder)."""
    from speculators.convert.entrypoints import maybe_convert_external_checkpoint

    folder = resolve_drafter_dir(drafter)
    if is_speculators_folder(folder):
        return folder
    out = Path(convert_dir or tempfile.mkdtemp(prefix="dflash-converted-"))
    try:
        return Path(
            maybe_convert_external_checkpoint(str(folder), verifier=str(target_dir), output_path=str(out))
        )
    except NotImplementedError as exc:
        raise ModelError(
            f"--drafter {folder}: neither a speculators checkpoint nor a known format ({exc})"
        ) from None


def aux_ids_of(folder: Path) -> list[int]:
    return list(json.loads((Path(folder) / "config.json").read_text())["aux_hidden_state_layer_ids"])


def load_drafter(folder: Path, target_dir: Path, device: torch.device):
    """The drafter of a speculators folder (see speculators_folder) for inference: fp32 on
    `device`, sdpa attention, embedding/heads/final norm read from `target_dir`. With the whole
    vocabulary lm_head and verifier_lm_head hold the same target head: one tensor serves both
    (`share_frozen_head`, the same values: nothing the harness computes changes), so the device
    holds two vocab x hidden fp32 matrices, not three (trainer/layout/eval_memory.py counts them)."""
    from speculators.models.dflash import DFlashSpeculatorConfig

    from trainer.drafter.model import load_sdpa_drafter, share_frozen_head

    logging.getLogger("speculators").setLevel(logging.WARNING)
    folder = Path(folder)
    config = DFlashSpeculatorConfig.from_pretrained(str(folder))
    _check_pair(config, folder, Path(target_dir))
    config.speculators_config.verifier.name_or_path = str(target_dir)
    model = load_sdpa_drafter(folder, config)
    share_frozen_head(model)  # before the move: the device never holds the second copy
    return model.float().to(device).eval().requires_grad_(False)


def _check_pair(config, folder: Path, target_dir: Path) -> None:
    from trainer.target.info import TargetInfo

    if not (target_dir / "config.json").is_file():
        raise ModelError(f"--target {target_dir}: no config.json (a transformers model folder is needed)")
    tinfo = TargetInfo.from_folder(target_dir)
    tl = config.transformer_layer_config
    if int(tl.hidden_size) != tinfo.hidden:
        raise ModelError(
            f"{folder}: drafter hidden size {tl.hidden_size} != target {target_dir} hidden size "
            f"{tinfo.hidden}: this drafter was trained for another target"
        )
    if int(tl.vocab_size) != tinfo.vocab:
        raise ModelError(f"{folder}: drafter vocabulary {tl.vocab_size} != target vocabulary {tinfo.vocab}")
    if config.mask_token_id is None:
        raise ModelError(f"{folder}: config.json has no mask_token_id")
