"""Evaluation of a drafter against its target: acceptance length tau, measured the way serving
sees it (z-lab's procedure: greedy, KV caches, one target forward verifies a block).

- prompts.py: prompt files (`prompt` / `messages` / `input_ids` lines) and the chat template;
- models.py: the target as a causal LM with aux-layer hooks, the drafter loaded for inference;
- harness.py: the cached speculative-decoding loop (what `dflash eval` runs);
- reference.py: an independent loop without caches (`--reference`) that must agree exactly;
- lossless.py: the lossless check (exact, a near tie in bf16, or a mismatch; light);
- report.py: report.json, the markdown summary, the plots, the side-by-side comparison;
- options.py: `dflash eval`'s options and the checks on them (light);
- checkpoint_eval.py: one checkpoint through the harness (tau, lossless check, trees, the report's
  frame); `evaluate_checkpoint` is its public entry (a checkpoint, the target, a prompt file);
- training_meta.py: the template settings of the drafter's training data (light);
- served.py / served_report.py: tau as vLLM serves the drafter, and its place in the report;
- record.py: the `eval` event in the run's event stream (light);
- run.py: `dflash eval` end to end (validation, the target loaded once, reports written).
"""
