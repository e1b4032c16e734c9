import re

import pytest

from tessera.config import ConfigError, load_config


def test_defaults_and_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model: {preset: tiny}\nstrategy: 'dp=2,mbs=2,gbs=8'\n"
                    "train: {max_steps: 7}\n")
    config = load_config(path, ["train.learning_rate=1e-4", "model.n_layers=3",
                                "strategy=dp=4,tp=1,pp=1,mbs=1,gbs=8"])
    assert config.train.max_steps == 7 and config.train.learning_rate == 1e-4
    assert config.model.build_config().n_layers == 3
    assert config.strategy.dp == 4
    # The resolved config round-trips through its plain form.
    again = load_config(None, [f"{k}={v}" for k, v in
                               [("strategy", config.strategy.to_text())]])
    assert again.strategy == config.strategy


@pytest.mark.parametrize("overrides, fragment", [
    (["train.lerning_rate=1"], "train.lerning_rate: unknown key"),
    (["optim.lr=1"], "optim: unknown key"),
    (["model.n_layrs=3"], "unknown key(s) model.n_layrs"),
    (["train.max_steps=many"], "train.max_steps: Input should be a valid integer"),
    (["train.max_steps=0"], "train.max_steps: must be >= 1"),
    (["data.val_fraction=0.9"], "data.val_fraction: must lie in [0, 0.5)"),
    (["strategy=dp=2,mbs=3,gbs=16"], "strategy: gbs=16 must be a multiple of mbs*dp"),
    (["strategy=dp=1,tp=3"], "n_heads=4 is not divisible by 3"),
    (["data.seq_len=100"], "data.seq_len=100 exceeds model.max_seq_len=64"),
    (["model.preset=gpt5"], "unknown model preset 'gpt5'"),
    (["model.hf=bert"], "model.hf: Input should be None, 'gpt2' or 'llama'"),
    (["train.max_steps"], "not key=value"),
])
def test_bad_config_is_refused_naming_the_key(overrides, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.preset=tiny", "data.seq_len=32", *overrides])
    assert fragment in str(err.value)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(bad)
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(bad)


def test_auto_strategy_is_planned_for_the_workers():
    base = ["model.preset=tiny", "data.seq_len=32"]
    config = load_config(None, [*base, "strategy=auto,gbs=16"], world_size=2)
    assert config.strategy.world_size == 2 and config.strategy.global_batch_size == 16
    config.strategy.require_available()
    with pytest.raises(ConfigError, match="needs the number of workers"):
        load_config(None, [*base, "strategy=auto,gbs=16"])
    with pytest.raises(ConfigError, match="auto needs the global batch size"):
        load_config(None, [*base, "strategy=auto"], world_size=2)
    with pytest.raises(ConfigError, match="unknown strategy field 'dq'"):
        load_config(None, [*base, "strategy=auto,gbs=16,dq=2"], world_size=2)


def test_auto_plans_for_the_cluster_file_it_is_given(tmp_path):
    import dataclasses

    from tessera.planner import parse_cluster, save_cluster, search
    from tessera.planner.hardware import Link
    from tessera.planner.model_spec import describe_model

    base = ["model.preset=small", "data.seq_len=64", "strategy=auto,gbs=8"]
    local = load_config(None, base, world_size=2).strategy
    # A measured host whose gloo link is 2000x slower than the preset's guess: data and
    # tensor parallelism's collectives then cost more than pipeline stages' small messages.
    cluster = parse_cluster("cpu:2x1")
    slow = dataclasses.replace(cluster.device, intra=Link("slow shared memory", 1e6, 1e-3))
    path = tmp_path / "cluster.yaml"
    save_cluster(dataclasses.replace(cluster, device=slow), str(path))
    config = load_config(None, [*base, f"train.planner_cluster={path}"], world_size=2)
    expected = search(describe_model("small", 64), str(path), 8, devices=2, available_only=True,
                      top_k=1).best.strategy
    assert config.strategy == expected and config.strategy != local
    assert config.train.planner_cluster is None  # consumed: the resolved config reruns as is
    with pytest.raises(ConfigError, match="nothing reads it"):
        load_config(None, ["strategy=dp=1,mbs=1,gbs=1", f"train.planner_cluster={path}"])
    with pytest.raises(ConfigError, match="devices=4 exceeds the cluster's 2"):
        load_config(None, [*base, f"train.planner_cluster={path}"], world_size=4)
    with pytest.raises(ConfigError, match="cannot read cluster file"):
        load_config(None, [*base, f"train.planner_cluster={tmp_path}/none.yaml"], world_size=2)
    gpus = tmp_path / "gpus.yaml"
    save_cluster(parse_cluster("a100-80gb:2"), str(gpus))
    with pytest.raises(ConfigError, match="describes a100-80gb devices but this job runs on "
                                          "CPU workers"):
        load_config(None, [*base, "train.device=cpu", f"train.planner_cluster={gpus}"],
                    world_size=2)


def test_auto_plans_at_the_training_length_and_takes_any_valid_fixed_field(monkeypatch):
    small = ["model.preset=small", "data.seq_len=64"]

    def planned(text, *extra, world=2):
        return load_config(None, [*small, *extra, f"strategy={text}"],
                           world_size=world).strategy

    # The training length, not the model's position count: a 64-token job plans alike
    # whatever max_seq_len the model allows (planned at 8192 it took sequence parallelism).
    assert planned("auto,gbs=8", "model.max_seq_len=8192") == \
        planned("auto,gbs=8", "model.max_seq_len=64")
    # Fixed fields the search would prune as dominated, or values outside its own menu,
    # are honoured when held fixed; per-stage ratios check against the planned pp.
    assert planned("auto,gbs=8,sp=2,sp_mode=rsa").sp_mode == "rsa"
    assert planned("auto,gbs=8,pp=2,schedule=gpipe").schedule == "gpipe"
    assert planned("auto,gbs=8,pp=2,recompute=0.25").recompute == (0.25,)
    assert planned("auto,gbs=8,pp=2,recompute=1/0").recompute == (1.0, 0.0)
    assert planned("auto,gbs=8,schedule=interleaved").pp == 2
    assert planned("auto,gbs=8,precision=fp16").precision == "fp16"  # CPU autocast runs it
    assert planned("auto,gbs=8,tp=2,tp_seq=on").tp_seq == "on"
    # Megatron sequence parallelism takes the Hugging Face models a config builds, with
    # their dropout too (GPT-2's modules are placed by its policy; Llama drops only
    # attention probabilities): nothing is held off for them, nothing refused.
    import tessera.train.auto as auto

    drops = ("model.hf=gpt2", "model.dropout=0.1")
    asked, plan = [], auto.best_runnable
    monkeypatch.setattr(auto, "best_runnable", lambda *a: asked.append(a[4]) or plan(*a))
    planned("auto,gbs=8,tp=2", *drops)
    monkeypatch.undo()
    assert asked == [{"tp": 2}]
    for hf in ("model.hf=gpt2", "model.hf=llama"):
        assert planned("dp=1,tp=2,mbs=8,gbs=8,tp_seq=on", hf, "model.dropout=0.1",
                       "model.attention_dropout=0.1").tp_seq == "on"
    for text, fragment in [
            ("auto,gbs=8,sp=2,sp=1", "strategy field 'sp' given twice"),
            ("auto,gbs=eight", "gbs (global_batch_size) must be an integer, got 'eight'"),
            ("auto,gbs=8,sp=3", "the fixed sp=3 does not divide the 2 devices"),
            ("auto,gbs=8,dp=2,pp=2", "the fixed dp=2*pp=2 = 4 does not divide the 2 devices"),
            ("auto,gbs=8,mbs=3", "mbs=3 does not divide gbs=8"),
            ("auto,gbs=8,recompute=0.5/0.5,pp=1", "2 per-stage ratios: pp must be 2, not 1"),
            ("auto,gbs=8,memory=zero1", "this build does not run, e.g.: ZeRO memory"),
            ("auto,gbs=8,tp_overlap=subpipe", "cannot fix strategy field 'tp_overlap'")]:
        with pytest.raises(ConfigError, match=re.escape(fragment)):
            planned(text)


@pytest.mark.parametrize("override, fragment", [
    ("=,", "the key '' is empty"),
    ("train..max_steps=3", "has an empty part"),
    ("train.output_dir=[unclosed", "is not a valid YAML scalar"),
])
def test_malformed_overrides_are_refused(override, fragment):
    # Found by tests/test_fuzz_inputs.py: these escaped as raw YAML errors.
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        load_config(None, [override])
