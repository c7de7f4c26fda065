"""A CPU-safe hidden-states connector for vLLM's ``extract_hidden_states`` method (runs inside vLLM's own
environment; it imports vLLM, never draftlab).

vLLM 0.32's ``ExampleHiddenStatesConnector`` copies each finished request's hidden states out of the cache
through a CUDA stream into pinned host memory, which its CPU build cannot allocate ("pin_memory=True requires a
CUDA or other accelerator backend"). On the CPU the cache already is host memory, so this subclass reads the
request's slots directly and writes the file before reporting the request done; everything else (scheduling,
the per-request file name and lock handed to the client) is the parent's.
"""

from __future__ import annotations

import os
import tempfile

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _Done:
    """Stands in for the parent's CUDA copy event: the copy is finished when the write returns."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets[None, :] + blocks[:, None] * self._block_size).flatten()
        n = pending.token_ids.shape[0]
        hidden = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device), n).to("cpu").clone()
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        try:  # written beside its name and renamed: a reader never sees half a file
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(pending.filename), suffix=".tmp")
            os.close(fd)
            save_file({"hidden_states": hidden.contiguous(), "token_ids": pending.token_ids.clone()}, tmp)
            os.replace(tmp, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases the client's wait
        self._req_copy_events[pending.req_id] = _Done()
