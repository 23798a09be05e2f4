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
