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
    Field,
    ValidationError,
    field_validator,
)

from trainer.config import user_yaml
from trainer.config.eval import EvalConfig
from trainer.config.section import Section, seconds
from trainer.config.train import TrainConfig
from trainer.errors import DflashError

SCHEMA_VERSION = 1


class ConfigError(DflashError, ValueError):
    """A run config that cannot be used; the message says what to change."""


class VllmSourceConfig(Section):
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
    start_timeout_s: float = seconds(900.0, "time the owned server may take to load")
    request_timeout_s: float = seconds(300.0, "time one hidden-state request may take")
    retries: int = Field(
        5, ge=0, description="retries of a failed request (backoff 1, 2, 4 ... s, capped at 30 s)"
    )

    @field_validator("url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("http://", "https://")):
            raise ValueError(f"{v!r}: an http:// or https:// URL (http://127.0.0.1:8100)")
        return v


class TargetConfig(Section):
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


class DataConfig(Section):
    path: Path = Field(description="datasets.save_to_disk folder with input_ids and loss_mask")
    max_length: int = Field(4096, ge=8, description="samples longer than this are dropped (counted)")


class DrafterConfig(Section):
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
    init: Literal["random", "target"] = Field(
        "random",
        description="the fresh drafter's layers: random, or target: copies of the target's last "
        "num_layers layers (attention, MLP, norms), its final norm, fc passing the deepest aux layer "
        "through (trainer/drafter/target_init.py); not with warm_start",
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


class PreflightConfig(Section):
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
    disk_reserve_gb: float = Field(2.0, ge=0, le=1e9, description="free disk kept beyond K checkpoints")
    check_memory: bool = Field(
        True, description="compare the memory estimate with the device (false: skip, stated)"
    )


class TrackersConfig(Section):
    """Settings of the experiment trackers `report_to` names (docs/train.md, Trackers). Secrets (W&B's
    API key, a tracking URI with credentials) come from the environment, never from here."""

    project: str = Field("dflash", min_length=1, description="W&B / trackio project, MLflow experiment")
    wandb_mode: Literal["offline", "online"] = Field(
        "offline",
        description="offline: runs written under out_dir/wandb, uploaded later with `wandb sync`; "
        "online: streamed (WANDB_API_KEY from the environment)",
    )
    max_failures: int = Field(3, ge=1, description="a tracker that fails this many times is dropped")
    close_timeout_s: float = seconds(30.0, "time the trackers get at the run's end to write what is left")


class RunConfig(Section):
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
        return user_yaml.safe_load(text)
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
        raw = user_yaml.safe_load(text) or {}
    except user_yaml.DuplicateKeyError as exc:  # the last one would win silently
        raise ConfigError(f"{source}: {exc}") from None
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
    from trainer.store.fsutil import atomic_write_text

    atomic_write_text(path, yaml.safe_dump(cfg.to_dict(), sort_keys=False))
