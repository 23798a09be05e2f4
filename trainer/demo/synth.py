"""Small target-generated datasets: prompts -> the target's own greedy continuation, loss mask over
the continuation only. Used by the tests and the embedded demo. Both helpers go through the one
generation path of `dflash regenerate` (trainer/regenerate/). Heavy side."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def greedy_dataset(
    target_dir: Path,
    prompts: list[list[int]],
    new_tokens: int,
    out_dir: Path,
    batch_size: int = 16,
    empty_fraction: float = 0.0,
    seed: int = 0,
) -> Path:
    """Write a save_to_disk dataset of prompt + greedy continuation.

    `empty_fraction` > 0 replaces that share of responses by an empty answer (only the first
    response token supervised): the seeds' failure mode, for testing the data gate."""
    from trainer.regenerate import TransformersBackend, plan_batches, respond, save_dataset

    backend = TransformersBackend(Path(target_dir), stop_ids=[], device="cpu", pad_id=0)  # fixed length
    rng = np.random.default_rng(seed)
    rows: list[dict] = [{}] * len(prompts)
    for idx in plan_batches(prompts, batch_size):
        for i, row in zip(idx, respond(backend, [prompts[i] for i in idx], new_tokens, set())):
            rows[i] = row
    for i, row in enumerate(rows):
        if empty_fraction and rng.random() < empty_fraction:
            plen = len(prompts[i])
            rows[i] = {"input_ids": row["input_ids"][: plen + 1], "loss_mask": [0] * plen + [1]}
    return save_dataset(rows, Path(out_dir))


def random_target(
    out_dir: Path,
    shape: dict[str, Any],
    *,
    seed: int = 0,
    device: str = "cpu",
    dtype: str = "float32",
    sharpen_head: float = 8.0,
) -> Path:
    """A random-weight Qwen3 target of `shape` (Qwen3Config fields) built on the spot (no download) on
    `device` in `dtype`, saved as safetensors. A random init is nearly uniform: the head is scaled by
    `sharpen_head` so that greedy text has structure to learn."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    defaults = {"tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    cfg = Qwen3Config(**{**defaults, **shape})
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg).to(getattr(torch, dtype))
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen_head)
    model.save_pretrained(str(out_dir))
    return Path(out_dir)


def tiny_target(
    out_dir: Path, num_layers: int = 4, hidden: int = 64, vocab: int = 512, seed: int = 0
) -> Path:
    """The tests' and the demo's random Qwen3 target (fp32, CPU)."""
    shape = {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": hidden * 2,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": hidden // 4,
        "max_position_embeddings": 4096,
    }
    return random_target(out_dir, shape, seed=seed)


def servable_tiny_target(out_dir: Path, seed: int = 0) -> Path:
    """A tiny random Qwen3 a vLLM server takes (CPU): head size 64, which vLLM's CPU attention kernels
    need, and a word-level tokenizer (the OpenAI server loads one; `w<i>` is token i, `</s>` is id 2,
    the config's EOS). Prompts for it are token ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    out_dir = Path(out_dir)
    tiny_target(out_dir, num_layers=2, hidden=256, seed=seed)
    special = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {t: i for i, t in enumerate(special)} | {f"w{i}": i for i in range(len(special), 512)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    ).save_pretrained(str(out_dir))
    return out_dir


# ---------------------------------------------------------------- real prompts, chat template
STDLIB_MODULES = (
    "json",
    "os.path",
    "itertools",
    "functools",
    "collections",
    "re",
    "textwrap",
    "string",
    "shutil",
    "pathlib",
    "statistics",
    "random",
    "heapq",
    "bisect",
    "datetime",
    "csv",
    "base64",
    "difflib",
    "fnmatch",
    "glob",
    "gzip",
    "hashlib",
    "inspect",
    "ipaddress",
    "operator",
    "pprint",
    "shlex",
    "tempfile",
    "urllib.parse",
    "uuid",
    "zipfile",
    "argparse",
    "calendar",
    "copy",
    "fractions",
)


# modules `wide` leaves out: they act on import (a browser, a printout, a GUI) or only wrap others
STDLIB_SKIP = frozenset(
    "antigravity this idlelib tkinter turtle turtledemo lib2to3 ensurepip venv pydoc_data msvcrt "
    "winreg winsound nt".split()
)
# the ask of a code completion: the quality bench's HumanEval set asks it too (the same instruction, code
# from another source)
COMPLETE_ASK = "Complete this Python function. Reply with the whole function.\n\n```python\n{code}```"
TEMPLATES = {
    "explain": "Explain what `{name}` does in Python and give a short example.\n\n{doc}",
    "write": "Write a short Python function that does what this describes, then show one call of it."
    "\n\n{doc}",
    # a stub of the object (its signature where Python knows it, the paragraph as its docstring)
    "complete": COMPLETE_ASK.replace("{code}", "{stub}"),
}


def stdlib_docstrings(
    limit: int, seed: int = 0, wide: bool = False, templates: tuple[str, ...] = ("explain",)
) -> list[str]:
    """First paragraphs of public docstrings of Python's standard library as prompts: real text no one
    here wrote, available offline. Deterministic order for a given seed.

    `wide`: every importable public module of the standard library (~1,800 distinct paragraphs on
    Python 3.11) instead of STDLIB_MODULES (~400), each object under the module that defines it, a
    paragraph once. `templates`: the prompt forms (TEMPLATES), taken in turn along the shuffled order,
    each docstring used once."""
    import importlib
    import inspect
    import sys
    import warnings

    bad = [t for t in templates if t not in TEMPLATES]
    if bad or not templates:
        raise ValueError(f"templates {bad or templates}: use some of {', '.join(TEMPLATES)}")
    names = STDLIB_MODULES
    if wide:
        names = tuple(
            m for m in sorted(sys.stdlib_module_names) if not m.startswith("_") and m not in STDLIB_SKIP
        )
    found: dict[str, str] = {}
    stubs: dict[str, str] = {}
    seen: set[str] = set()
    for mod_name in names:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mod = importlib.import_module(mod_name)
        except Exception:  # a platform's module (winreg, ...) or one missing an optional library
            if not wide:
                raise
            continue
        for name, obj in sorted(vars(mod).items()):
            if name.startswith("_") or not (
                inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj)
            ):
                continue
            if wide and not inspect.isbuiltin(obj) and getattr(obj, "__module__", mod_name) != mod_name:
                continue  # a re-export: its own module has it
            doc = inspect.getdoc(obj) or ""
            para = doc.split("\n\n")[0].replace("\n", " ").strip()
            if 40 <= len(para) <= 400 and not (wide and para in seen):
                key = f"{mod_name}.{name}"
                if key not in found:
                    found[key], stubs[key] = para, _stub(name, obj, para)
                seen.add(para)
    keys = sorted(found)
    order = np.random.default_rng(seed).permutation(len(keys))
    return [
        TEMPLATES[templates[j % len(templates)]].format(name=keys[i], doc=found[keys[i]], stub=stubs[keys[i]])
        for j, i in enumerate(order[:limit])
    ]


def _stub(name: str, obj, doc: str) -> str:
    """`def name(signature):` (or `class name:`) with `doc` as its docstring, wrapped at 88 columns."""
    import inspect
    import textwrap

    text = doc.replace("\\", "\\\\").replace('"' * 3, "'" * 3)
    body = textwrap.fill(text, 84, initial_indent="    ", subsequent_indent="    ")
    if inspect.isclass(obj):
        head = f"class {name}:"
    else:
        head = f"def {name}{_signature(obj)}:"
    quote = '"' * 3
    return f"{head}\n    {quote}\n{body}\n    {quote}\n"


def chat_dataset(
    target_dir: Path, questions: list[str], new_tokens: int, out_dir: Path, batch_size: int = 16
) -> Path:
    """The target answers each question (chat template, greedy, left-padded batches) via
    `dflash regenerate`'s code: loss mask over the response up to and including the end-of-turn
    token, nothing after it; dflash_data.json records the template used."""
    import tempfile

    from trainer.eval.prompts import write_prompt_file
    from trainer.regenerate import RegenOptions, regenerate

    with tempfile.TemporaryDirectory(prefix="dflash-questions-") as tmp:
        prompts = write_prompt_file(Path(tmp) / "questions.jsonl", [{"prompt": q} for q in questions])
        return regenerate(
            RegenOptions(
                target=Path(target_dir),
                prompts=prompts,
                out=Path(out_dir),
                max_new_tokens=new_tokens,
                batch_size=batch_size,
                device="cpu",
            )
        )


class _Elided:
    def __repr__(self) -> str:
        return "..."


def _signature(obj) -> str:
    """The object's signature as source text: a default whose repr is not Python (`<class 'str'>`, a
    function at an address that changes from run to run) shown as `...`; `(*args, **kwargs)` where Python
    knows none or the text still does not parse."""
    import ast
    import inspect

    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):  # a builtin without a text signature
        return "(*args, **kwargs)"
    params = [
        p.replace(default=_Elided()) if p.default is not p.empty and repr(p.default).startswith("<") else p
        for p in sig.parameters.values()
    ]
    text = str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))
    try:
        ast.parse(f"def f{text}: pass")
    except SyntaxError:
        return "(*args, **kwargs)"
    return text
