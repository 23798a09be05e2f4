"""The dataset's metadata file, the backend names and the error of `dflash regenerate`. Light."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainer.errors import DflashError

DATA_META = "dflash_data.json"
META_SCHEMA_VERSION = 1
BACKENDS = ("transformers", "vllm", "server")


class RegenerateError(DflashError, ValueError):
    """Arguments or a partial run that cannot be used; the message says what to change."""


def read_data_meta(folder: Path) -> dict[str, Any] | None:
    """The regeneration metadata of a dataset (or an export that copied it); None if absent."""
    f = Path(folder) / DATA_META
    if not f.is_file():
        return None
    try:
        return json.loads(f.read_text())
    except ValueError:
        return None
