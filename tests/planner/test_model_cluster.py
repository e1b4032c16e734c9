"""Model and cluster descriptions: presets, shorthand, HF configs, YAML; bad input named."""

import os

import pytest
import transformers

from tessera.models.config import preset
from tessera.planner import (ClusterError, HardwareError, ModelSpecError, describe_model,
                             load_cluster, parse_cluster, save_cluster)
from tessera.planner.hardware import device_presets


def test_shorthand_matches_gpt3_preset_shape():
    config = describe_model("layers=96,hidden=12288,heads=96,seq=2048,vocab=51200")
    assert (config.n_layers, config.d_model, config.n_heads) == (96, 12288, 96)
    assert config.max_seq_len == 2048 and config.vocab_size == 51200
    assert config.d_ff == 4 * 12288 and config.activation == "gelu"


def test_shorthand_llama_style_with_ffn_and_kv_heads():
    config = describe_model("layers=80,hidden=8192,heads=64,kv_heads=8,ffn=28672,vocab=32000,"
                            "seq=4096,style=llama")
    assert config.num_params() == preset("llama-70b").num_params()


@pytest.mark.parametrize("text, word", [
    ("layers=2,hidden=64,heads=4,depth=3", "depth"),
    ("layers=2,hidden=sixty,heads=4", "hidden"),
    ("layers=2,hidden=64", "heads"),
    ("layers=2,hidden=64,heads=4,style=bert", "style"),
    ("layers=2,layers=3,hidden=64,heads=4", "layers"),
    ("layers=2,hidden=64,heads=5", "n_heads"),
    ("nonsense-model", "nonsense-model"),
])
def test_bad_model_refused_naming_key(text, word):
    with pytest.raises(ModelSpecError, match=word):
        describe_model(text)


def test_hf_configs_give_the_same_parameter_count():
    gpt2 = transformers.GPT2Config(n_layer=3, n_embd=96, n_head=4, n_positions=128,
                                   vocab_size=300)
    config = describe_model(gpt2)
    model = transformers.GPT2LMHeadModel(gpt2)
    hf_params = sum(p.numel() for p in model.parameters())
    assert config.num_params() == hf_params
    llama = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                     num_key_value_heads=2, intermediate_size=176,
                                     vocab_size=300, max_position_embeddings=128)
    config = describe_model(llama.to_dict())
    hf_params = sum(p.numel() for p in transformers.LlamaForCausalLM(llama).parameters())
    assert config.num_params() == hf_params


def test_presets_have_required_devices_and_rates():
    presets = device_presets()
    for name in ("v100-32gb", "a100-40gb", "a100-80gb", "h100-80gb", "h200", "cpu"):
        assert name in presets
        assert presets[name].peak("fp32") > 0
    assert presets["h100-80gb"].peak("bf16") > presets["a100-80gb"].peak("bf16")
    assert presets["h200"].memory_bytes > presets["h100-80gb"].memory_bytes
    with pytest.raises(HardwareError, match="precision=bf16"):
        presets["v100-32gb"].peak("bf16")


def test_cluster_shorthand():
    cluster = parse_cluster("a100-80gb:8x128")
    assert cluster.num_devices == 1024 and cluster.devices_per_node == 8
    assert "NVLink" in cluster.device.intra.name and "InfiniBand" in cluster.device.inter.name
    assert parse_cluster("h100-80gb").num_devices == 8


def test_cpu_workers_share_the_host_memory():
    # The placeholder divided the host's memory by its cores whatever the worker count:
    # 8 workers on a 2-core host were each given half of it.
    one, eight = parse_cluster("cpu:1x1").device, parse_cluster("cpu:8x1").device
    assert one.memory_bytes == pytest.approx(8 * eight.memory_bytes)
    assert parse_cluster("cpu").device.memory_bytes == pytest.approx(
        one.memory_bytes / (os.cpu_count() or 1))
    # A YAML naming the preset likewise; one that gives memory_bytes keeps it.
    from tessera.planner.cluster import Cluster

    yaml_eight = Cluster.from_mapping({"device": "cpu", "devices_per_node": 8}).device
    assert yaml_eight.memory_bytes == pytest.approx(eight.memory_bytes)
    given = Cluster.from_mapping({"device": "cpu", "devices_per_node": 8,
                                  "device_overrides": {"memory_bytes": 1e9}}).device
    assert given.memory_bytes == 1e9


@pytest.mark.parametrize("text, word", [("tpu-v9:8x2", "tpu-v9"), ("a100-80gb:8y2", "malformed"),
                                        ("a100-80gb:0x2", ">= 1"), ("", "empty")])
def test_bad_cluster_refused(text, word):
    with pytest.raises(ClusterError, match=word):
        parse_cluster(text)


def test_cluster_yaml_round_trip_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("device: a100-80gb\ndevices_per_node: 4\nnodes: 2\n"
                    "device_overrides:\n  inter: {bandwidth: 1.0e9}\n")
    cluster = load_cluster(str(path))
    assert cluster.num_devices == 8 and cluster.device.inter.bandwidth == 1e9
    out = tmp_path / "out.yaml"
    save_cluster(cluster, str(out))
    again = load_cluster(str(out))
    assert again.device == cluster.device and again.num_devices == 8
    path.write_text("device: a100-80gb\nspeed: 3\n")
    with pytest.raises(ClusterError, match="speed"):
        load_cluster(str(path))
