"""pipeline_leaf_modules: a model torch.export cannot capture whole trains under pp > 1,
its untraceable modules run eagerly inside their stages, equal to one device."""

import warnings

import pytest
import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

from tessera import Trainer, TrainingArguments
from tessera.models.config import preset
from tessera.models.transformer import Transformer
from tessera.parallel.pipeline.capture import CaptureError, capture
from tessera.parallel.pipeline.kept import kept_bytes, measured_under
from tessera.parallel.pipeline.leaves import is_leaf_call, mark_leaves
from tessera.parallel.pipeline.split import split_graph
from tessera.strategy import Strategy, StrategyError
from tessera.testing import run_distributed, tiny_trainer, train_tiny

LEAVES = ["transformer.h.*.mlp"]


class TopOneMoE(nn.Module):
    """Two experts, each token routed to its top-scoring one: the routing reads tensor values
    (``nonzero`` and a Python ``if`` on how many tokens an expert got), which torch.export
    cannot trace."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.router = nn.Linear(width, 2)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(),
                                                   nn.Linear(2 * width, width))
                                     for _ in range(2))

    def forward(self, hidden):  # (B, T, H) -> (B, T, H)
        flat = hidden.reshape(-1, hidden.shape[-1])
        probs = self.router(flat).softmax(-1)
        weight, choice = probs.max(-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows = (choice == e).nonzero().squeeze(-1)
            if rows.numel() == 0:  # data-dependent: how many tokens chose expert e
                continue
            out = out.index_add(0, rows, expert(flat[rows]) * weight[rows, None])
        return out.reshape(hidden.shape)


def moe_gpt2(device: str = "cpu") -> GPT2LMHeadModel:
    """A tiny GPT-2 whose MLPs are mixture-of-experts layers (no dropout: runs compare
    losses across layouts)."""
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT2LMHeadModel(GPT2Config(
            vocab_size=256, n_positions=32, n_embd=32, n_layer=4, n_head=2, use_cache=False,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None,
            eos_token_id=None))
        for block in model.transformer.h:
            block.mlp = TopOneMoE(32)
    return model


def test_uncapturable_module_is_named_with_the_leaf_way_out():
    with pytest.raises(CaptureError) as err:
        capture(moe_gpt2(), 2, 8)
    message = str(err.value)
    assert "if rows.numel() == 0" in message  # the operation, by its source line
    assert "pipeline_leaf_modules=['transformer.h.*.mlp']" in message  # the way out
    assert "pipeline_split_points" in message


def test_leaves_capture_on_meta_and_run_eagerly_in_pieces():
    model = moe_gpt2()
    assert mark_leaves(model, LEAVES) == [f"transformer.h.{i}.mlp" for i in range(4)]
    graph = capture(model, 2, 8)
    leaves = [n for n in graph.compute if n.startswith("invoke_leaf_function")]
    assert len(leaves) == 4
    # priced as the experts' and router's matmuls: 2 FLOPs per weight per token (16 tokens)
    weights = sum(p.numel() for p in model.transformer.h[0].mlp.parameters())
    assert graph.nodes[leaves[0]].cost.fwd_flops == 2.0 * weights * 16
    # the memory estimate's fake run goes through the leaves' calls (no fallback, no warning)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # kept.py warns when it falls back
        assert kept_bytes(measured_under(graph, "cpu", None)) is not None
    # two pieces cut after the second leaf run as the model does, gradients included
    cut = graph.compute.index(leaves[1]) + 1
    pieces = split_graph(graph, [graph.compute[:cut], graph.compute[cut:]], model)
    ids = torch.randint(0, 256, (2, 8))
    sent = pieces[0].module(ids)
    logits = pieces[1].module(*sent, *[ids] * len(pieces[1].batch))[0]
    logits.square().mean().backward()
    piece_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    reference = model(ids).logits
    reference.square().mean().backward()
    # the same kernels in the same order: equal up to fp32 reassociation in the graph
    torch.testing.assert_close(logits, reference, rtol=0, atol=1e-6)
    for got, want in zip(piece_grads, (p.grad for p in model.parameters())):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    # on the meta device (a model larger than memory): captured before any weight exists
    meta = moe_gpt2("meta")
    mark_leaves(meta, LEAVES)
    assert [n for n in capture(meta, 2, 8).compute if "leaf" in n] == leaves


def test_bad_leaf_names_and_layouts_are_refused():
    model = moe_gpt2()
    with pytest.raises(StrategyError, match="'transformer.h.*.moe' matches no module"):
        mark_leaves(model, ["transformer.h.*.moe"])
    with pytest.raises(StrategyError, match="names the whole model"):
        mark_leaves(model, ["*"])
    assert mark_leaves(model, ["transformer.h.1", "transformer.h.1.mlp"]) == \
        ["transformer.h.1"]  # a match inside another is part of it
    for text, fragment in (("dp=1,mbs=1,gbs=1", "needs pp > 1"),
                           ("pp=2,tp=2,mbs=1,gbs=2", "with tp=2 is not built"),
                           ("pp=2,sp=2,mbs=1,gbs=2", "with sp=2 is not built")):
        with pytest.raises(StrategyError, match=fragment):
            Strategy.parse(text).check_leaf_modules(LEAVES)


class _Halves(nn.Module):
    def forward(self, x):  # returns half the width: not what a leaf may return
        return x[..., : x.shape[-1] // 2]


def test_a_leaf_returning_another_shape_is_refused_naming_it():
    model = nn.Sequential(nn.Embedding(8, 4), _Halves(), nn.Linear(4, 8))
    mark_leaves(model, ["1"])
    graph = capture(model, 1, 3)
    piece = split_graph(graph, [graph.compute], model)[0]
    with pytest.raises(TypeError, match=r"_Halves returned a tensor of shape \(1, 3, 2\)"):
        piece.module(torch.zeros(1, 3, dtype=torch.long))


def _train(rank, world, root):
    from torch.utils.data import Dataset

    class Tokens(Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            g = torch.Generator().manual_seed(i)
            return {"input_ids": torch.randint(0, 256, (17,), generator=g)}

    def run(name, strategy, **extra):
        args = TrainingArguments(output_dir=f"{root}/{name}", per_device_train_batch_size=2,
                                 max_steps=3, logging_steps=1, save_strategy="no",
                                 learning_rate=1e-2, strategy=strategy, **extra)
        return Trainer(model=moe_gpt2(), args=args, train_dataset=Tokens()).train().losses

    if world == 1:
        return {"one": run("one", "dp=1,mbs=2,gbs=8"),
                "reference": train_tiny(f"{root}/ref_one", "dp=1,mbs=2,gbs=8", 3)[0].losses,
                "bf16": train_tiny(f"{root}/bf16_one", "dp=1,mbs=2,gbs=8,precision=bf16",
                                   3)[0].losses}
    runs = {schedule: run(schedule, f"pp=2,mbs=2,gbs=8,schedule={schedule}{more}",
                          pipeline_leaf_modules=LEAVES, **extra)
            for schedule, more, extra in (
                ("1f1b", "", {}),
                ("gpipe", ",recompute=1", {"pipeline_split_points": ["transformer.h.1"]}),
                ("interleaved", "", {}))}
    # the YAML path (train.pipeline_leaf_modules), the reference model's attention as leaves
    trainer = tiny_trainer(f"{root}/ref_pp", "pp=2,mbs=2,gbs=8", 3, train={
        "pipeline_leaf_modules": ["blocks.*.attn"]})
    runs["reference"] = trainer.train().losses
    runs["bf16"] = train_tiny(f"{root}/bf16_pp", "pp=2,mbs=2,gbs=8,precision=bf16", 3, train={
        "pipeline_leaf_modules": ["blocks.*.attn"]})[0].losses
    graph = trainer.plan.pipeline.program.graph
    runs["leaf_calls"] = sum(is_leaf_call(graph.nodes[n].node) for n in graph.compute)
    return runs


@pytest.mark.slow
def test_pp2_with_leaf_modules_equals_one_device(tmp_path):
    one = run_distributed(_train, 1, args=(str(tmp_path),))[0]
    runs = run_distributed(_train, 2, args=(str(tmp_path),))[0]
    assert runs.pop("leaf_calls") == 2  # the reference model's two attentions, opaque
    for schedule, losses in runs.items():
        want = one[schedule if schedule in ("reference", "bf16") else "one"]
        # the same arithmetic per micro-batch (fp32, or bf16 autocast on the same kernels)
        # summed in another order: 1e-5 on losses near 5.5 over 3 steps
        assert len(losses) == 3
        assert max(abs(a - b) for a, b in zip(want, losses)) < 1e-5, (schedule, want, losses)


def test_leaves_under_bf16_autocast_compute_as_the_whole_model():
    torch.manual_seed(0)
    model = Transformer(preset("small", n_layers=2, vocab_size=64, max_seq_len=32,
                               d_model=32, n_heads=2))
    mark_leaves(model, ["blocks.*.attn"])  # their q, k and v read one input
    graph = capture(model, 2, 16)
    piece = split_graph(graph, [graph.compute], model)[0]
    ids = torch.randint(0, 64, (2, 16))

    def run(forward):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = forward()
        out.float().square().mean().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        return out, grads

    out, grads = run(lambda: piece.module(ids)[0])
    want, want_grads = run(lambda: model(ids))
    # the same kernels on the same dtypes: bit for bit (a leaf whose input casts autocast
    # cached and shared would sum the projections' gradients in bf16, off by ~3e-5)
    assert torch.equal(out, want)
    assert all(torch.equal(a, b) for a, b in zip(grads, want_grads))
