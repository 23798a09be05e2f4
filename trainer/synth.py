"""Small target-generated datasets: prompts -> the target's own greedy continuation, loss mask over
the continuation only. Used by the tests and the embedded demo; the large, resumable, chat-template
aware path is `dflash regenerate` (issue #3). Heavy side."""

from __future__ import annotations

from pathlib import Path

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
    import datasets
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
    model.eval()
    rng = np.random.default_rng(seed)
    rows_ids, rows_mask = [], []
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    out: dict[int, tuple[list[int], list[int]]] = {}
    with torch.no_grad():
        for plen, idxs in by_len.items():
            for s in range(0, len(idxs), batch_size):
                chunk = idxs[s : s + batch_size]
                inp = torch.tensor([prompts[i] for i in chunk], dtype=torch.long)
                gen = model.generate(
                    inp,
                    attention_mask=torch.ones_like(inp),
                    max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens,
                    do_sample=False,
                    pad_token_id=0,
                )
                for row, i in zip(gen.tolist(), chunk):
                    out[i] = (row, [0] * plen + [1] * (len(row) - plen))
    for i in range(len(prompts)):
        ids, mask = out[i]
        if empty_fraction and rng.random() < empty_fraction:
            plen = len(prompts[i])
            ids, mask = ids[: plen + 1], [0] * plen + [1]
        rows_ids.append(ids)
        rows_mask.append(mask)
    ds = datasets.Dataset.from_dict({"input_ids": rows_ids, "loss_mask": rows_mask})
    out_dir = Path(out_dir)
    ds.save_to_disk(str(out_dir))
    return out_dir


def tiny_target(out_dir: Path, num_layers: int = 4, hidden: int = 64, vocab: int = 512, seed: int = 0) -> Path:
    """A random Qwen3 target built on the spot (no download), saved as safetensors."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = Qwen3ForCausalLM(cfg)
    # A random init is nearly uniform; sharpen the head so greedy text has structure to learn.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(str(out_dir))
    return Path(out_dir)


# ---------------------------------------------------------------- real prompts, chat template
STDLIB_MODULES = (
    "json", "os.path", "itertools", "functools", "collections", "re", "textwrap", "string", "shutil",
    "pathlib", "statistics", "random", "heapq", "bisect", "datetime", "csv", "base64", "difflib",
    "fnmatch", "glob", "gzip", "hashlib", "inspect", "ipaddress", "operator", "pprint", "shlex",
    "tempfile", "urllib.parse", "uuid", "zipfile", "argparse", "calendar", "copy", "fractions",
)


def stdlib_docstrings(limit: int, seed: int = 0) -> list[str]:
    """First paragraphs of public docstrings of Python's standard library: real text no one here
    wrote, available offline. Deterministic order for a given seed."""
    import importlib
    import inspect

    found: dict[str, str] = {}
    for mod_name in STDLIB_MODULES:
        mod = importlib.import_module(mod_name)
        for name, obj in sorted(vars(mod).items()):
            if name.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj)):
                continue
            doc = inspect.getdoc(obj) or ""
            para = doc.split("\n\n")[0].replace("\n", " ").strip()
            if 40 <= len(para) <= 400:
                found.setdefault(f"{mod_name}.{name}", para)
    keys = sorted(found)
    order = np.random.default_rng(seed).permutation(len(keys))
    return [f"Explain what `{keys[i]}` does in Python and give a short example.\n\n{found[keys[i]]}" for i in order[:limit]]


def chat_dataset(target_dir: Path, questions: list[str], new_tokens: int, out_dir: Path, batch_size: int = 16) -> Path:
    """The target answers each question (chat template, greedy, left-padded batches); the loss mask
    covers the response up to and including the end-of-turn token; nothing after it is kept."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    eos = tok.eos_token_id
    stop_ids = {eos} | ({tok.convert_tokens_to_ids("<|im_end|>")} - {None, tok.unk_token_id})
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
               for q in questions]
    prompts = [p["input_ids"] if isinstance(p, dict) or hasattr(p, "keys") else p for p in prompts]
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    rows_ids, rows_mask = [], []
    with torch.no_grad():
        for s in range(0, len(prompts), batch_size):
            chunk = prompts[s : s + batch_size]
            width = max(len(p) for p in chunk)
            inp = torch.tensor([[pad] * (width - len(p)) + list(p) for p in chunk])
            att = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            gen = model.generate(inp, attention_mask=att, max_new_tokens=new_tokens, do_sample=False,
                                 pad_token_id=pad, eos_token_id=sorted(stop_ids))
            for p, row in zip(chunk, gen[:, width:].tolist()):
                resp = []
                for t in row:  # explicit stop rule: keep the end-of-turn token, drop what follows
                    resp.append(t)
                    if t in stop_ids:
                        break
                rows_ids.append(list(p) + resp)
                rows_mask.append([0] * len(p) + [1] * len(resp))
    ds = datasets.Dataset.from_dict({"input_ids": rows_ids, "loss_mask": rows_mask})
    ds.save_to_disk(str(out_dir))
    return Path(out_dir)
