"""The Hugging Face Hub: `pull.py` (`dflash hub pull`, the repo listing with digests), `push.py`
(`dflash export --push-to-hub`), `card.py` (the model card). This file imports nothing."""
