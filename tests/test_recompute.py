"""Activation recomputation finds the blocks of models outside the known layouts.

`find_blocks` knows `.blocks`, `.transformer.h` and `.model.layers`; other Hugging Face
classes keep their layers elsewhere (GPT-NeoX at `.gpt_neox.layers`), where before
2026-11-29 `recompute > 0` was refused. Recomputing a block in fp32 runs the same operations
again, so the gradients equal those of the model that keeps its activations exactly.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

from tessera.parallel.plan import default_forward_loss
from tessera.parallel.recompute import apply_recompute, find_blocks


def _neox() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(
        "gpt_neox", hidden_size=32, num_attention_heads=4, num_hidden_layers=3,
        intermediate_size=64, vocab_size=64, max_position_embeddings=16, use_cache=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return transformers.AutoModelForCausalLM.from_config(config)


def _grads(model: nn.Module, batch) -> tuple[dict[str, torch.Tensor], int]:
    """Gradients of one step, and how many times the attention modules began a forward
    (a recomputation may stop once it has what backward needs: counted at the start)."""
    runs = []
    for block in model.gpt_neox.layers:
        block.attention.register_forward_pre_hook(lambda *args: runs.append(1))
    default_forward_loss(model, batch).backward()
    return {name: p.grad for name, p in model.named_parameters()}, len(runs)


def test_gpt_neox_blocks_are_found_and_recomputed_exactly():
    ids = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    kept, recomputed = _neox(), _neox()
    assert find_blocks(recomputed) is recomputed.gpt_neox.layers
    assert apply_recompute(recomputed, 1.0) == 3
    assert all(block._tessera_recompute for block in recomputed.gpt_neox.layers)
    (want, once), (got, twice) = _grads(kept, batch), _grads(recomputed, batch)
    assert (once, twice) == (3, 6)  # each block ran again in backward
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name


def test_a_model_without_a_block_list_is_refused_by_name():
    with pytest.raises(ValueError, match="cannot find the transformer blocks of Sequential"):
        find_blocks(nn.Sequential(nn.Linear(2, 2)))
