"""Training with dropout under 1D tensor parallelism through the Trainer, in one 4-rank launch.

GPT-2-like dropout (0.1 on embeddings, residuals and attention probabilities) on the reference
model: dp=2 x tp=2 eagerly and tp=2 x pp=2 as captured pipeline stages, each with and without
full recomputation, and dp=2 x tp=2 without dropout to compare with; Hugging Face GPT-2 at
tp=2 x pp=2 with and without recomputation, also with Megatron sequence parallelism.
Attention dropout runs the hashed masks per head (tensor/attention.py); the other dropout
draws from the stream tp peers share (parallel/rank_rng.py). Each run is 5 steps of a tiny
model on 32-token samples.

No single-device twin exists (dp ranks and pipeline stages draw their own masks), so the
checks are: it trains (finite losses that fall), dropout took effect (the losses differ from
the undropped run's), recomputation draws the forward's masks again (equal losses), and
evaluation runs without dropout. The parity of the attention itself with one device is in
test_tp_layers.py.

Tolerance for recomputed against plain runs: 1e-6 absolute on losses of about 5.5. The
recomputed forward runs the same ops on the same values, so the losses agree to rounding of
the schedule (gradients of a recomputed block are accumulated in the same order; 0 seen);
a mask drawn anew would change the second step's loss by about 1e-2.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tessera.run import build_datasets, build_model, build_tokenizer
from tessera.testing import run_distributed, tiny_run_config
from tessera.train.trainer import Trainer

RECOMPUTE_PARITY = dict(rtol=0, atol=1e-6)
MODELS = {"gpt": {"preset": "tiny"}, "gpt_dropout": {"preset": "tiny", "dropout": 0.1},
          "hf_gpt2_dropout": {"preset": "tiny", "hf": "gpt2", "dropout": 0.1}}
RUNS = {  # name: (model, strategy)
    "dp2_tp2": ("gpt", "dp=2,tp=2,mbs=4,gbs=8"),
    "dropout_dp2_tp2": ("gpt_dropout", "dp=2,tp=2,mbs=4,gbs=8"),
    "dropout_dp2_tp2_recompute": ("gpt_dropout", "dp=2,tp=2,mbs=4,gbs=8,recompute=full"),
    "dropout_tp2_pp2": ("gpt_dropout", "dp=1,tp=2,pp=2,mbs=4,gbs=8"),
    "dropout_tp2_pp2_recompute": ("gpt_dropout", "dp=1,tp=2,pp=2,mbs=4,gbs=8,recompute=full"),
    # Hugging Face GPT-2 (attn_pdrop through transformers' AttentionInterface), captured.
    "hf_dropout_tp2_pp2": ("hf_gpt2_dropout", "dp=1,tp=2,pp=2,mbs=4,gbs=8"),
    "hf_dropout_tp2_pp2_recompute": ("hf_gpt2_dropout",
                                     "dp=1,tp=2,pp=2,mbs=4,gbs=8,recompute=full"),
    # ... with Megatron sequence parallelism in the stages: residual and MLP dropout on each
    # rank's sequence chunk (its policy's seq_dropout, tensor/seq_dropout.py), captured.
    "hf_dropout_tp2_pp2_seq": ("hf_gpt2_dropout", "dp=1,tp=2,pp=2,mbs=4,gbs=8,tp_seq=on"),
    "hf_dropout_tp2_pp2_seq_recompute": ("hf_gpt2_dropout", "dp=1,tp=2,pp=2,mbs=4,gbs=8,"
                                                            "tp_seq=on,recompute=full"),
}


def _train(out: Path, model: str, strategy: str) -> dict:
    config = tiny_run_config(out, strategy, model=MODELS[model])
    train_ds, eval_ds = build_datasets(config, build_tokenizer(config))
    trainer = Trainer(build_model(config), config.train, train_ds, eval_ds,
                      strategy=config.strategy)
    result = trainer.train()
    pipeline = trainer.plan.pipeline
    recomputes = ("recompute" in trainer.plan.features if pipeline is None
                  else max(pipeline.program.ratios) > 0)  # the stages' recomputed share
    return {"losses": result.losses, "features": trainer.plan.features,
            "graph_ops": _attention_ops(pipeline, config), "recomputes": recomputes,
            "eval": trainer.evaluate()}


def _attention_ops(pipeline, config) -> set[str]:
    """The attention dropout op and random draws in this rank's captured training graph."""
    if pipeline is None:
        return set()
    local = (config.strategy.micro_batch_size, config.data.seq_len)
    graph = pipeline.program.get(local, training=True).graph.program.graph
    return {str(n.target) for n in graph.nodes
            if "tp_dropout_attention" in str(n.target) or "randint" in str(n.target)}


def _runs(rank, world_size, root):
    return {name: _train(Path(root) / name, model, strategy)
            for name, (model, strategy) in RUNS.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("tp_dropout_training"))
    # The timeout catches hangs; it is wide because a loaded 2-core machine runs slowly.
    results = run_distributed(_runs, 4, args=(root,), timeout=600)
    for name in RUNS:  # every rank logs the mean over the loss group
        assert all(r[name]["losses"] == results[0][name]["losses"] for r in results), name
    return results


def _close(a, b, **tol):
    torch.testing.assert_close(torch.tensor(a), torch.tensor(b), **tol)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dropout_dp2_tp2", "dropout_tp2_pp2", "hf_dropout_tp2_pp2",
                                  "hf_dropout_tp2_pp2_seq"])
def test_tp_trains_with_dropout_and_recomputes_its_masks(runs, name):
    got = runs[0][name]
    losses = got["losses"]
    assert len(losses) == 5 and all(torch.isfinite(torch.tensor(losses)))
    assert "tp_attention_dropout" in got["features"]
    assert losses[-1] < losses[0]  # it trains
    if not name.startswith("hf"):  # the same model and data without dropout
        undropped = runs[0]["dp2_tp2"]["losses"]
        assert max(abs(a - b) for a, b in zip(losses, undropped)) > 1e-3  # dropout ran
    recomputed = runs[0][f"{name}_recompute"]
    assert recomputed["recomputes"] and not got["recomputes"]
    _close(recomputed["losses"], losses, **RECOMPUTE_PARITY)
    assert 0 < got["eval"] < losses[0] + 1  # evaluation runs (no dropout there)


@pytest.mark.slow
def test_no_attention_dropout_keeps_the_models_attention(runs):
    assert "tp_attention_dropout" not in runs[0]["dp2_tp2"]["features"]


@pytest.mark.slow
def test_pipeline_stages_hold_the_attention_op_and_draw_its_seed(runs):
    # Each stage's captured training graph holds the op of its attention layers and the
    # randint of their seeds, drawn on every run rather than baked in at capture.
    for rank, res in enumerate(runs):
        for name in ("dropout_tp2_pp2", "hf_dropout_tp2_pp2"):
            assert res[name]["graph_ops"] == {"tessera.tp_dropout_attention.default",
                                              "aten.randint.low"}, (rank, name)
