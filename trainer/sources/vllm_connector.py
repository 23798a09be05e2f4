"""The hidden-state connector vLLM loads (through `kv_connector_module_path`) on a host without CUDA.

vLLM's `extract_hidden_states` method caches the target's chosen hidden states in a KV-cache-like
buffer; a connector writes each finished request's rows to `<shared_storage_path>/<req>.safetensors`.
The reference connector (`ExampleHiddenStatesConnector`) copies them out on a CUDA stream into pinned
host memory, which has no CPU equivalent ("pin_memory=True requires a CUDA or other accelerator
backend"). `CpuHiddenStatesConnector` keeps all of its scheduling, locking and file naming and replaces
only that copy: on CPU the buffer already is host memory, so the rows are cloned and written by the
same writer threads. It also records the layer ids and the hidden size in the file's metadata, so the
trainer can refuse a server that taps other layers than its run. On CUDA the upstream class is used.

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


class _Done:
    """Stands for the CUDA event of the reference connector: a CPU copy is complete when made."""

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _layer_metadata(self) -> dict[str, str]:
        spec = self._vllm_config.speculative_config.draft_model_config.hf_config
        ids = list(getattr(spec, "eagle_aux_hidden_state_layer_ids", []))
        model = self._vllm_config.model_config
        return {
            "layer_ids": json.dumps(ids),
            "hidden_size": str(model.get_hidden_size()),
            "model": str(model.model),
        }

    @staticmethod
    def _write_file(tensors, metadata, filename, lock_fd) -> None:
        try:
            tmp = f"{filename}.part"
            save_file(tensors, tmp, metadata=metadata)
            os.replace(tmp, filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX: a reader waiting on LOCK_SH goes on

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
        future = self._executor.submit(
            self._write_file, tensors, self._layer_metadata(), pending.filename, lock_fd
        )
        self._req_copy_events[pending.req_id] = _Done()
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
