"""Pipeline parallelism: partition balance, bubbles, scp against 1F1B, tessera against torch.

Prints JSON lines, one per figure: {"name", "value", "unit", "compared_against", ...}, each
with the machine's load average (os.getloadavg) beside timings.

- partition_balance_max_over_mean: max / mean estimated stage time of tessera's partition,
  against the equal-layer split, on a uniform 24-layer transformer and on models with a large
  embedding and LM head: Hugging Face GPT-2 small, medium and large (12 / 24 / 36 layers,
  50257-token vocabulary) and Llama with Llama-3-8B's shape (32 layers, 128256-token
  vocabulary); target <= 1.10. Estimates only (no timing), on the meta device. The partition
  is the one ``apply_pipeline`` makes: an LM head heavier than half a mean stage is sliced
  over the vocabulary (pipeline/head.py) and spread over the last stages. Beside it, the
  partition with the head whole and the bound no cut along its graph nodes can beat there
  (the LM head matmul over the mean stage time).
- gpipe_step_over_ideal, 1f1b_step_over_ideal: measured step time over the ideal
  (m + p - 1) / m * T1 / p, where T1 is one process running all stages for the step.
- scp_vs_1f1b_recompute_tokens_ratio: shifted critical path over 1F1B, both with full
  recomputation, at the same memory: scp keeps micro-batches whole only within what 1F1B
  peaks at (the partitioner's default); target >= 1.15. Beside it the measured peak of what
  autograd saves on each rank (max over ranks, SavedPeak) and the schedule-order estimate.
  scp_keep_all_vs_1f1b_recompute_tokens_ratio: scp keeping the last S-1-s micro-batches of
  each stage whole, beyond 1F1B's memory, for comparison.
- scp_at_budget_vs_1f1b_recompute_tokens_ratio, scp_at_budget_vs_1f1b_at_budget_tokens_ratio:
  "the same memory" read as the same device budget rather than the same measured peak. The
  budget (``train.stage_memory_budget``, weights and AdamW states included) lies halfway
  between the partitioner's estimates of 1F1B's fullest stage with full recomputation and
  without any, so 1F1B fits it only by recomputing. scp under that budget (each stage
  recomputing the least that fits, keeping micro-batches and skipping the last stage's
  recomputation where the budget allows) over 1F1B with full recomputation (the issue's
  baseline), and over 1F1B under the same budget with stage-aware recomputation (the
  stronger baseline). Measured activation peaks beside them.
- tessera_vs_torch_1f1b_tokens_ratio: tessera's 1F1B over torch.distributed.pipelining's
  Schedule1F1B on the very same stage modules, each followed by the same all-reduce of the
  tied embedding's gradient over the two stages holding it (without it torch's step trains
  the two copies apart); target >= 1.0. tessera's step also broadcasts the loss to every
  rank, which torch's does not.
- materialized_param_bytes_max_rank_over_whole, peak_rss_on_meta_over_on_device: GPT-2
  medium at pp=4 given to the Trainer on the meta device (``model.on_meta``): the largest
  rank's materialised weights over the whole model's, and its peak resident memory once
  the Trainer is built over the same run given the model on the device (every rank builds
  all of it first). No timing.
- materialized_param_bytes_max_rank_over_whole_tp4, peak_rss_on_meta_over_on_device_tp4
  (and _tp2_pp2): the same for GPT-2 medium (vocabulary padded to 50,304, divisible by tp)
  at tp=4 (1d) and at tp=2 x pp=2: on meta each
  transformer block's weights are materialised whole just before being cut into the rank's
  shards (under pp only those of the rank's stages); on the device every rank builds the
  whole model and then shards it.
- estimated_head_stage_state_rows_over_whole_head: the partitioner's estimate of a sliced
  head's stage (weights, gradients, AdamW moments) with the head held as rows (rows.py) over
  the same stage holding the whole head weight with its moments, as before row holding.
- training_state_bytes_max_rank_over_whole: the same meta run after one training step, the
  largest rank's weights (rows held for a sliced head included, pipeline/rows.py) and AdamW
  moments over one device's (3x the model); per-rank figures beside it.
- subpipe_vs_plain_tp_step_ratio: tp=2 x pp=2 (4 processes) step time without sub-pipelined
  tensor parallelism over the time with it (``tp_overlap=subpipe``); > 1 means the overlap
  of one half's all-reduces with the other half's compute pays off.
- leaf_blocks_vs_captured_step_ratio: pp=2 step time with every block captured over the
  time with every block run eagerly as a leaf module (``pipeline_leaf_modules``, the way
  out for models torch.export cannot capture); about 1.0 means leaves cost nothing extra.

- dp_overlap_vs_after_drain_step_ratio: dp=2 x pp=2 (4 processes) step time with the dp
  average done after the pipeline drains (tessera before overlap.py, and what a user of
  torch's schedules does after ``step()``) over the time with buckets launched during the
  last backward; > 1 means the overlap pays. Beside it the time each step spends in the final
  gradient sync (slowest rank), which the overlap shrinks even where the step does not.

Timed sides alternate round by round in the same processes, and the best round of each counts
(the least disturbed by other load on a shared machine).

    python benchmarks/bench_pipeline.py [--quick]
        [--only balance|timing|subpipe|dp_overlap|materialize|leaves]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from tessera.models import Transformer
from tessera.models.config import preset
from tessera.models.hf import build_hf_model, hf_config_from_reference
from tessera.parallel.pipeline import capture, partition
from tessera.parallel.pipeline.cost import DeviceRates
from tessera.parallel.pipeline.head import head_slices_for, slice_head
from tessera.parallel.pipeline.cost_table import STATE_FACTOR, CostTable
from tessera.parallel.pipeline.partition import evaluate_bounds, layer_bounds
from tessera.parallel.plan import lm_loss
from tessera.testing import run_distributed

SEQ = 128


def emit(name: str, value: float, unit: str, compared_against, **extra) -> None:
    print(json.dumps({"name": name, "value": round(value, 4), "unit": unit,
                      "compared_against": compared_against, **extra}), flush=True)


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# ------------------------------------------------------------------------------ balance
# (label, Hugging Face family, reference preset, overrides): models whose embedding and LM
# head are heavy next to a block; GPT-2 small's head outweighs a stage at pp >= 4.
HEAVY_HEAD_MODELS = (
    ("gpt2_small_vocab_50257", "gpt2", "gpt2", {}),
    ("gpt2_medium_vocab_50257", "gpt2", "gpt2-medium", {}),
    ("gpt2_large_vocab_50257", "gpt2", "gpt2-large", {}),
    ("llama3_8b_shape_vocab_128256", "llama", "llama-7b",
     dict(vocab_size=128256, n_kv_heads=8, d_ff=14336)),
)


def _balance_models():
    """(label, meta-device model) pairs: a uniform transformer, then the heavy-head ones."""
    with torch.device("meta"):
        yield "uniform_24_layers", Transformer(preset("small", n_layers=24))
        for label, family, name, overrides in HEAVY_HEAD_MODELS:
            config = preset(name, max_seq_len=SEQ, **overrides)
            yield label, build_hf_model(family, **hf_config_from_reference(family, config))


def balance_figures() -> None:
    for label, model in _balance_models():
        graph = capture(model, 1, SEQ)
        table = CostTable(graph, DeviceRates())
        heaviest = max(table.fwd[i + 1] - table.fwd[i] + table.bwd[i + 1] - table.bwd[i]
                       for i in range(len(graph.compute)))
        for pp in (2, 4, 8):
            whole = partition(graph, pp, micro_batches=2 * pp)
            equal = evaluate_bounds(graph, layer_bounds(graph, pp), micro_batches=2 * pp)
            slices = head_slices_for(graph, pp)
            sliced = slice_head(capture(model, 1, SEQ), slices) if slices > 1 else graph
            ours = partition(sliced, pp, micro_batches=2 * pp, finer=True)  # apply_pipeline's
            mean = sum(whole.stage_time) / pp
            # With the head whole, no split along graph nodes beats the LM head matmul.
            emit("partition_balance_max_over_mean", ours.balance, "ratio",
                 {"equal_layer_split": round(equal.balance, 4),
                  "head_whole": round(whole.balance, 4),
                  "crossing_MiB": [round(b / 2**20, 2) for b in ours.crossing_bytes],
                  "head_whole_bound_heaviest_node_over_mean": round(max(1.0, heaviest / mean),
                                                                    4)},
                 model=label, pp=pp, head_slices=slices, target="<= 1.10")
            if slices > 1:
                _emit_head_rows(sliced, ours.bounds, label, pp)


def _emit_head_rows(graph, bounds: list[int], label: str, pp: int) -> None:
    """The partitioner's estimate of each stage's weights, gradients and AdamW moments
    with the sliced head's rows held as rows (pipeline/rows.py) against every stage reading
    the head holding all of it with its moments (before row holding)."""
    table = CostTable(graph, DeviceRates())
    stages = list(zip(bounds, bounds[1:]))
    rows = [table.state_bytes(a, b) for a, b in stages]
    whole = [sum(STATE_FACTOR * w.size for w in table.weights
                 if any(a <= i < b for i in w.whole + [i for i, _, _ in w.slices]))
             for a, b in stages]
    changed = [i for i in range(len(stages)) if rows[i] != whole[i]]
    if not changed:  # the head's slices all on its home's stage
        return
    worst = max(changed, key=whole.__getitem__)
    emit("estimated_head_stage_state_rows_over_whole_head", rows[worst] / whole[worst], "ratio",
         "the same stage holding all of the sliced head with gradient and moments; the "
         "head stage (not the weight's home) holding the most before row holding", stage=worst,
         rows_GiB=[round(b / 2**30, 2) for b in rows],
         whole_GiB=[round(b / 2**30, 2) for b in whole], model=label, pp=pp)


# ------------------------------------------------------------------------------ timings
def _model(n_layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return Transformer(preset("small", n_layers=n_layers, max_seq_len=SEQ))


def _batches(m: int, mbs: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, 256, (mbs, SEQ), generator=g),
             "labels": torch.randint(0, 256, (mbs, SEQ), generator=g)} for _ in range(m)]


def _tessera(strategy_text: str, n_layers: int, budget: int | None = None,
             leaves: list[str] | None = None):
    from tessera.mesh import Mesh
    from tessera.parallel import parallelize
    from tessera.parallel.pipeline import PipelineEngine
    from tessera.strategy import Strategy

    strategy = Strategy.parse(strategy_text)
    plan = parallelize(_model(n_layers), strategy, Mesh(strategy, "cpu"), stage_budget=budget,
                       leaf_modules=leaves)
    return plan, PipelineEngine(plan, strategy, torch.device("cpu"))


def recompute_budget(pp: int, m: int, n_layers: int, mbs: int) -> dict[str, float]:
    """A stage memory budget under which 1F1B fits only by recomputing: halfway between
    the partitioner's estimate of its fullest stage with full recomputation and without any
    (weights and AdamW states included)."""
    with torch.device("meta"):
        graph = capture(_model(n_layers), mbs, SEQ)
    low = max(partition(graph, pp, m, "1f1b", recompute=(1.0,)).stage_memory)
    high = max(partition(graph, pp, m, "1f1b", recompute=(0.0,)).stage_memory)
    return {"budget": (low + high) / 2, "full_recompute": low, "no_recompute": high}


def _timed(fn) -> float:
    torch.distributed.barrier()
    start = time.perf_counter()
    fn()
    torch.distributed.barrier()
    return time.perf_counter() - start


def _torch_schedule(plan, m: int, mbs: int):
    """torch.distributed.pipelining Schedule1F1B over tessera's own stage modules."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    pipe = plan.pipeline
    stage = pipe.local_stages[0]
    built = pipe.program.get((mbs, SEQ), training=True)
    runner = built.runners[stage]

    class Wrapped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.piece = runner.tail.module  # the graph module holds the stage's weights

        def forward(self, *xs):
            out = self.piece(*xs)
            return out[0] if len(out) == 1 else out

    mod = Wrapped()
    pstage = PipelineStage(mod, stage, pipe.n_stages, torch.device("cpu"), group=pipe.pp_group)
    return Schedule1F1B(pstage, n_microbatches=m, loss_fn=lm_loss), stage


def _keep_all(built, m: int):
    """scp keeping the last S-1-s micro-batches whole, beyond 1F1B's memory (the
    partition's default keeps only what fits; this side shows what that bound costs)."""
    from tessera.parallel.pipeline.schedules import max_kept

    plan, engine = built
    pipe = plan.pipeline
    pipe.partition.keep = tuple(max_kept(s, pipe.n_stages, m) for s in range(pipe.n_stages))
    return plan, engine


def _saved_peak(built, batches) -> int:
    """Peak bytes autograd holds for backward on this rank during one step (SavedPeak)."""
    from tessera.memory.saved_peak import SavedPeak

    plan, engine = built
    probe = SavedPeak(plan.model.parameters())
    with probe:
        engine.forward_backward(batches)
    return probe.peak


def _timing_worker(rank, world, n_layers, m, mbs, rounds, budget):
    torch.manual_seed(0)
    batches = _batches(m, mbs)
    out = {}
    base = f"pp={world},mbs={mbs},gbs={mbs * m}"
    plans = {
        # the same stage memory budget, each stage recomputing the least that fits it
        "1f1b_budget": _tessera(f"{base},schedule=1f1b", n_layers, budget),
        "scp_budget": _tessera(f"{base},schedule=scp", n_layers, budget),
        "gpipe": _tessera(f"pp={world},mbs={mbs},gbs={mbs * m},schedule=gpipe", n_layers),
        "1f1b": _tessera(f"pp={world},mbs={mbs},gbs={mbs * m},schedule=1f1b", n_layers),
        "1f1b_recompute": _tessera(
            f"pp={world},mbs={mbs},gbs={mbs * m},schedule=1f1b,recompute=full", n_layers),
        "scp_recompute": _tessera(
            f"pp={world},mbs={mbs},gbs={mbs * m},schedule=scp,recompute=full", n_layers),
        "scp_keep_all": _keep_all(_tessera(
            f"pp={world},mbs={mbs},gbs={mbs * m},schedule=scp,recompute=full", n_layers), m),
    }
    out["saved_peak"] = {name: _saved_peak(plans[name], batches)
                         for name in ("1f1b_recompute", "scp_recompute", "scp_keep_all",
                                      "1f1b_budget", "scp_budget")}
    out["budget_choice"] = {name: {"recompute": list(plans[name][0].pipeline.ratios),
                                   "keep": list(plans[name][0].pipeline.partition.keep),
                                   "estimated_MiB": [round(b / 2**20, 2) for b in
                                                     plans[name][0].pipeline.partition
                                                     .stage_memory]}
                            for name in ("1f1b_budget", "scp_budget")}
    sched, stage = _torch_schedule(plans["1f1b"][0], m, mbs)
    full = torch.cat([b["input_ids"] for b in batches])
    labels = torch.cat([b["labels"] for b in batches])

    torch_sync = plans["1f1b"][0].pipeline.grad_sync

    def torch_step():
        if stage == 0:
            sched.step(full)
        elif stage == world - 1:
            sched.step(target=labels, losses=[])
        else:
            sched.step()
        # The model ties its embedding to the LM head, on the first and the last stage:
        # torch's schedule leaves the two copies' gradients apart, and a user of it sums them
        # over the stages to train correctly, as tessera's engine does (the same call).
        torch_sync.sync()

    single = _model(n_layers) if rank == 0 else None

    def one_process():
        if single is not None:  # all stages on rank 0 while the others wait
            for b in batches:
                (lm_loss(single(b["input_ids"]), b["labels"]) / m).backward()

    sides = {name: (lambda e=engine: e.forward_backward(batches))
             for name, (_, engine) in plans.items()}
    sides["torch_1f1b"] = torch_step
    sides["one_process"] = one_process
    for fn in sides.values():  # warm-up: capture, allocation, torch shape inference
        fn()
    best = {name: float("inf") for name in sides}
    for _ in range(rounds):
        for name, fn in sides.items():
            best[name] = min(best[name], _timed(fn))
    out["best"] = best
    return out


def peak_activation_bytes(schedule: str, pp: int, m: int, n_layers: int, mbs: int,
                          keep_all: bool = False) -> float:
    """Estimated peak activation bytes over stages under full recomputation, from the
    partitioner's per-stage activation and boundary bytes and the schedule's action order
    (scp keeps what the partition keeps, or with ``keep_all`` the last S-1-s micro-batches)."""
    from tessera.parallel.pipeline.cost_table import CostTable
    from tessera.parallel.pipeline.partition import partition
    from tessera.parallel.pipeline.schedules import build, recomputes

    with torch.device("meta"):
        graph = capture(_model(n_layers), mbs, SEQ)
    part = partition(graph, pp, m, schedule, recompute=(1.0,))
    table = CostTable(graph, DeviceRates())
    peak = 0.0
    for s, actions in enumerate(build(schedule, pp, m)):
        a, b = part.bounds[s], part.bounds[s + 1]
        full, kept_input = table.activations(a, b), table.segment_inputs(a, b)
        block = table.largest_block(a, b)
        keep = None if keep_all else part.keep[s]
        live = 0.0
        for act in actions:
            rc = recomputes(schedule, s, pp, act.mb, m, 1.0, keep)
            # A recomputing micro-batch keeps each block's input until its backward, which
            # rematerialises one block at a time.
            size = kept_input if rc else full
            live += size if act.kind == "F" else -size
            peak = max(peak, live + (block if act.kind == "B" and rc else 0.0))
    return peak


def timing_figures(quick: bool) -> None:
    pp, m, mbs, n_layers = 2, 8, 2, 8
    rounds = 2 if quick else 6
    before = load()
    budget = recompute_budget(pp, m, n_layers, mbs)
    results = run_distributed(_timing_worker, world_size=pp,
                              args=(n_layers, m, mbs, rounds, int(budget["budget"])),
                              timeout=900)
    best = results[0]["best"]
    saved = {name: max(r["saved_peak"][name] for r in results) / 2**20
             for name in results[0]["saved_peak"]}
    common = dict(pp=pp, micro_batches=m, mbs=mbs, seq=SEQ, model=f"small_{n_layers}_layers",
                  loadavg_before=before, loadavg_after=load(), cpu_cores=os.cpu_count())
    ideal = (m + pp - 1) / m * best["one_process"] / pp
    for name in ("gpipe", "1f1b"):
        emit(f"{name}_step_over_ideal", best[name] / ideal, "ratio",
             {"ideal_(m+p-1)/m*T1/p_s": round(ideal, 4), "measured_s": round(best[name], 4),
              "T1_one_process_s": round(best["one_process"], 4)}, **common)
    tokens = m * mbs * SEQ
    estimate = {"1f1b_recompute": peak_activation_bytes("1f1b", pp, m, n_layers, mbs),
                "scp_recompute": peak_activation_bytes("scp", pp, m, n_layers, mbs),
                "scp_keep_all": peak_activation_bytes("scp", pp, m, n_layers, mbs, True)}
    for name, target in (("scp_recompute", ">= 1.15"), ("scp_keep_all", None)):
        figure = ("scp_vs_1f1b_recompute_tokens_ratio" if name == "scp_recompute"
                  else "scp_keep_all_vs_1f1b_recompute_tokens_ratio")
        extra = {"target": target} if target else {}
        emit(figure, best["1f1b_recompute"] / best[name], "ratio",
             {"1f1b_full_recompute_tokens_per_s": round(tokens / best["1f1b_recompute"], 1),
              f"{name}_tokens_per_s": round(tokens / best[name], 1),
              "measured_saved_peak_MiB_1f1b": round(saved["1f1b_recompute"], 2),
              f"measured_saved_peak_MiB_{name}": round(saved[name], 2),
              "estimated_peak_activation_MiB_1f1b": round(estimate["1f1b_recompute"] / 2**20, 2),
              f"estimated_peak_activation_MiB_{name}": round(estimate[name] / 2**20, 2)},
             **extra, **common)
    budget_MiB = {k: round(v / 2**20, 2) for k, v in budget.items()}
    choice = results[0]["budget_choice"]
    for name, against, figure in (
            ("1f1b_recompute", "1F1B with full recomputation",
             "scp_at_budget_vs_1f1b_recompute_tokens_ratio"),
            ("1f1b_budget", "1F1B recomputing the least that fits the same budget",
             "scp_at_budget_vs_1f1b_at_budget_tokens_ratio")):
        emit(figure, best[name] / best["scp_budget"], "ratio",
             {"baseline": against,
              "baseline_tokens_per_s": round(tokens / best[name], 1),
              "scp_at_budget_tokens_per_s": round(tokens / best["scp_budget"], 1),
              "stage_budget_MiB": budget_MiB,
              "measured_saved_peak_MiB": {k: round(saved[k], 2) for k in
                                          (name, "scp_budget")},
              "per_stage_choice": {k: choice[k] for k in choice
                                   if k in (name, "scp_budget")}},
             **common)
    emit("tessera_vs_torch_1f1b_tokens_ratio", best["torch_1f1b"] / best["1f1b"], "ratio",
         {"torch_Schedule1F1B_tokens_per_s": round(tokens / best["torch_1f1b"], 1),
          "tessera_1f1b_tokens_per_s": round(tokens / best["1f1b"], 1)},
         target=">= 1.0", **common)


# --------------------------------------------------------------- sub-pipelined tensor par.
SUBPIPE = dict(tp=2, pp=2, m=4, mbs=4, n_layers=4)


def _race(sides: dict, batches, rounds: int) -> dict:
    """Each side's first-step loss and best step time over ``rounds``, sides alternating
    round by round."""
    losses = {name: float(e.forward_backward(batches).loss) for name, e in sides.items()}
    best = {name: float("inf") for name in sides}
    for _ in range(rounds):  # alternate, best round of each
        for name, engine in sides.items():
            best[name] = min(best[name], _timed(lambda e=engine: e.forward_backward(batches)))
    return {"best": best, "losses": losses}


def _subpipe_worker(rank, world, rounds):
    c = SUBPIPE
    base = f"dp=1,tp={c['tp']},pp={c['pp']},mbs={c['mbs']},gbs={c['mbs'] * c['m']}"
    batches = _batches(c["m"], c["mbs"])
    sides = {}
    for tail in ("", ",tp_seq=on"):  # Megatron's all-reduces, or its sequence collectives
        sides["plain" + tail] = _tessera(base + tail, c["n_layers"])[1]
        sides["subpipe" + tail] = _tessera(base + tail + ",tp_overlap=subpipe", c["n_layers"])[1]
    return _race(sides, batches, rounds)


def subpipe_figures(quick: bool) -> None:
    c, before = SUBPIPE, load()
    out = run_distributed(_subpipe_worker, world_size=c["tp"] * c["pp"],
                          args=(2 if quick else 6,), timeout=900)[0]
    best, after = out["best"], load()
    for tail, suffix in (("", ""), (",tp_seq=on", "_tp_seq")):
        plain, sub = "plain" + tail, "subpipe" + tail
        emit(f"subpipe_vs_plain_tp_step_ratio{suffix}", best[plain] / best[sub], "ratio",
             {"plain_step_s": round(best[plain], 4), "subpipe_step_s": round(best[sub], 4),
              "first_step_loss_plain": round(out["losses"][plain], 6),
              "first_step_loss_subpipe": round(out["losses"][sub], 6)},
             target="> 1.0", **c, seq=SEQ, model=f"small_{c['n_layers']}_layers",
             loadavg_before=before, loadavg_after=after, cpu_cores=os.cpu_count())


LEAVES = dict(pp=2, m=4, mbs=4, n_layers=4, leaves="blocks.*")


def _leaves_worker(rank, world, rounds):
    c = LEAVES
    text = f"dp=1,pp={c['pp']},mbs={c['mbs']},gbs={c['mbs'] * c['m']}"
    batches = _batches(c["m"], c["mbs"])
    sides = {"captured": _tessera(text, c["n_layers"])[1],
             "leaves": _tessera(text, c["n_layers"], leaves=[c["leaves"]])[1]}
    return _race(sides, batches, rounds)


def leaves_figures(quick: bool) -> None:
    """What running blocks eagerly as leaf modules (the way out for models torch.export
    cannot capture) costs against the same blocks captured, at pp=2."""
    c, before = LEAVES, load()
    out = run_distributed(_leaves_worker, world_size=c["pp"], args=(2 if quick else 6,),
                          timeout=900)[0]
    best = out["best"]
    emit("leaf_blocks_vs_captured_step_ratio", best["captured"] / best["leaves"], "ratio",
         {"captured_step_s": round(best["captured"], 4),
          "leaves_step_s": round(best["leaves"], 4),
          "first_step_loss_captured": round(out["losses"]["captured"], 6),
          "first_step_loss_leaves": round(out["losses"]["leaves"], 6)},
         target="about 1.0 (overhead only)", **c, seq=SEQ,
         model=f"small_{c['n_layers']}_layers", loadavg_before=before,
         loadavg_after=load(), cpu_cores=os.cpu_count())


DP_OVERLAP = dict(dp=2, pp=2, m=4, mbs=2, n_layers=8)


def _dp_overlap_worker(rank, world, rounds):
    c = DP_OVERLAP
    text = f"dp={c['dp']},pp={c['pp']},mbs={c['mbs']},gbs={c['dp'] * c['mbs'] * c['m']}"
    batches = _batches(c["m"], c["mbs"])
    sides = {name: _tessera(text, c["n_layers"])
             for name in ("overlap", "overlap_4MiB_buckets", "after_drain")}
    sides["after_drain"][0].pipeline.grad_sync.overlap = False
    sides["overlap_4MiB_buckets"][0].pipeline.grad_sync.bucket_bytes = (2**20, 4 * 2**20)
    in_sync = {name: [] for name in sides}
    for name, (plan, _) in sides.items():  # time what the step spends in the final sync
        sync = plan.pipeline.grad_sync
        sync.sync = _clocked(sync.sync, in_sync[name])
    for _, engine in sides.values():  # warm-up: capture; the first step counts gradients
        engine.forward_backward(batches), engine.forward_backward(batches)
    best = {name: float("inf") for name in sides}
    for _ in range(rounds):  # alternate, best round of each
        for name, (_, engine) in sides.items():
            best[name] = min(best[name], _timed(lambda e=engine: e.forward_backward(batches)))
    plan = sides["overlap"][0]
    grad_bytes = sum(_local(p).numel() * _local(p).element_size()
                     for p in plan.module.parameters())
    return {"best": best, "sync_s": {name: min(t[2:]) for name, t in in_sync.items()},
            "buckets_in_backward": {name: p.pipeline.grad_sync.buckets_launched_in_backward
                                    for name, (p, _) in sides.items()},
            "grad_MiB": grad_bytes / 2**20}


def _clocked(fn, times: list[float]):
    def run(*args, **kwargs):
        start = time.perf_counter()
        fn(*args, **kwargs)
        times.append(time.perf_counter() - start)
    return run


def dp_overlap_figures(quick: bool) -> None:
    c, before = DP_OVERLAP, load()
    out = run_distributed(_dp_overlap_worker, world_size=c["dp"] * c["pp"],
                          args=(2 if quick else 6,), timeout=900)
    best = out[0]["best"]
    sync = {name: max(r["sync_s"][name] for r in out) for name in best}
    common = dict(**c, seq=SEQ, model=f"small_{c['n_layers']}_layers", loadavg_before=before,
                  loadavg_after=load(), cpu_cores=os.cpu_count(),
                  grad_MiB_per_rank=[round(r["grad_MiB"], 2) for r in out])
    for side, suffix in (("overlap", ""), ("overlap_4MiB_buckets", "_4MiB_buckets")):
        emit(f"dp_overlap{suffix}_vs_after_drain_step_ratio",
             best["after_drain"] / best[side], "ratio",
             {"after_drain_step_s": round(best["after_drain"], 4),
              f"{side}_step_s": round(best[side], 4),
              "sync_after_drain_s_max_rank": round(sync["after_drain"], 4),
              f"sync_{side}_s_max_rank": round(sync[side], 4),
              "buckets_launched_in_backward": [r["buckets_in_backward"][side] for r in out]},
             target="> 1.0", **common)


MATERIALIZE = dict(preset="gpt2-medium", ranks=4,
                   layouts={"": "pp=4,mbs=1,gbs=4,schedule=1f1b", "_tp4": "tp=4,mbs=1,gbs=1",
                            "_tp2_pp2": "tp=2,pp=2,mbs=1,gbs=2,schedule=1f1b"},
                   # tensor parallelism splits the vocabulary: GPT-2's padded to 64 x 786
                   tp_vocab=50304)


def _materialize_worker(rank, world, root, on_meta, strategy):
    import resource

    from tessera.testing import tiny_trainer

    model = {"preset": MATERIALIZE["preset"], "max_seq_len": 32, "on_meta": on_meta}
    if "tp=" in strategy:
        model["vocab_size"] = MATERIALIZE["tp_vocab"]
    trainer = tiny_trainer(f"{root}/{on_meta}", strategy, steps=1, model=model)
    params = [_local(p) for p in trainer.model.parameters()]
    # weights held only as rows (pipeline/rows.py; absent before it, for comparisons)
    rows = getattr(trainer.plan.pipeline, "rows", None)
    row_tensors = list(rows.rows.values()) if rows is not None else []
    held = sum(_nbytes(p) for p in params + row_tensors if not p.is_meta)
    # the single-device model's bytes (a DTensor's numel is its global one)
    whole_model = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    # ru_maxrss: KiB on Linux; the process's peak, torch's own import included
    peak_built = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    trainer.train()  # one step: AdamW states exist (the Trainer frees gradients after it)
    moments = [t for state in trainer.optimizer.state.values() for t in state.values()
               if isinstance(t, torch.Tensor)]
    return {"held": held, "whole_model": whole_model, "peak_rss": peak_built,
            "state_after_step": held + sum(map(_nbytes, moments))}


def _nbytes(tensor: torch.Tensor) -> int:
    return _local(tensor).numel() * tensor.element_size()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (tensor parallelism); a plain tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def materialize_figures() -> None:
    """Per-rank weights and peak memory once the Trainer is built, for a model given on the
    meta device (each rank materialises its share) against the same model given on the device
    (each rank builds all of it before keeping its share): pp=4, then tp=4."""
    for suffix, strategy in MATERIALIZE["layouts"].items():
        _materialize_layout(suffix, strategy)


def _materialize_layout(suffix: str, strategy: str) -> None:
    import tempfile

    before, ranks = load(), MATERIALIZE["ranks"]
    with tempfile.TemporaryDirectory() as root:
        runs = {side: run_distributed(_materialize_worker, world_size=ranks,
                                      args=(root, side == "on_meta", strategy), timeout=900)
                for side in ("on_device", "on_meta")}
    held = {side: max(r["held"] for r in out) for side, out in runs.items()}
    rss = {side: max(r["peak_rss"] for r in out) for side, out in runs.items()}
    whole = runs["on_device"][0]["whole_model"]
    common = dict(strategy=strategy, model=MATERIALIZE["preset"], loadavg_before=before,
                  loadavg_after=load(), cpu_cores=os.cpu_count())
    emit(f"materialized_param_bytes_max_rank_over_whole{suffix}", held["on_meta"] / whole,
         "ratio", "the same model given on the device: every rank materialises all of it (1.0)",
         whole_MiB=round(whole / 2**20, 1),
         per_rank_MiB=[round(r["held"] / 2**20, 1) for r in runs["on_meta"]], **common)
    if not suffix:
        state = [r["state_after_step"] for r in runs["on_meta"]]
        emit("training_state_bytes_max_rank_over_whole", max(state) / (3 * whole), "ratio",
             "weights + AdamW moments after one step, largest rank, over one device's 3x the "
             "model", per_rank_MiB=[round(b / 2**20, 1) for b in state], **common)
    emit(f"peak_rss_on_meta_over_on_device{suffix}", rss["on_meta"] / rss["on_device"],
         "ratio", "peak resident memory of the largest rank once the Trainer is built",
         on_meta_MiB=round(rss["on_meta"] / 2**20, 1),
         on_device_MiB=round(rss["on_device"] / 2**20, 1), **common)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (under 3 minutes)")
    parser.add_argument("--only", choices=("balance", "timing", "subpipe", "dp_overlap",
                                           "materialize", "leaves"),
                        help="run one group of figures")
    args = parser.parse_args()
    torch.set_num_threads(1)
    groups = {"balance": balance_figures, "timing": lambda: timing_figures(args.quick),
              "subpipe": lambda: subpipe_figures(args.quick),
              "dp_overlap": lambda: dp_overlap_figures(args.quick),
              "materialize": materialize_figures,
              "leaves": lambda: leaves_figures(args.quick)}
    for name, run in groups.items():
        if args.only in (None, name):
            run()


if __name__ == "__main__":
    main()
