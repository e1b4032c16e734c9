"""Chunk-based heterogeneous memory (PatrickStar): chunks, states, tiers, tracer, placement.

Selected with ``memory=chunk`` in the Strategy and the ``memory:`` config section; see
docs/memory.md.
"""

from tessera.memory.manager import ChunkManager, MemoryOptions
from tessera.memory.runtime import ChunkRuntime, apply_chunk_memory, as_options
from tessera.memory.tensor_state import (LEGAL_TRANSITIONS, IllegalTransitionError,
                                         TensorState)
from tessera.memory.tiers import DiskTierError, MemoryBudgetError

__all__ = ["ChunkManager", "ChunkRuntime", "DiskTierError", "IllegalTransitionError",
           "LEGAL_TRANSITIONS", "MemoryBudgetError", "MemoryOptions", "TensorState",
           "apply_chunk_memory", "as_options"]
