import pytest
import torch

from tessera.models import PRESETS, ModelConfig, ModelConfigError, Transformer, preset


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_build_on_meta_with_exact_parameter_count(name):
    config = preset(name)
    with torch.device("meta"):
        model = Transformer(config)
    assert sum(p.numel() for p in model.parameters()) == config.num_params()


def test_published_sizes():
    # GPT-2 small 124M and Llama-2 7B / 70B as published (embeddings included).
    assert round(preset("gpt2").num_params() / 1e6, 1) == 124.4
    assert round(preset("llama-7b").num_params() / 1e9, 2) == 6.74
    assert round(preset("llama-70b").num_params() / 1e9, 1) == 69.0


@pytest.mark.parametrize("name", ["tiny", "tiny-llama"])
def test_forward_is_causal(name):
    torch.manual_seed(0)
    model = Transformer(preset(name)).eval()
    ids = torch.randint(0, 256, (2, 16))
    changed = ids.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 256
    out, out_changed = model(ids), model(changed)
    assert out.shape == (2, 16, 256)
    # Changing tokens from position 10 on must not change logits before it.
    torch.testing.assert_close(out[:, :10], out_changed[:, :10])
    assert not torch.allclose(out[:, 10:], out_changed[:, 10:])


def test_styles_are_what_they_say():
    llama = Transformer(preset("tiny-llama"))
    gpt = Transformer(preset("tiny"))
    assert llama.pos_embed is None and gpt.pos_embed is not None
    assert llama.lm_head.weight is not llama.embed.weight
    assert gpt.lm_head.weight is gpt.embed.weight  # tied
    assert llama.blocks[0].attn.k_proj.out_features == 2 * 16  # 2 kv heads of size 16
    assert hasattr(llama.blocks[0].mlp, "gate_proj") and not hasattr(gpt.blocks[0].mlp,
                                                                    "gate_proj")


def test_gqa_matches_repeated_kv_heads():
    # Grouped-query attention equals full attention with each kv head repeated.
    torch.manual_seed(0)
    config = preset("tiny-llama")
    gqa = Transformer(config).eval()
    full = Transformer(config.replace(n_kv_heads=config.n_heads)).eval()
    state = gqa.state_dict()
    group = config.n_heads // config.n_kv_heads
    for key in list(state):
        if key.endswith(("k_proj.weight", "v_proj.weight")):
            w = state[key].view(config.n_kv_heads, config.head_dim, -1)
            state[key] = w.repeat_interleave(group, dim=0).reshape(config.d_model, -1)
    full.load_state_dict(state)
    ids = torch.randint(0, 256, (2, 12))
    torch.testing.assert_close(gqa(ids), full(ids), rtol=1e-5, atol=1e-5)


def test_too_long_sequence_is_refused():
    model = Transformer(preset("tiny"))
    with pytest.raises(ValueError, match="exceeds max_seq_len=64"):
        model(torch.zeros(1, 65, dtype=torch.long))


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(d_model=65), "d_model=65 must be divisible by n_heads=4"),
    (dict(n_kv_heads=3), "n_heads=4 must be divisible by n_kv_heads=3"),
    (dict(norm="batchnorm"), "model.norm must be one of"),
    (dict(n_layers=0), "model.n_layers must be a positive integer"),
])
def test_bad_model_config(kwargs, fragment):
    with pytest.raises(ModelConfigError, match=fragment):
        preset("tiny", **kwargs)


def test_unknown_preset_lists_known():
    with pytest.raises(ModelConfigError, match="unknown model preset 'gpt5'.*tiny"):
        preset("gpt5")


def test_overrides_rederive_defaults():
    assert preset("tiny", d_model=128).d_ff == 512
    assert ModelConfig.from_mapping({"n_heads": 8, "d_model": 64}).n_kv_heads == 8
    with pytest.raises(ModelConfigError, match="unknown model field"):
        ModelConfig.from_mapping({"layers": 2})


def test_swiglu_keeps_two_tensors_and_matches_autograd():
    # SiluMul saves gate and up only (silu is recomputed in backward); its gradients equal
    # autograd's through F.silu(gate) * up to float64 rounding, one per input.
    from tessera.models.transformer import SiluMul

    gate, up = (torch.randn(2, 5, 7, dtype=torch.float64, requires_grad=True) for _ in "gu")
    out = SiluMul.apply(gate, up)
    assert len(out.grad_fn.saved_tensors) == 2
    assert torch.autograd.gradcheck(SiluMul.apply, (gate, up))
    weight = torch.randn_like(out)
    ours = torch.autograd.grad((out * weight).sum(), (gate, up))
    plain = torch.nn.functional.silu(gate) * up
    theirs = torch.autograd.grad((plain * weight).sum(), (gate, up))
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
