"""`dflash eval`'s options and the checks on them that need no file and no model (light side): a bad
flag is refused before a prompt is read or a model loads."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from trainer.eval.prompts import PromptError

ENGINES = ("harness", "vllm", "both")


@dataclass
class EvalOptions:
    drafters: list[Path]
    target: Path
    prompts: Path
    out: Path
    max_new_tokens: int = 128
    block_size: int | None = None  # None: the drafter's
    device: str = "auto"
    chat_template: bool | None = None
    thinking: str | None = None
    limit: int | None = None
    reference: bool = False
    check_lossless: int = 4  # prompts checked against target greedy; -1: all, 0: none
    ignore_eos: bool = False
    engine: str = "harness"  # harness | vllm | both
    served_tolerance: float = 0.1  # --engine both: the largest |tau_vLLM - tau_harness| that passes
    tree_budgets: tuple[int, ...] = ()  # tree verification (DDTree) at these node budgets, beside the chain
    tree_top_k: int | None = None  # children per tree node among the next depth's top-k (None: the budget)
    tensor_parallel_size: int | None = (
        None  # --engine vllm|both: GPUs vLLM shards the target over (None: planned)
    )
    harness_gpus: int | None = None  # the harness's target spread over this many GPUs (None: planned)


def check_options(opts: EvalOptions) -> None:
    """PromptError naming the flag, for every combination `dflash eval` refuses."""
    if opts.engine not in ENGINES:
        raise PromptError(f"--engine {opts.engine!r}: choose one of {', '.join(ENGINES)}")
    if opts.engine == "vllm" and opts.reference:
        raise PromptError("--reference is the harness's slow loop: use it with --engine harness or both")
    if opts.served_tolerance < 0:
        raise PromptError("--served-tolerance must be >= 0")
    if opts.max_new_tokens < 1:
        raise PromptError("--max-new-tokens must be at least 1")
    if any(b < 1 for b in opts.tree_budgets) or (opts.tree_top_k is not None and opts.tree_top_k < 1):
        raise PromptError("--tree-budget and --tree-top-k must be at least 1")
    if opts.tree_budgets and (opts.reference or opts.engine == "vllm"):
        raise PromptError(
            "--tree-budget runs in the harness's cached loop: not with --reference or --engine vllm"
        )
    if opts.block_size is not None and opts.block_size < 2:
        raise PromptError("--block-size must be at least 2 (an anchor and one draft)")
    if opts.tensor_parallel_size is not None and opts.engine == "harness":
        raise PromptError("--tensor-parallel-size is vLLM's: use it with --engine vllm or both")
    if opts.harness_gpus is not None and opts.engine == "vllm":
        raise PromptError("--harness-gpus is the harness's: use it with --engine harness or both")
    if (opts.tensor_parallel_size or 1) < 1 or (opts.harness_gpus or 1) < 1:
        raise PromptError("--tensor-parallel-size and --harness-gpus must be at least 1")
    if Path(opts.out).suffix != ".json":
        raise PromptError(f"--out {opts.out}: give a .json path (the .md and .png go beside it)")
