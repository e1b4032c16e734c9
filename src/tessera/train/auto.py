"""``strategy: auto``: ask the planner for the fastest layout this build can run here."""

from __future__ import annotations

import torch
from torch import nn

from tessera.strategy import Strategy, StrategyError, field_text

# Device-name fragments (as torch reports them) to planner presets.
_GPU_PRESETS = (("H200", "h200"), ("H100", "h100-80gb"), ("A100-SXM4-80GB", "a100-80gb"),
                ("A100 80GB", "a100-80gb"), ("A100", "a100-40gb"), ("V100", "v100-32gb"))


def local_cluster(world_size: int, device: str = "auto") -> str:
    """Planner shorthand for the devices this job runs on (one node): ``device`` as the
    training settings give it ("auto" plans for the GPU when CUDA is available, "cpu" for the
    host even then, as the job will run there)."""
    if device != "cpu" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        for fragment, preset in _GPU_PRESETS:
            if fragment in name:
                return f"{preset}:{world_size}x1"
        raise StrategyError(f"strategy=auto: no planner preset for GPU {name!r}; give a "
                            "Strategy explicitly or describe the device in a cluster YAML")
    return f"cpu:{world_size}x1"


def planning_cluster(world_size: int, device: str = "auto", cluster_file: str | None = None):
    """What ``auto`` plans for: the cluster file (``tessera profile``'s YAML, measured on
    this machine) when given, else the preset of the local devices (``local_cluster``).

    Raises:
        StrategyError: naming the file when it cannot be read, or when it describes CPU
            workers for a job on CUDA devices or the other way round.
    """
    if cluster_file is None:
        return local_cluster(world_size, device)
    from tessera.planner.cluster import ClusterError, load_cluster

    try:
        cluster = load_cluster(cluster_file)
    except ClusterError as err:
        raise StrategyError(f"planner_cluster: {err}") from None
    on_gpu = device != "cpu" and torch.cuda.is_available()
    if cluster.device.is_host == on_gpu:
        runs_on = "CUDA devices" if on_gpu else "CPU workers"
        raise StrategyError(f"planner_cluster {cluster_file} describes {cluster.device.name} "
                            f"devices but this job runs on {runs_on}: profile them with "
                            f"`tessera profile --device {'cuda' if on_gpu else 'cpu'}`")
    return cluster


def plan_strategy(model: nn.Module, world_size: int, global_batch_size: int,
                  precision: str, seq_len: int | None = None, device: str = "auto",
                  cluster_file: str | None = None) -> Strategy:
    """The planner's top strategy among those the runtime supports (AVAILABLE).

    The model is described by its config when the planner reads it (reference, GPT-2,
    Llama, Mistral), else by its captured graph, at ``seq_len`` tokens (default: the
    config's position count), for the devices ``device`` names (see ``local_cluster``), or
    as ``cluster_file`` describes them (``planning_cluster``).

    Raises:
        StrategyError: when the model cannot be described or nothing fits, saying why.
    """
    from tessera.planner.model_spec import ModelSpecError, describe_module_or_config

    try:
        config = describe_module_or_config(model, seq_len)
    except ModelSpecError as err:
        raise StrategyError(f"strategy=auto cannot describe the model to the planner: {err}; "
                            "give a Strategy explicitly") from None
    return best_runnable(config, world_size, global_batch_size, precision,
                         layout_limits(model, world_size), device, cluster_file)


# Pipeline arguments the planner does not read: with "auto" they are refused, not ignored.
PIPELINE_ONLY_KEYS = ("pipeline_split_points", "pipeline_leaf_modules", "stage_memory_budget")

# Model classes "auto" plans sequence parallelism for: those the suite checks it on.
SP_PLANNED = frozenset({"Transformer", "GPT2LMHeadModel", "LlamaForCausalLM"})


def layout_limits(model: nn.Module, world_size: int | None = None) -> dict[str, int | str]:
    """Strategy fields held at 1 (or off) for a model the runtime cannot split that way:
    tensor parallelism needs a policy for the model's class that styles every module holding
    weights (a user's class named like a known one may not fit it); sequence parallelism is
    planned only for the models the suite tests it on (the reference, GPT-2, Llama: its
    Hugging Face route, AttentionInterface, is generic, but models refuse it for their own
    attention variants); Megatron sequence parallelism (tp_seq) takes a Hugging Face model
    whose dropout modules the policy places (apply.unplaced_dropouts). Pipeline and data
    parallelism need only a capture.

    With ``world_size``, tensor parallelism is also held at 1 where some tp degree it could
    take (a divisor of the world) would not cut heads, hidden size, vocabulary and MLP width
    evenly (GPT-2's 50257 tokens): the planner checks heads only, and the runtime refuses
    the rest. Held for every degree, as the planner takes no set of allowed values."""
    from tessera.parallel.tensor.apply import unplaced_dropouts
    from tessera.parallel.tensor.policy import PolicyError, policy_for, style_of

    try:
        policy = policy_for(model)
    except PolicyError:
        return {"tp": 1, "sp": 1}
    holders = [path for path, module in model.named_modules()
               if next(module.parameters(recurse=False), None) is not None]
    covered = all(style_of(path, policy) is not None for path in holders)
    if not covered:
        return {"tp": 1, "sp": 1}
    # Other classes with a policy (Mistral, Gemma, Cohere, ...): tensor parallelism checked,
    # sequence parallelism not planned for (Mistral's and Gemma 2's sliding windows, for
    # two, are refused under sp past them).
    limits: dict[str, int | str] = {} if type(model).__name__ in SP_PLANNED else {"sp": 1}
    if world_size is not None and not _tp_cuts_evenly(model, world_size):
        limits["tp"] = 1
    elif type(model).__name__ != "Transformer" and unplaced_dropouts(model, policy):
        limits["tp_seq"] = "off"  # Megatron SP: a dropout whose tensor is not known
    return limits


def _tp_cuts_evenly(model: nn.Module, world_size: int) -> bool:
    """Whether every tp degree above 1 that divides ``world_size`` cuts the model evenly
    in 1D (heads, hidden size, vocabulary, MLP width; kv heads replicated). A 2D grid cuts
    them by its q, which divides its tp; its kv-head rule the planner checks itself."""
    from tessera.parallel.tensor.policy import PolicyError, check_divisible, model_dims

    dims = model_dims(model)
    for tp in range(2, world_size + 1):
        if world_size % tp:
            continue
        try:
            check_divisible(dims, tp, kv_ways_ok=True, what=f"tp={tp}")
        except PolicyError:
            return False
    return True


def best_runnable(model_config, world_size: int, global_batch_size: int, precision: str,
                  fixed: dict | None = None, device: str = "auto",
                  cluster_file: str | None = None) -> Strategy:
    """The fastest strategy that fits and that this build's runtime runs.

    Raises:
        StrategyError: when nothing fits, with the planner's explanation.
    """
    from tessera.planner import search
    from tessera.planner.search import PlannerError

    cluster = planning_cluster(world_size, device, cluster_file)
    try:
        result = search(model_config, cluster, global_batch_size,
                        devices=world_size, available_only=True, precision=precision,
                        fixed=fixed or None, top_k=1)
    except PlannerError as err:  # e.g. a field the planner does not choose (tp_overlap)
        raise StrategyError(f"strategy=auto: {err}") from None
    if not result.results:
        held = ",".join(field_text(key, value) for key, value in (fixed or {}).items())
        raise StrategyError(f"strategy=auto: nothing runs on {world_size} device(s) with "
                            f"gbs={global_batch_size}{', ' + held if held else ''}: "
                            f"{result.infeasible.message()}")
    return result.best.strategy


def resolve_auto_text(text: str, model_config, world_size: int, device: str = "auto",
                      seq_len: int | None = None, cluster_file: str | None = None
                      ) -> Strategy:
    """Resolve ``auto[,field=value...]`` (e.g. ``auto,gbs=64,precision=bf16``) for a job
    whose samples hold ``seq_len`` tokens (default: the model's position count).

    The fields after ``auto`` are held fixed, each checked on its own as strategy text
    checks it (``strategy.fixed_fields``); ``gbs`` is required, since the batch size is a
    training decision and not the planner's.
    """
    from tessera.planner.model_spec import describe_model
    from tessera.strategy import fixed_fields

    rest = text.split(",", 1)[1] if "," in text else ""
    try:
        fixed = fixed_fields(rest) if rest.strip() else {}
    except StrategyError as err:
        raise StrategyError(f"strategy {text!r}: {err}") from None
    if "global_batch_size" not in fixed:
        raise StrategyError(f"strategy {text!r}: auto needs the global batch size, e.g. "
                            "'auto,gbs=64'")
    gbs = fixed.pop("global_batch_size")
    precision = str(fixed.pop("precision", "fp32"))
    model = describe_model(model_config, seq_len) if seq_len else model_config
    return best_runnable(model, world_size, gbs, precision, fixed, device, cluster_file)
