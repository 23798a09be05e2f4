"""The memory model (trainer/layout/sizing.py) against torch's allocator: real `Trainer` steps in fresh
processes (bench/memory.py's measurement, on shapes small enough for the suite), each term that
dominates a configuration within 15 % of the measured peak of live tensor bytes.

What each configuration pins: the logits term (3 fp32 copies of [anchors x block, vocab] at the eager
loss's peak), the chunked loss's (3 copies of a chunk, and the target-agreement check never scoring
more rows than a chunk), the drafter's weights, gradients and AdamW moments (or Muon's single
momentum on the weight matrices) with the activations on one rank, and FSDP2's sharded state plus its
gathered layers over 2 gloo ranks (with AdamW). FSDP2 + Muon is not a row: there the profiler's "Total
Allocated" climbs by ~25 MiB with each optimizer step (31.0 -> 57.7 -> 83.4 MiB after steps 1 and 2 on
rank 1, so the peak reads 1.21x the model) while the process's RSS stays flat over 40 steps (867.8 MiB
at steps 5 to 35) and the tensors Python can reach stay at 60.0 MiB, 10.0 below AdamW's 70.0 as the
model says: frees the profiler does not see (Muon's Newton-Schulz on DTensor shards gathers through
gloo), not memory the run holds.
bench/memory.py prints the same on the larger shapes, with the savings side by side."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MIB = 2**20
VOCAB = {"vocab": 16384, "hidden": 64, "draft_layers": 1, "tokens": 1024, "anchors": 128, "block": 8}
LAYERS = {"vocab": 1024, "hidden": 512, "draft_layers": 2, "tokens": 256, "anchors": 32, "block": 8}
ADAMW = {"optimizer": "adamw"}  # the rows measured with AdamW (the run config's default is Muon)
# Muon's row on a 384-wide drafter: profiled Newton-Schulz steps on LAYERS' 512 took 86.5 s on a quiet 2-core
# machine against 33.6 s here, the same ratio to the model (0.991 and 0.981) with its optimizer term still the
# dominant one (26 % and 22 % of the prediction; the assert wants 20 %)
MUON_LAYERS = {**LAYERS, "hidden": 384}


@pytest.fixture(scope="module")
def bench_memory():
    spec = importlib.util.spec_from_file_location("bench_memory", REPO / "bench" / "memory.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(
    "shape, ranks, train, dominant",
    [
        (VOCAB, 1, ADAMW, "logits"),
        (VOCAB, 1, {**ADAMW, "loss_chunk_rows": 128}, "logits"),
        (LAYERS, 1, ADAMW, "drafter_optimizer"),
        (MUON_LAYERS, 1, {"optimizer": "muon"}, "drafter_optimizer"),
        (LAYERS, 2, {**ADAMW, "shard": "full"}, "drafter_gathered"),
    ],
    ids=["unchunked", "chunked", "one-rank", "one-rank-muon", "fsdp-2-ranks"],
)
def test_the_memory_model_is_within_15_percent_of_the_allocators_peak(
    bench_memory, shape, ranks, train, dominant
):
    row = bench_memory.run_config(shape, ranks, train)
    parts = row["parts"]
    assert parts[dominant] > 0.2 * row["predicted"], f"{dominant} does not matter in this configuration"
    ratio = row["measured"] / row["predicted"]
    big = {k: round(v / MIB, 1) for k, v in parts.items() if v > MIB}
    assert 0.85 <= ratio <= 1.15, (
        f"measured {row['measured'] / MIB:.1f} MiB, the model {row['predicted'] / MIB:.1f} MiB "
        f"(ratio {ratio:.2f}); the model's parts (MiB): {big}"
    )
