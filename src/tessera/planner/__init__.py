"""Automatic strategy planning: describe a model and a cluster, simulate, search.

The approach is that of arXiv 2501.00254: a step's time is computation plus communication
minus their overlap; a simulator built on that split prices any :class:`tessera.Strategy`, and
a search pruned with it returns the fastest strategies that fit in memory::

    from tessera.planner import search
    result = search("gpt3-175b", "a100-80gb:8x128", global_batch_size=1536)
    print(result.best.strategy, result.best.step_time)
"""

from tessera.planner.cluster import Cluster, ClusterError, load_cluster, parse_cluster, save_cluster
from tessera.planner.hardware import DeviceSpec, HardwareError, Link, device_presets, get_device
from tessera.planner.model_spec import ModelSpecError, describe_model, parse_model_shorthand
from tessera.planner.search import Infeasible, PlannerError, SearchResult, search
from tessera.planner.simulator import Estimate, SimOptions, estimate

__all__ = ["Cluster", "ClusterError", "DeviceSpec", "Estimate", "HardwareError", "Infeasible",
           "Link", "ModelSpecError", "PlannerError", "SearchResult", "SimOptions",
           "describe_model", "device_presets", "estimate", "get_device", "load_cluster",
           "parse_cluster", "parse_model_shorthand", "save_cluster", "search"]
