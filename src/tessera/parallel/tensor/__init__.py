"""Tensor parallelism: 1D (Megatron column/row) and 2D (Optimus SUMMA on a q x q grid).

Files: ``comm`` (every collective), ``layers1d`` / ``summa`` / ``layers2d`` / ``loss`` (the
algorithms, as autograd functions), ``modules`` (layers that replace a model's), ``shard``
(DTensor parameters), ``policy`` (per-architecture patterns), ``apply`` (the step run by
``parallelize``), ``data_parallel`` (dp over shards), ``attention`` (1D attention dropout with
a mask per head). Design: docs/tensor_parallel.md.
"""

from tessera.parallel.tensor.apply import apply_tensor_parallel
from tessera.parallel.tensor.comm import CommCounter
from tessera.parallel.tensor.policy import POLICIES, PolicyError

__all__ = ["POLICIES", "CommCounter", "PolicyError", "apply_tensor_parallel"]
