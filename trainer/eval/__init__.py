"""Evaluation of a drafter against its target: acceptance length tau, measured the way serving
sees it (z-lab's procedure: greedy, KV caches, one target forward verifies a block).

- prompts.py: prompt files (`prompt` / `messages` / `input_ids` lines) and the chat template;
- models.py: the target as a causal LM with aux-layer hooks, the drafter loaded for inference;
- harness.py: the cached speculative-decoding loop (what `dflash eval` runs);
- reference.py: an independent loop without caches (`--reference`) that must agree exactly;
- report.py: report.json, the markdown summary, the plots, the side-by-side comparison;
- run.py: `dflash eval` end to end (progress bar, lossless check, data-metadata check).
"""
