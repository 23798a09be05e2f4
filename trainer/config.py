"""The run config: the only input of a run (YAML, typed, unknown keys are errors).

Light side: imports no torch/transformers. Defaults follow the DFlash paper and SpecForge's recipe
where they exist (CE loss, gamma 7, 512 anchors, lr 6e-4, warmup + cosine, clip 1.0).

Paths given relative are resolved against the config file's folder, so a run folder can be moved.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from trainer.errors import DflashError
from trainer.training.eval_config import EvalConfig

SCHEMA_VERSION = 1


class ConfigError(DflashError, ValueError):
    """A run config that cannot be used; the message says what to change."""


MAX_WHOLE = 2**53  # any count a config holds: beyond it a float has already lost the number


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @field_validator("*", mode="before")
    @classmethod
    def _whole_numbers(cls, v: Any, info: ValidationInfo) -> Any:
        """A float where a whole number belongs (`max_steps: 1.0e+15`, `block_size: 16.0`) is refused,
        not rounded, and so is a whole number past 2**53."""
        field = cls.model_fields.get(info.field_name or "")
        if field is not None and field.annotation in (int, int | None) and not isinstance(v, bool):
            if isinstance(v, float):
                raise ValueError("not a whole number (write it without . or e)")
            if isinstance(v, int) and abs(v) > MAX_WHOLE:
                raise ValueError("beyond any run (at most 2**53)")
        return v


class VllmSourceConfig(_Section):
    """`target.source: vllm`: a vLLM server holds the target and streams its hidden states."""

    url: str | None = Field(
        None,
        description="a running server to use (http://HOST:PORT, started with the run's layer ids: "
        "`dflash serve-target`); null: the trainer starts and owns one on 127.0.0.1",
    )
    tensor_parallel_size: int = Field(1, ge=1, description="the owned server's tensor parallelism")

    data_parallel_size: int = Field(1, ge=1, description="the owned server's replicas (vLLM's own DP)")
    gpus: list[int] | None = Field(
        None,
        description="CUDA devices of the owned server (null: the last tensor x data parallel ones; "
        "`dflash plan --source vllm` says which)",
    )
    prefetch_batches: int = Field(
        4, ge=1, description="batches each rank has requested ahead (bounds memory and disk)"
    )
    storage_dir: Path | None = Field(
        None,
        description="folder the owned server writes hidden-state files to (null: /dev/shm when "
        "present, else out_dir); each file is deleted once read",
    )
    max_model_len: int | None = Field(
        None, ge=8, description="the owned server's context length (null: data.max_length)"
    )
    gpu_memory_utilization: float = Field(
        0.85, gt=0, le=1, description="share of its GPUs' memory the owned server may take"
    )
    start_timeout_s: float = Field(900.0, gt=0, description="time the owned server may take to load")
    request_timeout_s: float = Field(300.0, gt=0, description="time one hidden-state request may take")
    retries: int = Field(
        5, ge=0, description="retries of a failed request (backoff 1, 2, 4 ... s, capped at 30 s)"
    )

    @field_validator("url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("http://", "https://")):
            raise ValueError(f"{v!r}: an http:// or https:// URL (http://127.0.0.1:8100)")
        return v


class TargetConfig(_Section):
    path: Path = Field(description="transformers model folder (config.json + *.safetensors)")
    source: Literal["hooked", "vllm"] = Field(
        "hooked",
        description="hooked: the target in the trainer's process (one copy per rank); vllm: a vLLM "
        "server holds it and streams hidden states (target.vllm)",
    )
    vllm: VllmSourceConfig = Field(default_factory=VllmSourceConfig)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="auto: bfloat16 on CUDA, float32 on CPU"
    )
    gpus_per_copy: int = Field(
        1, ge=1, description="GPUs one target copy is split over (layer-wise); see `dflash plan`"
    )


class DataConfig(_Section):
    path: Path = Field(description="datasets.save_to_disk folder with input_ids and loss_mask")
    max_length: int = Field(4096, ge=8, description="samples longer than this are dropped (counted)")


class DrafterConfig(_Section):
    num_layers: int = Field(1, ge=1, description="draft decoder layers")
    block_size: int = Field(16, le=256, description="draft block size B (paper: 16); B-1 tokens speculated")
    aux_layer_ids: list[int] = Field(description="target layers fed to the drafter's fc")
    layer_id_convention: Literal["speculators", "specforge"] = Field(
        "speculators",
        description="speculators/vLLM: id k = HF hidden_states[k]; specforge/z-lab: id i = output "
        "of decoder layer i = hidden_states[i+1]",
    )
    mask_token_id: int = Field(description="a real, non-special-purpose row of the target embedding")
    intermediate_size: int | None = Field(None, ge=1, description="MLP width; default: the target's")
    sliding_window: int | None = Field(None, ge=1, description="window of sliding layers")
    full_attention_layers: list[int] | None = Field(
        None, description="draft layers with full attention when sliding_window is set (default: last)"
    )
    attn_implementation: Literal["auto", "sdpa", "eager", "simple_flex_attention"] = Field(
        "auto", description="auto: sdpa on CPU, simple_flex_attention on CUDA"
    )
    warm_start: Path | None = Field(
        None, description="speculators checkpoint folder to take initial weights from (not a resume)"
    )
    draft_vocab_size: int | None = Field(
        None,
        ge=2,
        description="tokens the drafter's heads score (null: the target's whole vocabulary). Set: the "
        "most frequent supervised tokens of data.path (speculators' mapping, ties by id), saved in "
        "every checkpoint as t2d/d2t with the reduced head; each step's heads and loss cost this many "
        "rows instead of the vocabulary (the frozen 49k-row head dominates a CPU step on SmolLM2)",
    )

    def attention_on(self, cuda: bool) -> str:
        """The attention implementation the drafter runs with: `auto` is flex attention on CUDA
        (speculators' default) and sdpa on CPU, which has no flex-attention backward."""
        if self.attn_implementation == "auto":
            return "simple_flex_attention" if cuda else "sdpa"
        return self.attn_implementation

    @property
    def aux_ids(self) -> list[int]:
        """aux_layer_ids in speculators' convention (HF hidden_states index)."""
        if self.layer_id_convention == "specforge":
            return [i + 1 for i in self.aux_layer_ids]
        return list(self.aux_layer_ids)


class TrainConfig(_Section):
    max_steps: int = Field(
        1000, ge=1, le=10**9, description="optimizer steps; the last step event has step=max_steps"
    )
    time_budget: str | None = Field(
        None,
        description="wall time the run may take (20h, 30m, 90s, 1h30m): the lr schedule follows the "
        "run's progress through it, the final checkpoint lands before it ends, restarts count the time "
        "spent; max_steps (unset: 10**9) ends the run if reached first (docs/train.md, time budget)",
    )
    lr: float = Field(6.0e-4, gt=0, description="peak learning rate (SpecForge Qwen3.6-27B: 6e-4)")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="cosine floor as a fraction of lr")
    warmup_steps: int | None = Field(None, ge=0, description="default: warmup_ratio * max_steps")
    warmup_ratio: float = Field(
        0.04, ge=0, le=1, description="warmup share of max_steps when warmup_steps is unset"
    )
    schedule: Literal["cosine", "constant"] = Field(
        "cosine", description="lr after warmup: cosine decay to min_lr_ratio, or constant"
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas")
    grad_clip: float = Field(1.0, gt=0, description="max global grad norm")
    seed: int = Field(0, description="seeds init, sampling order and anchors; same seed = same run")
    checkpoint_every: int = Field(500, ge=1, description="steps between checkpoints (and one at the end)")
    keep_checkpoints: int = Field(3, ge=1, description="newest K complete checkpoints kept")
    max_tokens_per_batch: int = Field(
        8192, ge=8, description="packed sequence length per rank (batch size 1, document ids)"
    )
    grad_accum_steps: int = Field(
        1,
        ge=1,
        description="micro-batches per optimizer step and rank, gradients accumulated: a step sees "
        "world_size x grad_accum_steps packed batches (the same ones, whatever the split)",
    )
    loss: Literal["ce", "kl_div"] = Field("ce", description="ce: hard CE to the verifier argmax (paper)")
    loss_chunk_rows: int = Field(
        0,
        ge=0,
        description="0: speculators' forward holds [anchors x block, vocab] logits and targets; N: heads and "
        "loss over N query rows at a time, recomputed in the backward (same loss; memory of N rows)",
    )
    position_weights: Literal["exp", "dpace"] = Field(
        "exp",
        description="per-position loss weights in a block: exp = exp(-(k-1)/gamma) (the DFlash paper); "
        "dpace = D-PACE, each position weighted by the smoothed chance that the drafter's block is "
        "still accepted there (speculators' dpace_loss_decay, dpace_alpha)",
    )
    gamma: float = Field(
        7.0, gt=0, description="per-position loss decay exp(-(k-1)/gamma) (position_weights exp)"
    )
    dpace_alpha: float = Field(
        0.5, gt=0, le=1, description="D-PACE confidence smoothing (position_weights dpace; speculators' 0.5)"
    )
    optimizer: Literal["adamw", "muon"] = Field(
        "adamw",
        description="adamw: AdamW on every trainable tensor; muon: torch's Muon on the 2-D weight "
        "matrices (speculators' split: not embeddings or heads) and AdamW on the rest, one optimizer "
        "state in the checkpoint, ZeRO-1 and FSDP2 alike",
    )
    muon_lr: float | None = Field(
        None, gt=0, description="Muon's peak learning rate (null: train.lr; the schedule scales both)"
    )
    muon_momentum: float = Field(0.95, ge=0, lt=1, description="Muon's momentum (speculators' 0.95)")
    muon_weight_decay: float = Field(0.1, ge=0, description="Muon's weight decay (speculators' 0.1)")
    max_anchors: int = Field(
        512,
        ge=1,
        description="anchored blocks sampled per packed batch: more anchors train more blocks on one "
        "target forward (the memory model counts anchors x block query rows)",
    )
    precision: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="auto: bf16 autocast on CUDA, float32 on CPU"
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: CUDA when visible, else CPU")
    shard: Literal["none", "optimizer", "full"] = Field(
        "optimizer",
        description="with more than one rank: none = DDP, every rank holds the whole drafter and AdamW; "
        "optimizer = DDP + AdamW's moments sharded (ZeRO-1, torch ZeroRedundancyOptimizer); full = FSDP2 "
        "(torch fully_shard): trainable weights, gradients and moments sharded, each draft layer gathered "
        "only while it runs. Checkpoints hold the full state in one format whatever the level",
    )
    share_target_embedding: bool = Field(
        True,
        description="the drafter's noise embedding read from the in-process target's own embedding "
        "instead of a second fp32 copy (vocab x hidden x 4 B per rank); checked equal at the start, "
        "kept as a copy (and said in run_start) when it is not",
    )
    activation_checkpointing: bool = Field(
        False,
        description="keep only each draft layer's input in the forward and recompute the layer in the "
        "backward (transformers' gradient checkpointing, non-reentrant): activations of one layer, "
        "not of all, at the cost of one more forward of the draft layers",
    )
    log_every: int = Field(1, ge=1, description="steps between step events")
    stop_timeout_s: float = Field(
        600.0, gt=0, description="bound on SIGTERM -> final checkpoint -> exit; past it the run exits 3"
    )
    collective_timeout_s: float = Field(
        900.0,
        gt=0,
        description="bound on one collective (all-reduce, barrier): a rank or node that is gone fails the "
        "others' run after this, and torchrun restarts the group; above the slowest checkpoint write",
    )
    stall_factor: float = Field(
        10.0, gt=1, description="a step running this many times the median step is a stall (warning event)"
    )
    stall_min_s: float = Field(120.0, gt=0, description="never call a step stalled before this many seconds")
    agreement_every: int = Field(
        50,
        ge=1,
        description="steps between target_agreement checks (and step 1): verifier argmax vs the data",
    )
    min_target_agreement: float = Field(
        0.5, ge=0, le=1, description="warn when fewer supervised tokens are the target's own greedy choice"
    )
    nan_tolerance: int = Field(
        3, ge=0, description="consecutive non-finite losses skipped (warned) before the run stops"
    )

    @model_validator(mode="before")
    @classmethod
    def _shard_optimizer_state(cls, data: Any) -> Any:
        """The boolean this field replaced (still in older run.yaml files): true = optimizer, false = none."""
        if isinstance(data, dict) and "shard_optimizer_state" in data:
            data = dict(data)
            old = data.pop("shard_optimizer_state")
            if not isinstance(old, bool):
                raise ValueError(f"train.shard_optimizer_state must be true or false, got {old!r}")
            if "shard" in data and data["shard"] != ("optimizer" if old else "none"):
                raise ValueError(
                    "train.shard_optimizer_state (replaced by train.shard) contradicts train.shard: "
                    "keep only train.shard"
                )
            data["shard"] = "optimizer" if old else "none"
        return data

    @field_validator("time_budget")
    @classmethod
    def _time_budget(cls, v: str | None) -> str | None:
        from trainer.training.budget import parse_duration

        if v is not None:
            parse_duration(v)  # refused here, before any work: exit 2 with the form to write
        return v if v is None else v.strip()

    @model_validator(mode="before")
    @classmethod
    def _budget_steps(cls, data: Any) -> Any:
        """With a time budget and no max_steps, the budget alone ends the run; warm-up is a share of it."""
        if isinstance(data, dict) and data.get("time_budget") is not None:
            if data.get("warmup_steps") is not None:
                raise ValueError("train.warmup_steps counts steps; with train.time_budget use warmup_ratio")
            from trainer.training.budget import BUDGET_ONLY_STEPS

            data = {"max_steps": BUDGET_ONLY_STEPS} | data
        return data

    @property
    def time_budget_s(self) -> float | None:
        from trainer.training.budget import parse_duration

        return None if self.time_budget is None else parse_duration(self.time_budget)

    @model_validator(mode="after")
    def _warmup(self) -> TrainConfig:
        if self.warmup_steps is not None and self.warmup_steps > self.max_steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) > max_steps ({self.max_steps})")
        return self

    @property
    def resolved_warmup_steps(self) -> int:
        if self.warmup_steps is not None:
            return self.warmup_steps
        return int(self.warmup_ratio * self.max_steps)

    def max_tokens_per_step(self, world_size: int) -> int:
        """The most tokens one optimizer step sees over all ranks and micro-batches."""
        return self.max_tokens_per_batch * world_size * self.grad_accum_steps


class PreflightConfig(_Section):
    min_supervised_tokens: int = Field(16, ge=2, description="samples with fewer are 'short'")
    max_bad_fraction: float = Field(
        0.10, ge=0, le=1, description="refuse when short / unusable samples exceed this share"
    )
    deep_layer_warn_gap: float = Field(
        0.25,
        ge=0,
        le=1,
        description="warn when the deepest aux layer is this far (share of depth) below the top",
    )
    disk_reserve_gb: float = Field(2.0, ge=0, description="free disk kept beyond K checkpoints")
    check_memory: bool = Field(
        True, description="compare the memory estimate with the device (false: skip, stated)"
    )


class TrackersConfig(_Section):
    """Settings of the experiment trackers `report_to` names (docs/train.md, Trackers). Secrets (W&B's
    API key, a tracking URI with credentials) come from the environment, never from here."""

    project: str = Field("dflash", min_length=1, description="W&B / trackio project, MLflow experiment")
    wandb_mode: Literal["offline", "online"] = Field(
        "offline",
        description="offline: runs written under out_dir/wandb, uploaded later with `wandb sync`; "
        "online: streamed (WANDB_API_KEY from the environment)",
    )
    max_failures: int = Field(3, ge=1, description="a tracker that fails this many times is dropped")
    close_timeout_s: float = Field(
        30.0, gt=0, description="time the trackers get at the run's end to write what is left"
    )


class RunConfig(_Section):
    schema_version: int = Field(SCHEMA_VERSION, description="version of this file format")
    target: TargetConfig
    data: DataConfig
    drafter: DrafterConfig
    train: TrainConfig = Field(default_factory=TrainConfig)
    preflight: PreflightConfig = Field(default_factory=PreflightConfig)
    out_dir: Path = Field(description="run folder: events.jsonl, train.log, run.yaml, checkpoints/")
    report_to: list[Literal["wandb", "tensorboard", "trackio", "mlflow"]] = Field(
        default_factory=list,
        description="experiment trackers that get the run's events from rank 0 (their packages: "
        "requirements/trackers.txt); [] none",
    )
    trackers: TrackersConfig = Field(default_factory=TrackersConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)

    @field_validator("report_to")
    @classmethod
    def _report_to(cls, v: list[str]) -> list[str]:
        return list(dict.fromkeys(v))  # each tracker once, in the order given

    @field_validator("schema_version")
    @classmethod
    def _schema(cls, v: int) -> int:
        if v != SCHEMA_VERSION:
            raise ValueError(f"this dflash reads schema_version {SCHEMA_VERSION}, the file says {v}")
        return v

    def resolve_paths(self, base: Path) -> RunConfig:
        def fix(p: Path | None) -> Path | None:
            if p is None:
                return None
            p = Path(p).expanduser()
            return p if p.is_absolute() else (base / p).resolve()

        self.target.path = fix(self.target.path)
        self.data.path = fix(self.data.path)
        self.out_dir = fix(self.out_dir)
        self.drafter.warm_start = fix(self.drafter.warm_start)
        self.target.vllm.storage_dir = fix(self.target.vllm.storage_dir)
        self.eval.resolve_paths(base)
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def _parse_scalar(text: str) -> Any:
    """`--set` values are YAML scalars/flow collections: 3, 3e-4, true, [1, 2], null, a/path."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set value {text!r} is not valid YAML: {exc}") from None


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b=value` overrides to a raw config dict (before validation)."""
    out = copy.deepcopy(raw)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY.PATH=VALUE, e.g. --set train.lr=3e-4")
        key, value = item.split("=", 1)
        parts = [p for p in key.strip().split(".") if p]
        if not parts:
            raise ConfigError(f"--set {item!r}: empty key")
        node = out
        for p in parts[:-1]:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"--set {item!r}: {p!r} is not a section")
            node = nxt
        node[parts[-1]] = _parse_scalar(value)
    return out


def _format_validation_error(exc: ValidationError, source: str) -> str:
    lines = [f"{source}: invalid run config ({exc.error_count()} problem(s)):"]
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
        if err["type"] == "extra_forbidden":
            lines.append(f"  - {loc}: unknown key (check its spelling; `dflash config --schema` lists keys)")
        elif err["type"] == "missing":
            lines.append(f"  - {loc}: required key is missing")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"  - {loc}: {msg} (got {err.get('input')!r})")
    return "\n".join(lines)


def config_from_dict(raw: dict[str, Any], base: Path, source: str = "config") -> RunConfig:
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping, got {type(raw).__name__}")
    try:
        cfg = RunConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc, source)) from None
    return cfg.resolve_paths(base)


def config_from_text(text: str, base: Path, source: str, overrides: list[str] | None = None) -> RunConfig:
    """A run config from YAML text (a file's, or stdin's: `dflash plan --config -`); `source` names it
    in messages and relative paths resolve against `base`."""
    try:
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from None
    raw = apply_overrides(raw, overrides or [])
    return config_from_dict(raw, base, source)


def load_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"run config {path} is a folder, not a YAML file (pass --config FILE)")
    if not path.is_file():
        raise ConfigError(f"run config {path} does not exist (pass --config FILE)")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}): save the file as UTF-8") from None
    except OSError as exc:
        raise ConfigError(f"run config {path} cannot be read: {exc.strerror}") from None
    return config_from_text(text, path.resolve().parent, str(path), overrides)


def dump_config(cfg: RunConfig, path: Path) -> None:
    """Write the resolved config (atomic) so a run folder records exactly what ran."""
    from trainer.fsutil import atomic_write_text

    atomic_write_text(path, yaml.safe_dump(cfg.to_dict(), sort_keys=False))
