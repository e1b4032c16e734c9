"""The partitioner's activation bytes, measured on fake tensors (pipeline/kept.py), against
what autograd saves when the captured graph (the code the stages run) runs for real."""

from __future__ import annotations

import contextlib
import gc
import types
import warnings
import weakref

import pytest
import torch
from torch import nn

from tessera.memory.saved_peak import SavedPeak
from tessera.models import Transformer
from tessera.models.config import preset
from tessera.models.hf import build_hf_model, hf_config_from_reference
from tessera.parallel.pipeline import capture, partition, priced_under
from tessera.parallel.pipeline.comm import TensorSpec, pack, unpack
from tessera.parallel.pipeline.cost import DeviceRates, op_name
from tessera.parallel.pipeline.kept import kept_bytes
from tessera.parallel.pipeline.kept import measured_under
from tessera.parallel.pipeline.cost_table import CostTable
from tessera.parallel.pipeline.program import PipelineProgram
from tessera.parallel.pipeline.split import split_graph
from tessera.parallel.pipeline.stage import StageRunner
from tessera.strategy import Strategy

BF16 = torch.bfloat16
SHAPE = dict(n_layers=2, vocab_size=512, d_model=192, n_heads=6, max_seq_len=512)


def _reference(activation):
    return lambda: Transformer(preset("small", activation=activation, **SHAPE))


def _hf(arch):
    config = hf_config_from_reference(arch, preset("gpt2", **SHAPE))
    return lambda: build_hf_model(arch, **config)


def _without_dtype_asserts(module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The captured module without its dtype asserts (true of the fp32 trace, not under
    autocast), as the pipeline's stage pieces run it: they keep only what computes."""
    for node in list(module.graph.nodes):
        if node.op == "call_function" and "_assert_tensor_metadata" in str(node.target):
            module.graph.erase_node(node)
    module.recompile()
    return module


def _saved_peak(module: nn.Module, ids: torch.Tensor, dtype: torch.dtype | None) -> int:
    """Peak bytes autograd saves in one forward (parameters and buffers excluded, the stage's
    state: RoPE tables saved for backward are slices of buffers; casts included)."""
    probe = SavedPeak([*module.parameters(), *module.buffers()])
    context = torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext()
    with probe, context:
        out = module(ids)
    del out
    return probe.peak


@pytest.mark.parametrize("build", [
    _reference("gelu"), _reference("swiglu"), _hf("gpt2"), _hf("llama"),
    # RoPE's q.float(): the capture asserts it fp32, which bf16 autocast breaks (skipped)
    lambda: Transformer(preset("small-llama", n_kv_heads=2, **SHAPE))],
    ids=["gelu", "swiglu", "gpt2", "llama", "reference-rope"])
def test_estimated_activations_are_what_the_captured_graph_saves(build):
    torch.manual_seed(0)
    batch, seq = 2, 512
    graph = capture(build().train(), batch, seq)
    ids = torch.randint(0, SHAPE["vocab_size"], (batch, seq))
    for dtype in (None, BF16):
        table = CostTable(measured_under(graph, "cpu", dtype), DeviceRates())
        estimate = table.activations(0, len(graph.compute))
        measured = _saved_peak(_without_dtype_asserts(graph.program.module()), ids, dtype)
        # The same graph, the same kernels, the same autocast: the same storages, counted
        # once each (fake and real runs differ only in what holds the bytes).
        assert estimate == measured, (dtype, estimate, measured)
    n = len(graph.compute)
    fp32 = CostTable(graph, DeviceRates()).activations(0, n)
    bf16 = CostTable(measured_under(graph, "cpu", BF16), DeviceRates()).activations(0, n)
    assert bf16 < 0.8 * fp32  # at 2 x 512 tokens activations outweigh the weights' copies


def _by_first_saver(kept) -> dict[str, int]:
    """Bytes charged to each node when every saved storage goes to its first saver."""
    charged: dict[str, int] = {}
    for nbytes, savers in kept.storages:
        charged[savers[0]] = charged.get(savers[0], 0) + nbytes
    return charged


class _TiedHead(nn.Module):
    """An embedding and an LM head sharing one weight: the smallest causal LM."""

    def __init__(self, vocab: int, width: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.embed(ids)))


def test_each_saved_storage_is_charged_once_to_the_node_that_saved_it():
    vocab, width, tokens = 96, 40, 24
    with torch.device("meta"):
        graph = capture(_TiedHead(vocab, width), 1, tokens)
    ops = {graph.nodes[n].node.target.__name__.split(".")[0]: n for n in graph.compute}
    fp32 = _by_first_saver(kept_bytes(graph))
    # ReLU keeps its output; the head's input is that same storage (charged to ReLU) and its
    # weight is a parameter (a stage state, not an activation): nothing more.
    assert fp32[ops["relu"]] == tokens * width * 4
    assert fp32.get(ops["linear"], 0) == 0
    bf16 = kept_bytes(measured_under(graph, "cpu", BF16))
    # Under autocast the head runs in bf16 and keeps bf16 copies of its fp32 input and of
    # the (tied) weight; the embedding and ReLU stay fp32.
    assert _by_first_saver(bf16)[ops["linear"]] == tokens * width * 2 + vocab * width * 2
    assert bf16.out[ops["relu"]] == tokens * width * 4
    assert bf16.out[ops["linear"]] == tokens * vocab * 2


class _SkipAndBuffer(nn.Module):
    """A skip connection whose tensor two layers save, on both sides of any cut, and a
    buffer read through a slice (state, not an activation)."""

    def __init__(self, vocab: int, width: int, layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.skip = nn.Linear(width, vocab)
        self.head = nn.Linear(width, vocab)
        self.register_buffer("scale", torch.ones(1024, width))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        e = self.embed(ids) * self.scale[: ids.shape[1]]
        x = e
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x) + self.skip(e)  # e saved by the first layer and by the skip


def test_a_tensor_saved_on_both_sides_of_a_cut_counts_in_both_stages():
    vocab, width, tokens = 64, 32, 16
    with torch.device("meta"):
        graph = capture(_SkipAndBuffer(vocab, width), 1, tokens)
    table, n = CostTable(graph, DeviceRates()), len(graph.compute)
    e_bytes = tokens * width * 4
    whole = table.activations(0, n)
    # The buffer (1024 x width fp32) is state: the whole graph keeps far less than it.
    assert whole < 1024 * width * 4
    linears = [i for i, name in enumerate(graph.compute)
               if op_name(graph.nodes[name].node) == "linear"]
    cut = linears[0] + 1  # after the first layer's matmul, before the skip's
    split = table.activations(0, cut) + table.activations(cut, n)
    assert split == whole + e_bytes  # both stages hold e: the layer's and the skip's input


class _ThreeReaders(nn.Module):
    """A normed hidden state h read by three projections, as attention's q, k and v read it
    ("linear"); the same after a ``.to`` that changes nothing ("no-op to"); or converted to
    bf16 by the model itself, twice ("converted": copies autocast does not make nor share)."""

    def __init__(self, vocab: int, width: int, reader: str) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.head = nn.Linear(width, vocab)
        self.reader = reader

    def normed(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.normed(ids)
        if self.reader == "converted":
            return self.head(torch.sin(h.to(BF16)) + torch.cos(h.to(BF16)))
        if self.reader == "no-op to":
            h = h.to(torch.float32)
        return self.head(self.q(h) + self.k(h) + self.v(h))


def _saved_by_stage(model: nn.Module, graph, cut: int, ids: torch.Tensor) -> int:
    """Peak bytes autograd saves when the pipeline's stage of compute nodes [cut, end) runs
    on h as received: a one-tensor message arrives as a view of its buffer."""
    pieces = split_graph(graph, [graph.compute[:cut], graph.compute[cut:]], model)
    stage = StageRunner(1, [], pieces[1], lambda: torch.autocast("cpu", dtype=BF16))
    h = model.normed(ids).detach()
    received = unpack(pack([h]), [TensorSpec(tuple(h.shape), h.dtype)])
    assert received[0]._is_view()
    probe = SavedPeak(model.parameters())
    with probe:
        state = stage.forward(received, {"input_ids": ids}, recompute=False)
    del state
    return probe.peak


@pytest.mark.parametrize("reader, shared", [("linear", 2), ("no-op to", 2), ("converted", 0)])
def test_a_stage_input_read_by_several_matmuls_is_cast_once(reader, shared):
    vocab, width, tokens = 64, 32, 16
    torch.manual_seed(0)
    model = _ThreeReaders(vocab, width, reader)
    graph = measured_under(capture(model, 1, tokens), "cpu", BF16)
    table, n = CostTable(graph, DeviceRates()), len(graph.compute)
    ops = [op_name(graph.nodes[name].node) for name in graph.compute]
    cut = ops.index("mul") + 1  # the stage starts after the norm: it receives h
    copy = tokens * width * 2  # one bf16 copy of h
    # In the whole graph each projection casts h anew; a stage receiving h holds it as a
    # leaf, whose cast autocast caches: two copies fewer there. The model's own conversions
    # are made each time, leaf or not.
    whole = table.activations(0, n)
    assert table.activations(0, cut) + table.activations(cut, n) == whole - shared * copy
    # And that is what autograd keeps when the pipeline's stage runs.
    ids = torch.randint(0, vocab, (1, tokens))
    assert table.activations(cut, n) == _saved_by_stage(model, graph, cut, ids)


def _stage_after_the_norm(model: nn.Module, tokens: int):
    """(CostTable, node count, cut, StageRunner) of the nodes after ``model``'s norm (the
    first ``mul``), captured and measured under bf16 autocast."""
    graph = measured_under(capture(model, 1, tokens), "cpu", BF16)
    table, n = CostTable(graph, DeviceRates()), len(graph.compute)
    cut = [op_name(graph.nodes[name].node) for name in graph.compute].index("mul") + 1
    pieces = split_graph(graph, [graph.compute[:cut], graph.compute[cut:]], model)
    return table, n, cut, StageRunner(1, [], pieces[1],
                                      lambda: torch.autocast("cpu", dtype=BF16))


def _two_in_flight(model, stage, ids, cast_cache):
    """Two micro-batches through ``stage`` (the first's backward after the second's
    forward, as 1F1B's stage 0 runs them) in a step whose casts ``cast_cache`` shares (None:
    not shared): (saved peak of the two forwards, whether the first input outlived its
    backward inside the step, the inputs' gradients, the weights' gradients)."""
    program = types.SimpleNamespace(cast_cache=cast_cache, local=[1])
    probe, states, grads = SavedPeak(model.parameters()), [], []
    model.zero_grad(set_to_none=True)
    out_grad = torch.ones(1, ids.shape[1], model.head.out_features, dtype=BF16)
    with PipelineProgram.step_casts(program, types.SimpleNamespace(runners={1: stage}), 2):
        with probe:
            for _ in range(2):
                with torch.no_grad():  # as received: nothing saved for it on this stage
                    h = model.normed(ids)
                states.append(stage.forward([h], {"input_ids": ids}, recompute=False))
        first = weakref.ref(states[0].inputs[0])
        grads += stage.backward(states.pop(0), [out_grad])
        gc.collect()
        outlived = first() is not None
        grads += stage.backward(states.pop(0), [out_grad])
    weights = {name: p.grad.clone() for name, p in model.named_parameters()
               if p.grad is not None}
    return probe.peak, outlived, grads, weights


def test_micro_batches_in_flight_share_weight_copies_and_read_inputs_as_views():
    # Under the step's shared casts (PipelineProgram.step_casts) two micro-batches in flight
    # keep one bf16 copy of each weight; the stage reads its received h as a view, so each
    # projection casts its own copy (a cached one would keep h alive until the step ends).
    vocab, width, tokens = 64, 32, 16
    torch.manual_seed(0)
    model = _ThreeReaders(vocab, width, "linear")
    table, n, cut, stage = _stage_after_the_norm(model, tokens)
    ids = torch.randint(0, vocab, (1, tokens))
    peak, outlived, grads, weights = _two_in_flight(
        model, stage, ids, lambda: torch.autocast("cpu", enabled=False))
    assert not outlived  # freed at its backward, inside the step
    expected = table.memory(cut, n, 0.0, 2, last=False) - table.state_bytes(cut, n)
    assert peak == expected
    copies = table.weight_copies(cut, n)
    assert copies == 3 * width * width * 2 + vocab * width * 2  # q, k, v and the head
    # Without sharing each micro-batch keeps its own weight copies and one cached copy of h.
    unshared = table.memory(cut, n, 0.0, 2, last=False, casts_shared=False)
    h_copy = tokens * width * 2  # two more per micro-batch when each reader casts h
    assert unshared - table.state_bytes(cut, n) == expected + copies - 2 * 2 * h_copy
    # The same copies' values, the same products: the weights' gradients are bit for bit
    # those of a step that casts per micro-batch. The input's gradient arrives through the
    # view: the three projections' bf16 gradients are summed in fp32 here, where through
    # one cached cast they were summed in bf16 first: equal within that rounding, an ulp
    # of bf16 (2^-8 relative) at the scale of the largest term, twice.
    peak_each, _, grads_each, weights_each = _two_in_flight(model, stage, ids, None)
    assert peak_each == unshared - table.state_bytes(cut, n)
    assert len(grads) == 2 and all(g.abs().sum() > 0 for g in grads)
    for got, want in zip(grads, grads_each):
        torch.testing.assert_close(got, want, rtol=0, atol=2 ** -7 * want.abs().max().item())
    assert weights.keys() == weights_each.keys() and len(weights) == 8  # q, k, v, head
    assert all(torch.equal(weights[name], weights_each[name]) for name in weights)


def test_a_stage_of_16_bit_weights_does_not_share_casts_and_casts_its_input_once():
    # 16-bit weights (memory=chunk) leave autocast no weight to cast: the step shares
    # nothing, and the stage's fp32 input stays a leaf whose one cached copy serves q, k and
    # v (read as a view, each would cast its own: two copies more per micro-batch).
    vocab, width, tokens = 64, 32, 16
    torch.manual_seed(0)
    model = _ThreeReaders(vocab, width, "linear").to(BF16)
    model.embed.float()  # h arrives in fp32, as a norm's output under autocast does
    table, n, cut, stage = _stage_after_the_norm(model, tokens)
    ids = torch.randint(0, vocab, (1, tokens))
    peak, outlived, _, _ = _two_in_flight(
        model, stage, ids, lambda: torch.autocast("cpu", enabled=False))
    assert table.weight_copies(cut, n) == 0
    unshared = table.memory(cut, n, 0.0, 2, last=False, casts_shared=False)
    assert table.memory(cut, n, 0.0, 2, last=False) == unshared
    assert peak == unshared - table.state_bytes(cut, n)
    assert peak == _two_in_flight(model, stage, ids, None)[0]
    assert not outlived


def test_no_autocast_to_run_keeps_the_output_count_and_says_so():
    if torch.cuda.is_available():
        pytest.skip("needs a machine where CUDA autocast is disabled")
    with torch.device("meta"):
        graph = capture(_TiedHead(16, 8), 1, 4)
    priced = measured_under(graph, "cuda", BF16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert kept_bytes(priced) is None
        table = CostTable(priced, DeviceRates())
    assert any("estimated from each node's output" in str(w.message) for w in caught)
    assert table.activations(0, len(graph.compute)) == sum(
        graph.nodes[n].cost.saved_bytes for n in graph.compute)


def test_a_bf16_stage_budget_recomputes_less_than_an_fp32_one():
    with torch.device("meta"):
        model = Transformer(preset("small", n_layers=8, vocab_size=256, max_seq_len=512))
    graph = capture(model, 2, 512)
    fp32 = priced_under(graph, Strategy.parse("pp=2"), "cpu")
    bf16 = priced_under(graph, Strategy.parse("pp=2,precision=bf16"), "cpu")
    stages, micro = 2, 4
    full = max(partition(fp32, stages, micro, recompute=(1.0,)).stage_memory)
    none = max(partition(fp32, stages, micro, recompute=(0.0,)).stage_memory)
    budget = (full + none) / 2  # fp32 must recompute part of its stages to fit
    chosen = {name: partition(g, stages, micro, memory_limit=budget, recompute=None)
              for name, g in (("fp32", fp32), ("bf16", bf16))}
    assert sum(chosen["fp32"].recompute) > 0
    assert sum(chosen["bf16"].recompute) < sum(chosen["fp32"].recompute), chosen
    assert max(chosen["bf16"].stage_memory) <= budget


def test_a_failing_fake_kernel_is_named_in_one_line(caplog):
    # Mixtral's router counts tokens with histc on int32, which has no CPU fake kernel: the
    # output-based count stands, said in one line, without torch's page of error log.
    import logging

    import transformers as T

    with torch.device("meta"):
        model = T.MixtralForCausalLM(T.MixtralConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
            num_experts_per_tok=2, use_cache=False))
    graph = measured_under(capture(model, 2, 16), "cpu", None)
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.ERROR):
        warnings.simplefilter("always")
        assert kept_bytes(graph) is None
    said = [str(w.message) for w in caught if "estimated from each node's output" in str(w.message)]
    assert len(said) == 1 and "\n" not in said[0] and "histogram_cpu" in said[0]
    assert not [r for r in caplog.records if r.name.startswith("torch._subclasses")]
