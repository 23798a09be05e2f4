"""What a run's vLLM server taps and holds in flight: the layers it keeps, the longest document it is
sent, the documents written and not yet read. Facts of the run config, shared by the source that talks to
the server (trainer/sources/vllm.py), the request preflight checks (trainer/preflight/vllm_request.py) and
the disk and /dev/shm models (trainer/layout/disk.py, trainer/preflight/shm.py). Light side: stdlib only."""

from __future__ import annotations

REQUEST_THREADS = 8  # documents a VllmSource has in flight at once (each: request, read, delete)


def server_layer_ids(aux_ids: list[int], num_layers: int) -> list[int]:
    """The layer ids the server keeps: the run's aux ids, then the verifier's last hidden state (id
    num_layers in speculators' convention: the final norm's input) unless it is already one of them."""
    return list(aux_ids) + ([] if num_layers in aux_ids else [num_layers])


def longest_document(cfg) -> int:
    """The longest document a run sends (samples above data.max_length are dropped, packs cut at the
    batch's token limit)."""
    return min(cfg.data.max_length, cfg.train.max_tokens_per_batch)
