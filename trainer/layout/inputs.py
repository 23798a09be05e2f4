"""`dflash plan`'s inputs: the target, the recipe and what the run pins, read from the run config
(`--config RUN.yaml`, or `-` for stdin: the one home of every knob the plan uses) or, with no config,
from the flags, whose defaults are the run config's own.

A run config pins what it sets: `train.shard`, `target.source` and `target.gpus_per_copy` written in it
are kept (the plan refuses, exit 2, when they do not fit); left out, the plan chooses them and says so
under `apply`. The recipe flags and `--config` do not mix: each flag names the key to set instead.
Light side: pydantic and yaml through trainer/config/run.py, no torch.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.layout.recipe import PlanError, Recipe

# flag (its argparse dest) -> the run-config key it stands for
CONFIG_KEYS = {
    "draft_layers": "drafter.num_layers",
    "aux_layers": "drafter.aux_layer_ids",
    "block_size": "drafter.block_size",
    "draft_vocab_size": "drafter.draft_vocab_size",
    "anchors": "train.max_anchors",
    "tokens_per_batch": "train.max_tokens_per_batch",
    "loss_chunk_rows": "train.loss_chunk_rows",
    "shard": "train.shard",
    "activation_checkpointing": "train.activation_checkpointing",
    "optimizer": "train.optimizer",
    "source": "target.source",
    "dtype": "target.dtype",
    "gpus_per_copy": "target.gpus_per_copy",
}
# the flags' defaults where the run config's is no answer: "auto" = the plan chooses; aux_layer_ids is
# required in a run config (5: the seeds' recipe)
FLAG_DEFAULTS: dict[str, Any] = {
    "aux_layers": 5,
    "shard": "auto",
    "source": "auto",
    "dtype": "bfloat16",
    "gpus_per_copy": None,
}


@dataclass(frozen=True)
class PlanInputs:
    target_config: Path  # the target's config.json (or its folder) on this machine
    dtype: str  # the target's weight dtype
    recipe: Recipe
    source: str  # auto (the plan chooses), hooked or vllm
    gpus_per_copy: int | None  # pinned (target.gpus_per_copy, --gpus-per-copy); None: the plan chooses
    config: str | None  # the run config read ("-": stdin); None: the flags
    run: Any = None  # that run config (RunConfig), for what the plan reads beyond the recipe (disk)


def flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def config_default(key: str) -> Any:
    """The run config's default of `key` (section.name): one home of the recipe's defaults."""
    from trainer.config.run import RunConfig

    section, name = key.split(".")
    field = RunConfig.model_fields[section].annotation.model_fields[name]
    return field.get_default(call_default_factory=True)


def plan_inputs(args) -> PlanInputs:
    return from_config(args) if args.config else from_flags(args)


def target_config_path(value: str) -> Path:
    """--target-config: a file or folder here, or hf://REPO@REVISION (its config.json from the Hub)."""
    if value.startswith("hf://"):
        from trainer.hub.pull import fetch_file

        return fetch_file(value)
    return Path(value)


def from_flags(args) -> PlanInputs:
    if not args.target_config:
        raise PlanError("pass --config RUN.yaml, or --target-config FILE and the recipe flags")
    v = {
        dest: getattr(args, dest)
        if getattr(args, dest) is not None
        else FLAG_DEFAULTS[dest]
        if dest in FLAG_DEFAULTS
        else config_default(key)
        for dest, key in CONFIG_KEYS.items()
    }
    if v["loss_chunk_rows"] < 0:
        raise PlanError(f"--loss-chunk-rows must be >= 0 (0: no chunking), got {v['loss_chunk_rows']}")
    recipe = Recipe(
        draft_layers=v["draft_layers"],
        n_aux=v["aux_layers"],
        block=v["block_size"],
        anchors=v["anchors"],
        tokens=v["tokens_per_batch"],
        loss_chunk_rows=v["loss_chunk_rows"],
        shard=None if v["shard"] == "auto" else v["shard"],
        activation_checkpointing=v["activation_checkpointing"],
        draft_vocab=v["draft_vocab_size"],
        optimizer=v["optimizer"],
    )
    return PlanInputs(
        target_config_path(args.target_config), v["dtype"], recipe, v["source"], v["gpus_per_copy"], None
    )


def _read(path: str):
    from trainer.config.run import config_from_text, load_config

    if path == "-":
        return config_from_text(sys.stdin.read(), Path.cwd(), "the run config on stdin")
    return load_config(path)


def from_config(args) -> PlanInputs:
    mixed = [dest for dest in CONFIG_KEYS if getattr(args, dest) is not None]
    if mixed:
        raise PlanError(
            f"{', '.join(map(flag, mixed))} with --config: the run config is the one home of the recipe; "
            f"set {', '.join(CONFIG_KEYS[d] for d in mixed)} in it instead"
        )
    cfg = _read(args.config)
    target, train, drafter = cfg.target, cfg.train, cfg.drafter
    if train.device == "cpu":
        raise PlanError(
            f"{args.config}: train.device cpu, but the plan is for GPUs: leave train.device out (the plan "
            "sets cuda on a GPU node)"
        )
    path = target_config_path(args.target_config) if args.target_config else target.path
    if not args.target_config and not (path / "config.json").is_file():
        raise PlanError(
            f"the target's config.json is not readable at target.path {path} on this machine: pass "
            "--target-config FILE, a copy of it here (trainer_service role: trainer_service_target_config)"
        )
    pinned = train.model_fields_set | target.model_fields_set
    gpus_per_copy = target.gpus_per_copy if "gpus_per_copy" in pinned else None
    source = target.source if "source" in pinned else "auto"
    if source == "vllm" and gpus_per_copy == 1:
        gpus_per_copy = None  # the split's own value: its trainer ranks hold no target copy
    recipe = Recipe(
        draft_layers=drafter.num_layers,
        n_aux=len(drafter.aux_ids),
        block=drafter.block_size,
        anchors=train.max_anchors,
        tokens=train.max_tokens_per_batch,
        loss_chunk_rows=train.loss_chunk_rows,
        shard=train.shard if "shard" in pinned else None,
        activation_checkpointing=train.activation_checkpointing,
        draft_vocab=drafter.draft_vocab_size,
        optimizer=train.optimizer,
        draft_intermediate=drafter.intermediate_size,
        share_embedding=train.share_target_embedding,
        activation_bytes=4 if train.precision == "float32" else None,
        dense_attention=drafter.attention_on(cuda=True) != "simple_flex_attention",
        vllm_memory_share=target.vllm.gpu_memory_utilization,
    )
    dtype = "bfloat16" if target.dtype == "auto" else target.dtype
    return PlanInputs(path, dtype, recipe, source, gpus_per_copy, args.config, cfg)
