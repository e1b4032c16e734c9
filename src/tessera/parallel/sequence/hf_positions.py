"""How many tokens a row may have under sequence parallelism for a Hugging Face model whose
numbers depend on positions it sees in one call: each sp rank's call sees only its own shard.

Each limit is ``(tokens, why, always)`` for ``SequenceParallel.max_len``: ``always`` says
whether it bounds rows that bring their own position ids too (False: the batch's largest
position id is checked instead, as those models read the ids).
"""

from __future__ import annotations

from torch import nn

from tessera.parallel.sequence.layout import SequenceParallelError


def position_limit(model: nn.Module) -> tuple[int, str, bool] | None:
    """The tightest of the model's limits (a learned position table, rotary frequencies
    that follow the call's positions, Llama 4's temperature tuning), or None."""
    limits = [limit for limit in (_learned_positions(model), _rope_limit(model),
                                  _temperature_limit(model)) if limit is not None]
    return min(limits, key=lambda limit: limit[0]) if limits else None


def _learned_positions(model: nn.Module) -> tuple[int, str, bool] | None:
    """The rows of a learned absolute position table (GPT-2's ``wpe``, OPT's
    ``embed_positions`` less its offset of 2) as ``SequenceParallel.max_len``, else None:
    rotary positions have no table."""
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, nn.Embedding) and leaf in ("wpe", "embed_positions",
                                                         "position_embeddings"):
            if module.padding_idx is not None:  # RoBERTa-style: counted from padding_idx + 1
                raise SequenceParallelError(
                    f"{type(model).__name__} numbers positions from its input ids, after "
                    f"padding_idx={module.padding_idx} of {name}, in its own forward: "
                    "sequence parallelism passes each rank's positions counted from 0, "
                    "which this model would embed as other positions. Train this model "
                    "with sp=1")
            return (module.num_embeddings - getattr(module, "offset", 0),
                    f"position table {name}", False)
    return None


def _rope_limit(model: nn.Module) -> tuple[int, str, bool] | None:
    """Rotary embeddings whose frequencies follow each call's largest position id
    (transformers' "dynamic" NTK scaling, Phi-3's "longrope"): past the original length
    they change, from the positions a call sees, and each sp rank sees its own. Rows up to
    that length get the original frequencies on every rank, as on one device."""
    for name, module in model.named_modules():
        kind = getattr(module, "rope_type", None)
        kinds = set(kind.values()) if isinstance(kind, dict) else {kind}
        dynamic = sorted(k for k in kinds if isinstance(k, str)
                         and ("dynamic" in k or k == "longrope"))
        if not dynamic:
            continue
        if isinstance(kind, dict):
            raise SequenceParallelError(
                f"{name} uses rope types {dynamic} per layer type, whose frequencies follow "
                "each call's largest position id, which sp ranks do not share: train this "
                "model with sp=1")
        original = (module.config.rope_parameters["original_max_position_embeddings"]
                    if kind == "longrope" else module.original_max_seq_len)
        return (int(original), f"{name}'s rope_type {kind!r} changes its frequencies past "
                f"{original} positions, from the largest position id each sp rank sees",
                False)
    return None


def _temperature_limit(model: nn.Module) -> tuple[int, str, bool] | None:
    """Llama 4's attention temperature tuning on its layers without RoPE scales queries by
    their index in the call (not their position id): from ``floor_scale`` - 1 on, a rank's
    local index gives another scale than the token's place in the row."""
    for name, module in model.named_modules():
        if getattr(module, "attn_temperature_tuning", False) and \
                not getattr(module, "use_rope", True):
            floor = int(module.floor_scale)
            return (floor - 1, f"{name}'s attention temperature tuning scales queries by "
                    f"their index within each sp rank's shard from index {floor - 1} on", True)
    return None
