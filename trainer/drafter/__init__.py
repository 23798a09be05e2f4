"""The DFlash drafter: `model.py` (built from the run config, its trainable weights, loading one for
inference), `target_init.py` (`drafter.init: target`, the copy from the target's last layers),
`vocab.py` (`drafter.draft_vocab_size`, the reduced vocabulary). This file imports nothing: torch and
speculators come with the modules."""
