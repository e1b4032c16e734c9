"""Measure activation memory on any device: the peak of what autograd saves for backward.

CPU tensors have no allocator statistics to read (``torch.cuda.max_memory_allocated`` has no
CPU twin), so the benchmarks and tests that compare schedules' activation memory count the
tensors autograd saves instead: distinct storages, parameters excluded, live from the moment
they are saved until the graph holding them is freed. Tensors a pipeline stage keeps outside
autograd (a recomputing stage's input) are not counted.

    probe = SavedPeak(model.parameters())
    with probe:
        engine.forward_backward(batches)
    probe.peak  # bytes
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class _Held:
    """One saved tensor; its release (when autograd frees the graph) lowers the live count."""

    __slots__ = ("tensor", "probe", "key")

    def __init__(self, tensor: torch.Tensor, probe: SavedPeak, key: int) -> None:
        self.tensor, self.probe, self.key = tensor, probe, key

    def __del__(self) -> None:
        self.probe._release(self.key)


class SavedPeak:
    """Context manager tracking the peak bytes of distinct storages saved for backward."""

    def __init__(self, params: Iterable[torch.Tensor] = ()) -> None:
        self._params = {_storage_key(p) for p in params}
        self._refs: dict[int, int] = {}
        self._sizes: dict[int, int] = {}
        self.live = 0
        self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self) -> SavedPeak:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, tensor: torch.Tensor):
        key = _storage_key(tensor)
        if key in self._params or key == 0:
            return tensor
        if key not in self._refs:
            self._refs[key] = 0
            self._sizes[key] = tensor.untyped_storage().nbytes()
            self.live += self._sizes[key]
            self.peak = max(self.peak, self.live)
        self._refs[key] += 1
        return _Held(tensor, self, key)

    @staticmethod
    def _unpack(packed):
        return packed.tensor if isinstance(packed, _Held) else packed

    def _release(self, key: int) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            del self._refs[key]
            self.live -= self._sizes.pop(key)


def _storage_key(tensor: torch.Tensor) -> int:
    local = getattr(tensor, "_local_tensor", tensor)  # a DTensor's shard
    return local.untyped_storage().data_ptr()
