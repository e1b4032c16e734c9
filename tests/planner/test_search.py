"""Search: pruning keeps the exhaustive optimum, constraints hold, infeasible explained."""

import pytest

from tessera.models.config import ModelConfig
from tessera.planner import PlannerError, search
from tessera.strategy import StrategyError

SMALL = ModelConfig(vocab_size=1024, n_layers=8, d_model=512, n_heads=8, max_seq_len=512)


@pytest.mark.parametrize("cluster, gbs", [("a100-40gb:4x2", 32), ("v100-32gb:2x4", 16),
                                          ("cpu:4x1", 8)])
def test_pruning_keeps_the_exhaustive_optimum(cluster, gbs):
    pruned = search(SMALL, cluster, gbs, top_k=3, max_mbs=8)
    full = search(SMALL, cluster, gbs, top_k=3, max_mbs=8, exhaustive=True)
    assert pruned.best.step_time == pytest.approx(full.best.step_time, rel=1e-12)
    assert pruned.candidates_evaluated < full.candidates_evaluated
    assert full.candidates_total >= full.candidates_evaluated


def test_results_ranked_fit_and_respect_topology():
    result = search("gpt3-175b", "a100-80gb:8x16", 512, top_k=5)
    times = [e.step_time for e in result.results]
    assert times == sorted(times) and len(times) == 5
    for est in result.results:
        assert est.fits and est.strategy.world_size == 128 and est.strategy.tp <= 8


def test_plan_175b_on_1024_is_fast():
    result = search("gpt3-175b", "a100-80gb:8x128", 1536)
    assert result.elapsed_s < 5 and result.best is not None


def test_megatron_sequence_parallelism_is_searched_where_it_applies():
    result = search(SMALL, "cpu:4x1", 8, top_k=500, exhaustive=True,
                    fixed={"tp": 4, "memory": "ddp"})
    seen = {(e.strategy.tp_mode, e.strategy.tp_seq) for e in result.results}
    assert seen == {("1d", "off"), ("1d", "on"), ("2d", "off")}
    held = search(SMALL, "cpu:4x1", 8, top_k=50, fixed={"tp": 4, "tp_seq": "on"})
    assert held.results and all(e.strategy.tp_seq == "on" for e in held.results)


def test_available_only_respects_what_the_runtime_runs():
    result = search("gpt2", "cpu:4x1", 8, available_only=True, top_k=20)
    assert result.results
    for est in result.results:
        est.strategy.require_available()  # raises NotAvailableError otherwise


def test_fixed_fields_are_held():
    result = search(SMALL, "a100-40gb:4x2", 32, fixed={"tp": 2, "recompute": "full"})
    assert all(e.strategy.tp == 2 and e.strategy.recompute == (1.0,) for e in result.results)
    with pytest.raises(PlannerError, match="colour"):
        search(SMALL, "a100-40gb:4x2", 32, fixed={"colour": 1})


def test_model_that_fits_nowhere_is_explained():
    result = search("gpt3-175b", "a100-40gb:8x1", 8)
    assert not result.results and result.infeasible is not None
    assert result.infeasible.shortfall_bytes > 0
    text = result.infeasible.message()
    assert "short by" in text and "devices" in text
    # Searching what this build runs, the advice names only such layouts (it named zero3).
    runnable = search("gpt3-175b", "a100-40gb:8x1", 8, available_only=True).infeasible
    tips = [t for t in runnable.suggestions if "devices, e.g." in t]
    assert tips and all("memory=zero" not in t for t in tips), runnable.suggestions


def test_no_offload_advice_where_the_host_is_the_device():
    # Offload to cpu is advised on accelerators when held fixed; on CPU workers it frees nothing.
    fixed = {"offload": (), "memory": "chunk"}
    gpu = search("gpt3-175b", "a100-40gb:8x1", 8, fixed=fixed, explain=False)
    cpu = search("gpt3-175b", "cpu:2x1", 8, fixed=fixed, explain=False)
    assert "allow offload to cpu" in gpu.infeasible.message()
    assert cpu.infeasible is not None and "offload" not in cpu.infeasible.message()


@pytest.mark.parametrize("kwargs, word", [(dict(global_batch_size=0), "global_batch_size"),
                                          (dict(global_batch_size=8, devices=99), "devices"),
                                          (dict(global_batch_size=8, top_k=0), "top_k")])
def test_bad_arguments_named(kwargs, word):
    with pytest.raises(PlannerError, match=word):
        search(SMALL, "a100-40gb:4x2", **kwargs)


def test_bad_fixed_value_named():
    with pytest.raises(StrategyError, match="recompute"):
        search(SMALL, "a100-40gb:4x2", 32, fixed={"recompute": "lots"})
