"""`dflash export`: a checkpoint -> a weights-only speculators folder a server loads directly.

The checkpoint's trainer state (optimizer moments, sampler, RNG) is left behind; config.json and
model.safetensors are written by speculators' save_pretrained (trainable weights only; the
embedding and heads come from the verifier at load time). The export is reloaded and must give
bit-identical drafter logits on a probe before it appears under its final name. Beside the
weights: dflash_export.json (provenance, sizes, the serve line) and dflash_data.json (the chat
template / thinking mode of the training data, when known: `dflash eval` compares them).
`vllm_check`: vLLM loads the export and must read it as trained (off by default: it starts an engine,
a minute and, on a GPU, most of a GPU's memory, which a node in the middle of a run does not have).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from trainer.errors import DflashError
from trainer.store.fsutil import atomic_write_text, dir_size, sha256_file


class ExportError(DflashError, ValueError):
    """A checkpoint that cannot be exported; the message says what to change."""


def serve_command(verifier: str, model_dir: Path, block_size: int) -> str:
    spec = json.dumps({"method": "dflash", "model": str(model_dir), "num_speculative_tokens": block_size - 1})
    return f"vllm serve {verifier} --speculative-config '{spec}'"


@torch.no_grad()
def probe_logits(drafter, seed: int = 0, ctx: int = 12) -> torch.Tensor:
    """Draft logits of one block on a fixed random context: the reload check's fingerprint."""
    from trainer.eval.harness import CachedDrafter

    g = torch.Generator().manual_seed(seed)
    width = drafter.fc.in_features
    feats = torch.randn(1, ctx, width, generator=g).to(next(drafter.parameters()).dtype)
    anchor = int(torch.randint(0, drafter.embed_tokens.num_embeddings, (1,), generator=g))
    return CachedDrafter(drafter, int(drafter.config.block_size)).block_logits(feats, anchor, ctx)


def has_sliding_layers(config) -> bool:
    """Whether any draft layer is a sliding-window layer (speculators' `transformer_layer_config`)."""
    layers = config.transformer_layer_config
    types = getattr(layers, "layer_types", None) or []
    return bool(getattr(layers, "use_sliding_window", False)) or "sliding_attention" in types


def serve_as_trained(config) -> str:
    """Make vLLM run the draft block the way speculators trained it, and say how.

    speculators trains full-attention draft layers with a non-causal block whatever
    `sliding_window_non_causal` says (the flag is about sliding-window layers only); vLLM 0.32 turns
    that flag into a causal override for *every* layer, so a default export (flag false) is served
    with a causal draft block: measured here on a tiny drafter, tau 2.224 served against 2.243 in the
    harness, 2.243 in both once the flag is set. With no sliding-window layer, setting it changes nothing in
    speculators (the reload check proves it) and makes vLLM serve the block non-causal."""
    if has_sliding_layers(config):
        return "as configured (sliding-window layers: sliding_window_non_causal left as trained)"
    config.sliding_window_non_causal = True
    return "non-causal, as trained (sliding_window_non_causal set so that vLLM does not serve it causal)"


def vllm_load_check(folder: Path, target: Path, block_size: int, source: Path) -> dict[str, Any]:
    """vLLM loads the export beside its target and drafts a few tokens; how it read the config (layers
    tapped, mask token, causality) must be how the drafter was trained, or the export is refused."""
    from trainer.eval.served import ServedError, serve_export

    vocab = int(json.loads((Path(target) / "config.json").read_text()).get("vocab_size", 32))
    probe = [[(7 * i + 3) % vocab for i in range(12)]]
    try:
        served = serve_export(folder, target, probe, 8, block_size, set(), flag="--vllm-check", source=source)
    except ServedError as exc:
        raise ExportError(str(exc)) from None
    failed = [c["detail"] for c in served["checks"] if not c["ok"]]
    if failed:
        raise ExportError("vLLM would serve another drafter than the one trained: " + "; ".join(failed))
    return {k: served[k] for k in ("engine", "dtype", "device", "engine_view", "checks", "start_s")}


def verifier_config(verifier: str) -> tuple[dict[str, Any], str]:
    """(the config.json of `--verifier`, where it was read): a local folder (or its config.json), an
    `hf://REPO@REVISION`, or a Hub repo id read from the local Hugging Face cache, else from the Hub
    (as `dflash init` and `dflash plan --target-config` find them)."""
    from trainer.hub.pull import HubError, fetch_file
    from trainer.run_init import HUB_ID, hub_cache_snapshot
    from trainer.target.info import ModelConfigError, read_config

    path = Path(verifier).expanduser()
    try:
        if path.exists():
            return read_config(path), str(path)
        if verifier.startswith("hf://"):
            where = fetch_file(verifier)
        elif HUB_ID.match(verifier) and not verifier.startswith("."):
            cached = hub_cache_snapshot(verifier)
            where = cached / "config.json" if cached is not None else fetch_file(f"hf://{verifier}@main")
        else:
            raise ExportError(
                f"--verifier {verifier}: neither a model folder here nor a Hub repo id (ORG/NAME)"
            )
        return read_config(where), str(where)
    except (HubError, ModelConfigError) as exc:
        raise ExportError(
            f"--verifier {verifier}: its config.json cannot be read to check it is the model the drafter was "
            f"trained for ({exc}); cache it (`hf download {verifier.removeprefix('hf://')} config.json`) "
            "or pass its folder"
        ) from None


def check_verifier(verifier: str, target: Path, aux_ids: list[int]) -> str:
    """Refuse (exit 2) a `--verifier` that is not the model the drafter was trained for: its hidden
    size, vocabulary and layer count must be the training target's, and it must have the layers the
    drafter reads (aux_layer_ids). Returns where its config was read."""
    from trainer.target.info import read_config

    conf, where = verifier_config(verifier)
    trained = read_config(target)
    keys = ("hidden_size", "vocab_size", "num_hidden_layers")
    differ = [
        f"{k} {conf.get(k)} (trained on {trained.get(k)})" for k in keys if conf.get(k) != trained.get(k)
    ]
    layers = conf.get("num_hidden_layers")
    if isinstance(layers, int) and aux_ids and max(aux_ids) > layers:
        differ.append(f"aux_layer_ids {aux_ids} reach past its {layers} layers")
    if differ:
        raise ExportError(
            f"--verifier {verifier} is not the model this drafter was trained for ({where}: "
            + "; ".join(differ)
            + f"; the training target: {target}): pass the target's own Hub name or folder"
        )
    return where


def _round_to(model, dtype: torch.dtype | None):
    """The weights as the export stores them (cast to `dtype`, back to fp32 for the probe)."""
    if dtype is not None:
        for p in model.parameters():
            p.data = p.data.to(dtype).float()
    return model


def export(
    checkpoint: Path,
    out: Path,
    target: Path | None = None,
    verifier: str | None = None,
    dtype: str | None = None,
    vllm_check: bool = False,
) -> dict[str, Any]:
    from trainer.eval.models import load_drafter, resolve_drafter_dir
    from trainer.eval.training_meta import training_data_meta
    from trainer.regenerate import DATA_META
    from trainer.store.checkpoint import SUMS, read_meta, verify_checkpoint

    try:
        folder = resolve_drafter_dir(checkpoint)
    except ValueError as exc:
        raise ExportError(str(exc).replace("--drafter", "--checkpoint")) from None
    out = Path(out)
    if out.exists():
        raise ExportError(f"--out {out} exists: choose a new folder")
    if (folder / SUMS).is_file():
        bad = verify_checkpoint(folder)
        if bad:
            raise ExportError(f"{folder} does not verify: {'; '.join(bad)} (export an older checkpoint)")
    cfg = json.loads((folder / "config.json").read_text())
    if "speculators_model_type" not in cfg:
        raise ExportError(
            f"{folder}: not a speculators checkpoint (config.json has no speculators_model_type)"
        )
    recorded = cfg.get("speculators_config", {}).get("verifier", {}).get("name_or_path")
    target = Path(target) if target is not None else (Path(recorded) if recorded else None)
    if target is None or not (target / "config.json").is_file():
        raise ExportError(
            f"the target recorded in {folder}/config.json ({recorded}) is not a local model folder: "
            "pass --target DIR"
        )
    if verifier is not None:  # another model's name in the export's config: refused before any work
        check_verifier(verifier, target, list(cfg.get("aux_hidden_state_layer_ids") or []))
    if vllm_check:  # a family vLLM cannot serve a DFlash drafter for: refused before any work
        from trainer.eval.served import ServedError, served_family_check

        try:
            served_family_check(target, "--vllm-check")
        except ServedError as exc:
            raise ExportError(str(exc)) from None
    cast = getattr(torch, dtype) if dtype else None
    model = load_drafter(folder, target, torch.device("cpu"))
    before = probe_logits(_round_to(model, cast))
    model.config.speculators_config.verifier.name_or_path = verifier or str(target)
    attention = serve_as_trained(model.config)
    tmp = out.parent / f".{out.name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        (model.to(cast) if cast is not None else model).save_pretrained(str(tmp))
        reloaded = load_drafter(tmp, target, torch.device("cpu"))
        after = probe_logits(reloaded)
        if not torch.equal(before, after):
            raise ExportError(
                f"the reloaded export gives different logits (max diff "
                f"{(before - after).abs().max().item():.3g}): export refused"
            )
        loaded_by_vllm = (
            vllm_load_check(tmp, target, int(model.config.block_size), folder) if vllm_check else None
        )
        step = read_meta(folder).get("step") if (folder / "meta.json").is_file() else None
        data_meta, data_where = training_data_meta(folder)
        if data_meta is not None:
            atomic_write_text(tmp / DATA_META, json.dumps({**data_meta, "copied_from": data_where}, indent=1))
        B = int(model.config.block_size)
        size_before, size_after = dir_size(folder), dir_size(tmp)
        info = {
            "source": str(folder),
            "step": step,
            "target": str(target),
            "verifier": verifier or str(target),
            "dtype": dtype or "as trained",
            "block_size": B,
            "aux_layer_ids": list(model.config.aux_hidden_state_layer_ids),
            "bytes_before": size_before,
            "bytes_after": size_after,
            "files": {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()},
            "reload_check": "bit-identical drafter logits on a probe block",
            "draft_block_attention": attention,
            "vllm_load_check": loaded_by_vllm or "not run (dflash export --vllm-check runs it)",
            "serve": serve_command(verifier or str(target), out.resolve(), B),
        }
        atomic_write_text(tmp / "dflash_export.json", json.dumps(info, indent=1))
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    info["bytes_after"] = dir_size(out)
    print(f"exported {folder} -> {out}")
    print(
        f"size: {size_before / 2**20:.2f} MiB before (with trainer state), {info['bytes_after'] / 2**20:.2f} "
        "MiB after"
    )
    print("reload check: bit-identical drafter logits")
    if loaded_by_vllm:
        print(
            f"vLLM load check: {loaded_by_vllm['engine']} serves it as trained (taps "
            f"{loaded_by_vllm['engine_view']['aux_layer_ids']}, mask token "
            f"{loaded_by_vllm['engine_view']['mask_token_id']}, non-causal block)"
        )
    print(f"serve it with:\n  {info['serve']}")
    return info
