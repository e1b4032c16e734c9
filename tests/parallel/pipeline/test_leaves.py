"""pipeline_leaf_modules: a model torch.export cannot capture whole trains under pp > 1,
its untraceable modules run eagerly inside their stages, equal to one device."""

import gc
import importlib
import warnings
import weakref

import pytest
import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

from tessera import Trainer, TrainingArguments
from tessera.config import ConfigError, load_config
from tessera.models.config import preset
from tessera.models.transformer import Transformer
from tessera.parallel.pipeline.capture import CaptureError, capture
from tessera.parallel.pipeline.kept import kept_bytes, measured_under
from tessera.parallel.pipeline.leaves import is_leaf_call, mark_leaves
from tessera.parallel.pipeline.cost import DeviceRates
from tessera.parallel.pipeline.cost_table import CostTable, candidate_cuts
from tessera.parallel.pipeline.partition import partition
from tessera.parallel.pipeline.split import boundaries, spec_of, split_graph
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
                          **{"pipeline_leaf_modules": LEAVES, **extra})
            for schedule, more, extra in (
                ("1f1b", "", {}),
                ("gpipe", ",recompute=1", {"pipeline_split_points": ["transformer.h.1"]}),
                # whole blocks as leaves, 4 virtual stages of one block each
                ("interleaved", "", {"pipeline_leaf_modules": ["transformer.h.*"]}))}
    # the YAML path (train.pipeline_leaf_modules), the reference model's attention as leaves
    trainer = tiny_trainer(f"{root}/ref_pp", "pp=2,mbs=2,gbs=8", 3, train={
        "pipeline_leaf_modules": ["blocks.*.attn"]})
    runs["reference"] = trainer.train().losses
    # chunk memory: the leaves' weights live in chunks, placed before their stage runs
    runs["chunk"] = train_tiny(f"{root}/chunk_pp", "pp=2,mbs=2,gbs=8,memory=chunk", 3,
                               train={"pipeline_leaf_modules": ["blocks.*"]},
                               memory={"chunk_size": 4096})[0].losses
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
        want = one[{"reference": "reference", "bf16": "bf16", "chunk": "reference"
                    }.get(schedule, "one")]  # the one-device run of the same model
        # the same arithmetic per micro-batch (fp32, or bf16 autocast on the same kernels)
        # summed in another order: 1e-5 on losses near 5.5 over 3 steps
        assert len(losses) == 3
        assert max(abs(a - b) for a, b in zip(want, losses)) < 1e-5, (schedule, want, losses)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_leaves_under_bf16_autocast_compute_as_the_whole_model(device):
    torch.manual_seed(0)
    model = Transformer(preset("small", n_layers=2, vocab_size=64, max_seq_len=32,
                               d_model=32, n_heads=2)).to(device)
    mark_leaves(model, ["blocks.*.attn"])  # their q, k and v read one input
    graph = capture(model, 2, 16)
    piece = split_graph(graph, [graph.compute], model)[0]
    ids = torch.randint(0, 64, (2, 16), device=device)

    def run(forward):
        with torch.autocast(device, dtype=torch.bfloat16):
            out = forward()
        out.float().square().mean().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        return out, grads

    out, grads = run(lambda: piece.module(ids)[0])
    want, want_grads = run(lambda: model(ids))
    if device == "cpu":
        # the same kernels on the same dtypes: bit for bit (a leaf whose input casts
        # autocast cached and shared would sum the projections' gradients in bf16, off by
        # ~3e-5)
        assert torch.equal(out, want)
        assert all(torch.equal(a, b) for a, b in zip(grads, want_grads))
        return
    # GPU kernels may pick other algorithms per call: bf16 rounding, not bit equality
    torch.testing.assert_close(out, want, rtol=1e-2, atol=1e-2)
    for got, expected in zip(grads, want_grads):
        torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-3)


def test_block_leaves_are_cut_only_where_tensors_cross():
    model = moe_gpt2()
    mark_leaves(model, ["transformer.h.*"])  # whole blocks: each call's value is a tuple
    graph = capture(model, 2, 8)
    allowed = candidate_cuts(CostTable(graph, DeviceRates()), finer=True)
    assert allowed and all(not is_leaf_call(graph.nodes[graph.compute[c - 1]].node)
                           for c in allowed)
    part = partition(graph, 4)
    groups = [graph.compute[lo:hi] for lo, hi in zip(part.bounds, part.bounds[1:])]
    for entering in boundaries(graph, groups)[1:]:
        assert [spec_of(graph, name).shape for name in entering] == [(2, 8, 32)]


class _Noisy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(x)


def _piece(model, mode: str):
    getattr(model, mode)()
    graph = capture(model, 2, 4)
    return split_graph(graph, [graph.compute], model)[0]


def test_a_leaf_runs_in_the_mode_it_was_captured_in_without_doubled_hooks():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(8, 4), _Noisy(), nn.Linear(4, 8))
    mark_leaves(model, ["1"])
    patched = model[1].forward  # an instance-level forward (a hook library's) survives
    model[1].forward = patched
    model[1].register_forward_hook(lambda module, args, out: out * 10)
    piece = _piece(model, "eval")
    assert model[1].__dict__["forward"] is patched
    model.train()  # under pipeline stages the user's modules stay in training mode
    ids = torch.randint(0, 8, (2, 4))
    with torch.no_grad():
        got = piece.module(ids)[0]
        assert torch.equal(got, piece.module(ids)[0])  # no dropout: evaluated in eval mode
        assert torch.equal(got, model.eval()(ids))  # the hook applied once, as eagerly


class _Identity(nn.Module):
    def forward(self, x):
        return x  # e.g. a layer that returns early


class _Escapes(nn.Module):
    def __init__(self, other: nn.Linear) -> None:
        super().__init__()
        self.other = [other]  # a plain reference: not one of this module's parameters

    def forward(self, x):
        return self.other[0](x)


def test_leaves_pass_gradients_or_refuse_what_would_lose_them():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(8, 4), _Identity(), nn.Linear(4, 8))
    mark_leaves(model, ["1"])
    piece = _piece(model, "train")
    ids = torch.randint(0, 8, (2, 4))
    piece.module(ids)[0].sum().backward()
    got = model[0].weight.grad.clone()
    model.zero_grad()
    model(ids).sum().backward()
    assert torch.equal(got, model[0].weight.grad)  # through a leaf returning its input
    shared = nn.Linear(4, 4)
    escaping = nn.Sequential(nn.Embedding(8, 4), _Escapes(shared), shared, nn.Linear(4, 8))
    mark_leaves(escaping, ["1"])
    with pytest.raises(RuntimeError, match="not passed as explicit inputs"):
        _piece(escaping, "train").module(ids)[0].sum().backward()
    tied = nn.Sequential(nn.Embedding(8, 4), nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
    tied[1][1].weight = tied[1][0].weight
    with pytest.raises(StrategyError, match="holds a weight under two names"):
        mark_leaves(tied, ["1"])


class _Routed(nn.Module):
    """Top-1 routing without a Python branch: torch.export captures it, with a row count
    it cannot know (``nonzero``)."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x):
        flat = x.reshape(-1, 4)
        choice = flat.sum(-1) > 0
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows = (choice == bool(e)).nonzero().squeeze(-1)
            out = out.index_add(0, rows, expert(flat[rows]))
        return out.reshape(x.shape)


def test_a_captured_shape_that_depends_on_values_is_refused_with_the_leaf_way_out():
    model = nn.Sequential(nn.Embedding(8, 4), nn.Sequential(_Routed()), nn.Linear(4, 8))
    with pytest.raises(CaptureError, match=r"in module '1\.0' has a shape that depends on "
                                           r"tensor values.*pipeline_leaf_modules=\['1\.0'\]"):
        capture(model, 2, 4)
    mark_leaves(model, ["1.0"])
    assert len(capture(model, 2, 4).compute) > 0


def test_torch_lets_go_of_a_captured_model_s_leaves():
    store = importlib.import_module("torch._higher_order_ops.invoke_leaf_function"
                                    )._makefx_module_storage
    before = set(store)
    model = moe_gpt2()
    mark_leaves(model, LEAVES)
    graph = capture(model, 2, 8)
    added = set(store) - before
    assert len(added) == 4  # torch keeps each leaf call's module
    collected = weakref.ref(model)
    del model, graph
    gc.collect()
    assert collected() is None and not added & set(store)


def test_hugging_face_checkpointing_inside_a_leaf_gives_way_to_the_pipeline():
    model = moe_gpt2()
    model.gradient_checkpointing_enable()  # its recomputation would fail inside a leaf
    model.train()
    mark_leaves(model, ["transformer.h.*"])
    graph = capture(model, 2, 8)
    piece = split_graph(graph, [graph.compute], model)[0]
    ids = torch.randint(0, 256, (2, 8))
    piece.module(ids)[0].square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(ids).logits.square().mean().backward()
    for got, want in zip(grads, (p.grad for p in model.parameters())):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)  # fp32 reassociation
    assert all(block.gradient_checkpointing for block in model.transformer.h)  # put back


def test_leaves_with_a_planned_strategy_or_at_pp1_are_refused_with_the_config():
    with pytest.raises(ConfigError, match="pipeline_leaf_modules shapes the pipeline"):
        load_config(None, ["strategy=auto,gbs=8", "train.pipeline_leaf_modules=[blocks.*]"],
                    world_size=2)
    with pytest.raises(ConfigError, match="needs pp > 1"):
        load_config(None, ["strategy=dp=1,mbs=1,gbs=1",
                           "train.pipeline_leaf_modules=[blocks.*]"])
    with pytest.raises(StrategyError, match="shapes the pipeline of a pp the strategy fixes"):
        Trainer(model=moe_gpt2(), args=TrainingArguments(
            output_dir="unused", strategy="auto", pipeline_leaf_modules=LEAVES),
            train_dataset=[{"input_ids": torch.zeros(9, dtype=torch.long)}] * 8)
    # A stage budget with auto: the planner does not plan by it (it failed later at pp=1).
    with pytest.raises(ConfigError, match="stage_memory_budget shapes the pipeline"):
        load_config(None, ["strategy=auto,gbs=8", "train.stage_memory_budget=1GiB"],
                    world_size=2)
    with pytest.raises(StrategyError, match="stage_memory_budget shapes the pipeline"):
        Trainer(model=moe_gpt2(), args=TrainingArguments(
            output_dir="unused", strategy="auto", stage_memory_budget="1GiB"),
            train_dataset=[{"input_ids": torch.zeros(9, dtype=torch.long)}] * 8)
