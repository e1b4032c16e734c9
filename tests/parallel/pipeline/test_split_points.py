"""train.pipeline_split_points: stages start at the named modules, and train as one device."""

import pytest

from tessera.config import ConfigError, load_config
from tessera.parallel.pipeline.split_points import module_path
from tessera.testing import run_distributed, train_tiny, tiny_trainer

SPLIT = {"pipeline_split_points": ["blocks.1.mlp_norm"]}


def _run(rank, world, root):
    if world == 1:
        try:
            tiny_trainer(f"{root}/refused", "dp=1,mbs=2,gbs=8", 1, train=SPLIT)
            refusal = None
        except ConfigError as err:  # refused with the config, before any work
            refusal = str(err)
        return {"losses": train_tiny(f"{root}/one", "dp=1,mbs=2,gbs=8")[0].losses,
                "refusal": refusal}
    auto = tiny_trainer(f"{root}/auto", "pp=2,mbs=2,gbs=8", 1).plan.pipeline
    pipe = tiny_trainer(f"{root}/probe", "pp=2,mbs=2,gbs=8", 1, train=SPLIT).plan.pipeline
    return {"losses": train_tiny(f"{root}/pp", "pp=2,mbs=2,gbs=8", train=SPLIT)[0].losses,
            "split_at": module_path(pipe.program.graph, pipe.partition.bounds[1]),
            "auto_at": module_path(auto.program.graph, auto.partition.bounds[1])}


@pytest.mark.slow
def test_pp2_split_at_a_named_module_equals_one_device(tmp_path):
    one = run_distributed(_run, 1, args=(str(tmp_path),))[0]
    pp = run_distributed(_run, 2, args=(str(tmp_path),))[0]
    assert "pipeline_split_points places pipeline stage boundaries and needs pp > 1" in \
        one["refusal"]  # not ignored at pp=1
    assert pp["split_at"] == "blocks.1.mlp_norm" != pp["auto_at"]  # not the search's cut
    # fp32, the same arithmetic per micro-batch in another order: 1e-5 on losses near 5
    assert max(abs(a - b) for a, b in zip(one["losses"], pp["losses"])) < 1e-5, (one, pp)


def test_split_points_with_a_planned_strategy_are_refused():
    with pytest.raises(ConfigError, match="give strategy text with pp > 1, not auto"):
        load_config(None, ["strategy=auto,gbs=8", "train.pipeline_split_points=[blocks.1]"],
                    world_size=2)
