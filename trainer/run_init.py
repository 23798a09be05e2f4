"""`dflash init --target DIR --data DIR --out RUN.yaml`: a run config for a causal LM read from its
folder (config.json, and its tokenizer files when the folder has them; no weights needed).

What it writes, and by which rule (docs/start-a-run.md, "A run config for your model"):

- `drafter.aux_layer_ids`: `AUX_COUNT` target layers spread the way the DFlash paper's code spreads
  them (z-lab's `build_target_layer_ids`: the outputs of decoder layers 1 … L−3, evenly, rounded; five
  layers in z-lab's and SpecForge's recipes), in speculators' convention: on 36 layers z-lab's
  [1, 9, 17, 25, 33] = [2, 10, 18, 26, 34]. The rule is `suggest_aux_ids` of
  trainer/preflight/drafter.py, the one preflight suggests in its own messages. The last layer: its
  output (the input of the final norm) is captured on every run as the verifier's last hidden state, the
  one the training targets come from, so id L is not listed again (speculators' DFlash converter drops
  it for the same reason); the deepest aux id, L−2, is well inside `preflight.deep_layer_warn_gap`.
  speculators' own default when no ids are given, [2, L//2, L−3], is three layers; this keeps the paper's.
- `drafter.mask_token_id`: a row of the target's embedding no text maps to. With a tokenizer in the
  folder, the first that passes preflight's mask checks (`mask_token_problems`) of: the tokenizer's own
  mask token; the first row past the tokenizer's ids (where speculators adds `<|MASK|>` and z-lab's
  Qwen3 drafters have 151669); the tokenizer's added special tokens from the highest id down that are
  neither pad/bos/eos/unk nor in the chat template (SmolLM2: 16 `<empty_output>`; Llama 3:
  `<|reserved_special_token_247|>`). speculators' last resort, pad/eos, is refused (it degrades the
  drafter; preflight refuses it too). Without a tokenizer: the last row of the embedding (a padding
  row or a reserved token on the families in examples/), said so in the file.
- `drafter.block_size` and the recipe's levers (`LEVERS`): the schema's own defaults (trainer/config/run.py,
  the one home of defaults), written out so they are in view; every other key is left out and takes
  its default, so `dflash plan` still chooses `train.shard`, `target.source` and the GPU split.
- `target.path`, `data.path`, `out_dir`: relative to the file's folder when given relative (`out_dir`
  by default: `out` beside the file; the trainer_service role sets its own). A Hub repo id
  (`--target Qwen/Qwen3-32B`, read from the local Hugging Face cache) is written as the node's folder
  `NODE_TARGET` (`{{ dflash_root }}/target` with the inventory's default root: where the data_sync hf
  item of the runbook puts the model), never the controller's cache path; the Hub name, the data_sync
  item and the `dflash plan --target-config hf://...` that reads it are in the file's header.
  `--target-path` writes another path.

Before writing, the config is parsed and run through preflight's config gates for the aux ids and the
drafter (trainer/preflight/drafter.py) against the target's config: `dflash preflight` accepts it
unchanged once the weights and the data are in place. The file is written atomically. Light side.
"""

from __future__ import annotations

import os
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from trainer.config.run import SCHEMA_VERSION, DataConfig, DrafterConfig, TrainConfig, config_from_text
from trainer.errors import DflashError
from trainer.preflight.drafter import aux_gate, drafter_gate, mask_token_problems, suggest_aux_ids
from trainer.preflight.report import PreflightReport
from trainer.store.fsutil import atomic_write_text
from trainer.target.info import ModelConfigError, TargetInfo, read_config
from trainer.target.tokenizer import TokenizerFiles

AUX_COUNT = 5  # target layers the drafter reads: z-lab's and SpecForge's DFlash recipes
LEVERS = {  # section -> keys written with the schema's default (the recipe: what `dflash plan` sizes)
    "data": ("max_length",),
    "drafter": ("num_layers", "block_size"),
    "train": (
        "max_steps",
        "lr",
        "loss",
        "optimizer",
        "position_weights",
        "max_anchors",
        "max_tokens_per_batch",
    ),
}
SECTIONS = {"data": DataConfig, "drafter": DrafterConfig, "train": TrainConfig}
CAUSAL = "ForCausalLM"
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# target.path for a Hub repo id: the node's folder, {{ dflash_root }}/target with the inventory's default
# dflash_root (inventory/group_vars/all/main.yml), where the runbook's data_sync hf item puts the model
NODE_TARGET = Path("/opt/dflash/target")


class InitError(DflashError, ValueError):
    """`dflash init` cannot write a run config from this input; the message says what to pass."""


@dataclass(frozen=True)
class InitResult:
    out: Path
    text: str
    aux_ids: list[int]
    mask: int
    mask_reason: str
    notes: list[str]

    def render(self) -> str:
        lines = [
            f"wrote {self.out}",
            f"  drafter.aux_layer_ids {self.aux_ids} (speculators convention)",
            f"  drafter.mask_token_id {self.mask}: {self.mask_reason}",
            *(f"  note: {n}" for n in self.notes),
            f"check it: dflash preflight --config {self.out}",
        ]
        return "\n".join(lines)


# ---------------------------------------------------------------- the target


def target_folder(arg: str) -> Path:
    """The local model folder `--target` names. A Hub repo id (`Qwen/Qwen3-8B`) is taken only when a
    copy is already on this machine: a folder of that name, or a snapshot in the Hugging Face cache."""
    path = Path(arg).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise InitError(f"--target {arg} is a file, not a model folder (the folder holding config.json)")
    if HUB_ID.match(arg) and not arg.startswith("."):
        cached = hub_cache_snapshot(arg)
        if cached is not None:
            return cached
        raise InitError(
            f"--target {arg} is not a local folder, and as a Hub repo id: no local copy: sync it first "
            "with data_sync (its Hub source) and pass the folder it wrote (init reads a folder, it "
            "downloads nothing)"
        )
    raise InitError(f"--target {arg} does not exist: pass a transformers model folder (config.json)")


def hub_cache_snapshot(repo_id: str) -> Path | None:
    """The snapshot of `repo_id` that the Hugging Face cache's `refs/main` names, when it holds a
    config.json ($HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub)."""
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    cache = Path(os.environ.get("HF_HUB_CACHE") or os.path.join(home, "hub"))
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    try:
        snapshot = repo / "snapshots" / (repo / "refs" / "main").read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return snapshot if (snapshot / "config.json").is_file() else None


def read_target(folder: Path) -> tuple[TargetInfo, str]:
    """The target's shapes and its architecture name; InitError unless config.json is a causal LM's."""
    conf_path = folder / "config.json"
    if not conf_path.is_file():
        raise InitError(
            f"{folder} has no config.json: point --target at a transformers model folder (the weights "
            "may come later; config.json and, when there is one, the tokenizer are what init reads)"
        )
    try:
        conf = read_config(folder)
    except ModelConfigError as exc:
        raise InitError(str(exc)) from None
    archs = conf.get("architectures")
    names = [str(a) for a in archs] if isinstance(archs, list) else []
    causal = [a for a in names if a.endswith(CAUSAL)]
    if not causal and "text_config" in conf:  # a multimodal wrapper with a causal text model inside
        causal = [a for a in names if a.endswith("ForConditionalGeneration")]
    if not causal:
        raise InitError(
            f"{conf_path}: architectures {archs!r} names no causal language model (…{CAUSAL}); dflash "
            "trains drafters for decoder-only LMs"
        )
    needs = "num_hidden_layers, hidden_size, num_attention_heads and vocab_size"
    if "num_hidden_layers" not in conf:
        raise InitError(f"{conf_path} lacks 'num_hidden_layers': not a causal LM config ({needs})")
    try:
        info = TargetInfo.from_folder(folder)
    except ModelConfigError as exc:
        raise InitError(f"{exc}: dflash init reads {needs}") from None
    if info.num_layers < 1:
        raise InitError(f"{conf_path}: num_hidden_layers is {info.num_layers}")
    return info, causal[0]


# ---------------------------------------------------------------- the rules


def aux_layer_ids(num_layers: int, count: int = AUX_COUNT) -> list[int]:
    """The aux ids `dflash init` writes (speculators' convention): the module docstring's rule."""
    return suggest_aux_ids(num_layers, count)


def choose_mask(target: TargetInfo, tokenizer: TokenizerFiles | None) -> tuple[int, str]:
    """(mask token id, why it): the module docstring's rule; InitError when no row qualifies."""
    if tokenizer is None:
        for mask in range(target.vocab - 1, max(target.vocab - 257, -1), -1):
            if not mask_token_problems(mask, target, None):
                return mask, (
                    f"the highest row of the {target.vocab}-row embedding that is no pad/bos/eos id; the "
                    "folder has no tokenizer, so not checked against one (`dflash preflight` checks it "
                    "once the tokenizer is there)"
                )
        raise InitError("no embedding row near the top is free of pad/bos/eos ids: pass --mask-token-id N")
    candidates: list[tuple[int, str]] = []
    if "mask" in tokenizer.role_ids:
        candidates.append((tokenizer.role_ids["mask"], "the tokenizer's own mask token"))
    if tokenizer.size is not None and tokenizer.size < target.vocab:
        candidates.append(
            (
                tokenizer.size,
                f"the first embedding row past the tokenizer's {tokenizer.size} ids (no text maps to it; "
                "where speculators adds <|MASK|>)",
            )
        )
    for tid in sorted(tokenizer.added, reverse=True):
        content, special = tokenizer.added[tid]
        if special:
            why = f"the tokenizer's special token {content!r}: not pad/bos/eos/unk, not in the chat template"
            candidates.append((tid, why))
    for mask, why in candidates:
        if not mask_token_problems(mask, target, tokenizer):
            return mask, why
    raise InitError(
        f"no unused row for the mask token: the tokenizer fills all {target.vocab} embedding rows and its "
        "special tokens are all pad/bos/eos/unk or in the chat template; pass --mask-token-id N (a row "
        "no text maps to)"
    )


def checked_mask(mask: int, target: TargetInfo, tokenizer: TokenizerFiles | None) -> tuple[int, str]:
    """A mask token given by hand, refused on any of preflight's mask problems."""
    problems = mask_token_problems(mask, target, tokenizer)
    if problems:
        raise InitError("--mask-token-id: " + "; ".join(message for _, message in problems))
    return mask, "given with --mask-token-id"


# ---------------------------------------------------------------- the file


def _written(path: Path, out: Path) -> str:
    """`path` as the config writes it: absolute stays absolute; relative becomes relative to the config
    file's folder, against which `load_config` resolves it."""
    if path.is_absolute():
        return str(path)
    return os.path.relpath(path.resolve(), out.parent.resolve())


def _field(section: str, key: str) -> Any:
    return SECTIONS[section].model_fields[key]


def _flow(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()


def _comment(text: str, indent: str) -> list[str]:
    return [f"{indent}# {line}" for line in textwrap.wrap(text, 100 - len(indent))]


def render(sections: dict[str, dict[str, Any]], comments: dict[str, str], header: list[str]) -> str:
    """The run config as YAML: `# comment` lines above the keys `comments` names ("drafter.block_size")."""
    lines = [*(f"# {h}" for h in header), f"schema_version: {SCHEMA_VERSION}"]
    for name, body in sections.items():
        if not isinstance(body, dict):
            lines.append(f"{name}: {_flow(body)}")
            continue
        lines.append(f"{name}:")
        for key, value in body.items():
            lines += _comment(comments.get(f"{name}.{key}", ""), "  ")
            lines.append(f"  {key}: {_flow(value)}")
    return "\n".join(lines) + "\n"


def build(
    folder: Path,
    data: Path,
    out: Path,
    out_dir: Path | None = None,
    mask_token_id: int | None = None,
    aux_count: int = AUX_COUNT,
    hub_id: str | None = None,
    target_path: Path | None = None,
) -> InitResult:
    """The run config's text for the target in `folder` (nothing written); `hub_id`: the Hub repo it is a
    snapshot of; `target_path`: the target.path written instead of `folder`."""
    info, arch = read_target(folder)
    tokenizer = TokenizerFiles.from_folder(folder)
    if mask_token_id is None:
        mask, mask_reason = choose_mask(info, tokenizer)
    else:
        mask, mask_reason = checked_mask(mask_token_id, info, tokenizer)
    aux = aux_layer_ids(info.num_layers, aux_count)
    convention = DrafterConfig.model_fields["layer_id_convention"].default
    comments = {
        "drafter.aux_layer_ids": (
            f"{len(aux)} of the target's {info.num_layers} layers, spread as the DFlash paper's code does "
            f"(outputs of layers 1 ... L-3), in the {convention} convention; the last layer's output is "
            "captured on every run as the verifier's hidden state"
        ),
        "drafter.layer_id_convention": DrafterConfig.model_fields["layer_id_convention"].description or "",
        "drafter.mask_token_id": mask_reason,
    }
    sections: dict[str, Any] = {
        "target": {"path": _written(target_path or folder, out)},
        "data": {"path": _written(data, out)},
        "drafter": {"aux_layer_ids": aux, "layer_id_convention": convention, "mask_token_id": mask},
    }
    for section, keys in LEVERS.items():
        body = sections.setdefault(section, {})
        for key in keys:
            field = _field(section, key)
            body[key] = field.default
            comments[f"{section}.{key}"] = f"{field.description} (the schema's default)"
    sections["out_dir"] = "out" if out_dir is None else _written(out_dir, out)
    header = [
        f"Run config for a {arch} target ({info.num_layers} layers, hidden {info.hidden}, vocabulary "
        f"{info.vocab}), written by `dflash init`.",
        "Keys left out take their defaults: `dflash config --schema` lists every key "
        "(docs/reference/config.md).",
    ]
    if hub_id:
        spec = f"hf://{hub_id}@main"
        where = target_path or folder
        header += [
            f"The target is the Hub's {hub_id}; target.path is where the node holds it, which data_sync's "
            "hf item writes:",
            f'  data_sync_items: [{{name: target, src: "{spec}", dest: {where}, direction: hf}}]',
            f"and the plan reads its config.json from the Hub: dflash plan --config {out.name} "
            f"--target-config {spec}",
        ]
    text = render(sections, comments, header)
    self_check(text, out, info)
    notes = []
    if not data.exists():
        notes.append(f"{data} does not exist yet: preflight refuses the run until the dataset is there")
    return InitResult(out, text, aux, mask, mask_reason, notes)


def self_check(text: str, out: Path, info: TargetInfo) -> None:
    """The text parses as a run config and passes preflight's aux-id and drafter gates against the
    target's config without an error or a warning (a failure here is a dflash bug, not bad input)."""
    cfg = config_from_text(text, out.parent.resolve(), str(out))
    report = PreflightReport()
    aux_gate(cfg, info, report)
    drafter_gate(cfg, info, report)
    found = report.errors + report.warnings
    if found:
        listed = "; ".join(f"{p.code}: {p.message}" for p in found)
        raise InitError(f"the config init made fails preflight's config checks ({listed}): a dflash bug")


def init_run(
    target: str,
    data: Path,
    out: Path,
    out_dir: Path | None = None,
    mask_token_id: int | None = None,
    aux_count: int | None = None,
    force: bool = False,
    target_path: Path | None = None,
) -> InitResult:
    """`dflash init`: check the inputs, build the config, write it atomically."""
    out = Path(out)
    if out.is_dir():
        raise InitError(f"--out {out} is a folder: name the YAML file to write (e.g. {out / 'run.yaml'})")
    if out.exists() and not force:
        raise InitError(f"--out {out} exists: pass --force to overwrite it")
    folder = target_folder(target)
    hub_id = target if not Path(target).expanduser().exists() else None  # found in the HF cache
    if hub_id and target_path is None:
        target_path = NODE_TARGET
    result = build(
        folder, Path(data), out, out_dir, mask_token_id, aux_count or AUX_COUNT, hub_id, target_path
    )
    if hub_id:
        result.notes.append(
            f"target.path {target_path}: the node's copy of the Hub's {hub_id} (read here from {folder}); "
            f"dflash plan --config {out} --target-config hf://{hub_id}@main plans it"
        )
    try:
        atomic_write_text(out, result.text)
    except OSError as exc:
        raise InitError(f"--out {out} cannot be written: {exc.strerror}") from None
    return result
