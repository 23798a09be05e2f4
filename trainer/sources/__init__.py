"""Hidden-state sources: where the drafter's context features come from.

The loop only knows `HiddenStateSource` (base.py). `hooked.py` runs the target in process with
forward hooks; a vLLM-server source (speculators' hs-connectors, for targets that need tensor
parallelism) plugs in beside it without touching the loop."""

from trainer.sources.base import Captured, HiddenStateSource, make_source

__all__ = ["Captured", "HiddenStateSource", "make_source"]
