#!/usr/bin/env python3
"""What a hybrid target's rollback costs per verify round (trainer/eval/recurrent.py), against a dense
target of the same size, in one process, on the same context and block.

Two random-weight models built on the spot, same hidden size, layers, heads, MLP and vocabulary:
- dense: Qwen3 (every layer full attention): a round = one verify forward of B tokens + a KV crop;
- hybrid: Qwen3.5 text (3 of 4 layers Gated DeltaNet): a round = one verify forward (with the
  snapshot of the linear states before it) + the rollback to `keep` tokens: restore + re-run of the
  linear-attention mixers alone on their recorded inputs (what `dflash eval` does), printed beside the
  alternative it was chosen over: restore + a whole forward over the kept tokens.

Usage: .venv/bin/python bench/hybrid_rollback.py [--hidden 512] [--layers 8] [--context 512]
       [--block 16] [--reps 5] [--threads 1] [--device cpu|cuda] [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def build(root: Path, hidden: int, layers: int, vocab: int) -> tuple[Path, Path]:
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3Config, Qwen3ForCausalLM

    heads = max(4, hidden // 64)
    common = {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": hidden * 3,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 4),
        "head_dim": 64,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
    }
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(**common)).save_pretrained(str(root / "dense"))
    hybrid = Qwen3_5TextConfig(
        **common,
        linear_num_key_heads=max(2, heads // 2),
        linear_num_value_heads=heads,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
    )
    Qwen3_5ForCausalLM(hybrid).save_pretrained(str(root / "hybrid"))
    return root / "dense", root / "hybrid"


def timed(fn, sync) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return (time.perf_counter() - t0) * 1000


def measure(folder: Path, args, keeps: list[int]) -> dict[str, float]:
    import torch

    from trainer.eval.models import HookedTarget

    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    target = HookedTarget(folder, [1], dev, dtype=args.dtype)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, args.vocab, (1, args.context), generator=g)
    block = torch.randint(3, args.vocab, (1, args.block), generator=g)
    out: dict[str, list[float]] = {}

    def add(key, ms):
        out.setdefault(key, []).append(ms)

    for _ in range(args.reps):
        for keep in keeps:
            _, _, cache = target.forward(prompt)
            box = {}
            add("verify", timed(lambda: box.update(c=target.forward(block, cache)[2]), sync))
            rollback = lambda: target.keep(cache, args.context, keep, args.block)  # noqa: E731
            add(f"rollback keep {keep}", timed(rollback, sync))
            if target.hybrid:  # the alternative: restore, then the whole target over the kept tokens
                _, _, cache = target.forward(prompt)
                target.forward(block, cache)
                rb = target.rollback

                def full_rerun():
                    rb._inputs.clear()
                    for i, (conv, rec) in rb._snap.items():
                        for k, v in conv.items():
                            cache.layers[i].conv_states[k].copy_(v)
                        for k, v in rec.items():
                            cache.layers[i].recurrent_states[k].copy_(v)
                    for layer in cache.layers:
                        if hasattr(layer, "keys") and layer.get_seq_length() > args.context:
                            layer.crop(args.context - layer.get_seq_length())
                    rb._armed = False
                    target.model(input_ids=block[:, :keep].to(dev), past_key_values=cache, use_cache=True)

                add(f"full re-run keep {keep}", timed(full_rerun, sync))
    target.close()
    return {k: statistics.median(v) for k, v in out.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    keeps = [1, args.block // 4, args.block // 2]
    with tempfile.TemporaryDirectory() as tmp:
        dense, hybrid = build(Path(tmp), args.hidden, args.layers, args.vocab)
        d = measure(dense, args, keeps)
        h = measure(hybrid, args, keeps)
    print(
        f"hidden {args.hidden}, {args.layers} layers, context {args.context}, block {args.block}, "
        f"{args.device} {args.dtype}, {args.threads} thread(s), median of {args.reps} (ms)"
    )
    print(f"dense  verify forward {d['verify']:8.2f}   crop  {d[f'rollback keep {keeps[0]}']:6.3f}")
    print(f"hybrid verify forward {h['verify']:8.2f}   (snapshot of the linear states included)")
    for keep in keeps:
        rb, full = h[f"rollback keep {keep}"], h[f"full re-run keep {keep}"]
        print(
            f"hybrid keep {keep:2d}: rollback (mixers re-run) {rb:7.2f} = {rb / h['verify']:5.1%} of its "
            f"verify | whole-target re-run {full:7.2f} = {full / h['verify']:5.1%}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
