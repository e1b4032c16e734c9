"""A recomputing stage: per-block segments, rematerialised one at a time, repeat the forward.

One process, no pipeline: the whole model is one stage, run once keeping its activations and
once with every block recomputed in the backward (and once with the last block recomputed
ahead, as scp does). With dropout on, equal gradients need each segment's recomputation to
draw the same masks as its forward.
"""

from __future__ import annotations

import torch

from tessera.memory.saved_peak import SavedPeak
from tessera.models import Transformer
from tessera.models.config import preset
from tessera.parallel.pipeline import capture
from tessera.parallel.pipeline.program import head_segments, head_tail
from tessera.parallel.pipeline.split import split_graph
from tessera.parallel.pipeline.stage import StageRunner
from tessera.parallel.plan import lm_loss


def _step(model, runner: StageRunner, batch, recompute: bool, ahead: bool = False):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)  # the forward's dropout masks
    probe = SavedPeak(model.parameters())
    with probe:
        state = runner.forward([], batch, recompute=recompute)
        state.loss = lm_loss(state.outputs[0], batch["labels"])
        if ahead:
            runner.recompute(state)  # the last segment, before the backward
        runner.backward(state, None)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(state.loss.detach()), grads, probe.peak


def test_per_block_recomputation_repeats_dropout_and_holds_one_block():
    torch.manual_seed(0)
    model = Transformer(preset("small", n_layers=4, dropout=0.1, max_seq_len=64)).train()
    graph = capture(model, 2, 64)
    group = list(graph.compute)
    head, tail = head_tail(graph, group, 1.0)
    segments = head_segments(graph, head)
    assert not tail and len(segments) >= 5  # the embedding, then one segment per block
    whole = StageRunner(0, [], split_graph(graph, [group], model)[0])
    segmented = StageRunner(0, split_graph(graph, segments, model), None)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (2, 65), generator=g)
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    loss, grads, kept_peak = _step(model, whole, batch, recompute=False)
    for ahead in (False, True):
        again, regrads, peak = _step(model, segmented, batch, recompute=True, ahead=ahead)
        # The same ops on the same values with the same masks: equal up to summation order
        # inside autograd (measured 0).
        assert again == loss
        for name, grad in grads.items():
            torch.testing.assert_close(regrads[name], grad, rtol=0, atol=1e-6)
        # One block rematerialised at a time, beside the blocks' inputs.
        assert peak < 0.5 * kept_peak, (peak, kept_peak)


def test_rms_norm_models_recompute_one_block_at_a_time():
    """An RMSNorm opens each Llama block with ops that read no weight (pow, mean, rsqrt);
    they belong to that block, so the head still splits at every block boundary."""
    from tessera.models.hf import build_hf_model, hf_config_from_reference
    from tessera.parallel.pipeline.capture import module_of
    from tessera.parallel.pipeline.cost_table import CostTable
    from tessera.parallel.pipeline.cost import DeviceRates

    with torch.device("meta"):
        model = build_hf_model("llama", **hf_config_from_reference(
            "llama", preset("tiny-llama", n_layers=4, vocab_size=256)))
    graph = capture(model, 1, 32)
    for name in graph.compute:  # every node inside a block's module is labelled with it
        path = module_of(graph.nodes[name].node)
        if ".layers." in path:
            assert graph.nodes[name].block == int(path.split(".layers.")[1].split(".")[0])
    table = CostTable(graph, DeviceRates())
    head, _ = head_tail(graph, list(graph.compute), 1.0, table)
    segments = head_segments(graph, head, table)
    assert len(segments) >= 5  # the embedding, then one segment per block
    index = graph.compute_index()
    largest = max(table.activations(index[s[0]], index[s[-1]] + 1) for s in segments)
    assert largest <= table.largest_block(0, len(graph.compute))  # what the estimate assumes


class _Rope(torch.nn.Module):  # no weights; registered on the model, called in each block
    def forward(self, x):
        return x * torch.cos(torch.arange(x.shape[1], device=x.device))[None, :, None]


class _Block(torch.nn.Module):
    def __init__(self, rope) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)
        self.rope = [rope]  # a reference, not a submodule: the model owns it

    def forward(self, x):
        h = x.pow(2).mean(-1, keepdim=True).rsqrt() * x  # an RMSNorm opening the block
        return self.proj(self.rope[0](h))


class _Container(torch.nn.Module):
    def __init__(self, rope) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_Block(rope) for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)  # the residual added by the container, not the block
        return x


class _SharedModuleModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.rope = torch.nn.Embedding(32, 16), _Rope()
        self.model, self.head = _Container(self.rope), torch.nn.Linear(16, 32)

    def forward(self, input_ids):
        return self.head(self.model(self.embed(input_ids)))


def test_block_labels_follow_the_calling_block_and_the_node_before():
    """A model-level module called inside each block is that block's; a residual added by
    the blocks' container follows the block before it (one run of labels per block)."""
    with torch.device("meta"):
        graph = capture(_SharedModuleModel(), 2, 8)
    labels = [graph.nodes[n].block for n in graph.compute]
    runs = [b for i, b in enumerate(labels) if i == 0 or labels[i - 1] != b]
    assert runs == [None, 0, 1, 2, None], labels
