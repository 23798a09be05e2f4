"""The hidden-state connectors vLLM loads (through `kv_connector_module_path`) for this project's servers.

vLLM's `extract_hidden_states` method caches the target's chosen hidden states in a KV-cache-like
buffer; a connector writes each finished request's rows to `<shared_storage_path>/<req>.safetensors`.
The reference connector (`ExampleHiddenStatesConnector`, vllm/distributed/kv_transfer/kv_connector/v1/
example_hidden_states_connector.py) writes them with `save_file(tensors, filename)`: no metadata, and
straight to the final name, so a failed write (a full /dev/shm) leaves a truncated file that upstream
only logs ("Hidden-states write failed").

- `HiddenStatesConnector` (CUDA): upstream's scheduling, locking, file naming and CUDA-stream copy,
  and a writer that records the layer ids, the hidden size and the model in the file's metadata (so
  the trainer refuses a server that taps other layers than its run, on CUDA too) and writes under a
  temporary name, renamed when complete (a failed write leaves no file: the reader retries).
- `CpuHiddenStatesConnector` (no CUDA): the same writer; the copy out of the buffer is a clone, since
  upstream's pinned host memory has no CPU equivalent ("pin_memory=True requires a CUDA or other
  accelerator backend") and on CPU the buffer already is host memory.

This module is imported inside vLLM's worker process: it must import nothing of the trainer that
pulls in more than vLLM itself does.
"""

from __future__ import annotations

import fcntl
import json
import os
from functools import partial

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)


def layer_metadata(vllm_config) -> dict[str, str]:
    """What a file records of the server that wrote it: the layer ids it taps (the
    `extract_hidden_states` draft config's), the target's hidden size and model."""
    spec = vllm_config.speculative_config.draft_model_config.hf_config
    model = vllm_config.model_config
    return {
        "layer_ids": json.dumps(list(getattr(spec, "eagle_aux_hidden_state_layer_ids", []))),
        "hidden_size": str(model.get_hidden_size()),
        "model": str(model.model),
    }


class _Done:
    """Stands for the CUDA event of the reference connector: a CPU copy is complete when made."""

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class HiddenStatesConnector(ExampleHiddenStatesConnector):
    """Upstream's connector whose files say which layers they hold (see the module docstring)."""

    def _layer_metadata(self) -> dict[str, str]:
        return layer_metadata(self._vllm_config)

    def _write_tensors(self, tensors, event, filename, lock_fd) -> None:
        """Upstream's writer thread (wait for the copy, write, release the lock) with the metadata and
        a temporary name; called by upstream's `_submit_async_write` as `self._write_tensors(...)`."""
        tmp = f"{filename}.part"
        try:
            event.synchronize()
            try:
                save_file(tensors, tmp, metadata=self._layer_metadata())
                os.replace(tmp, filename)
            except BaseException:
                if os.path.exists(tmp):
                    os.remove(tmp)  # a partial file in a full /dev/shm would keep it full
                raise
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX: a reader waiting on LOCK_SH goes on


class CpuHiddenStatesConnector(HiddenStatesConnector):
    def _submit_async_write(self, pending) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets.reshape(1, -1) + blocks.reshape(-1, 1) * self._block_size).flatten()
        rows = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        tensors = {"hidden_states": rows, "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _Done()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
