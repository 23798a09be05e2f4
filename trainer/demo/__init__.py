"""The embedded default: SmolLM2-135M from its PyPI package (smollm), tiny random targets and synthetic
data (synth), and `dflash demo` (run)."""
