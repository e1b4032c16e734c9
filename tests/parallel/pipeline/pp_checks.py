"""Multi-rank pipeline checks, run by run_distributed from test_pipeline_parity.py.

Each check compares a pipeline run with a single-device run of the same model, micro-batches
and optimizer, computed in the same process (the reference needs no communication). Returned
values are plain numbers so the test process asserts them.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from tessera.mesh import Mesh
from tessera.models import Transformer
from tessera.models.config import preset
from tessera.models.hf import build_hf_model, hf_config_from_reference
from tessera.models.materialize import DeferredInit, has_meta, materialize
from tessera.parallel import parallelize
from tessera.parallel.pipeline import PipelineEngine
from tessera.parallel.pipeline.cost import DeviceRates
from tessera.parallel.pipeline.cost_table import CostTable, candidate_cuts
from tessera.parallel.plan import Parallelized
from tessera.strategy import Strategy
from tessera.train.engine import Engine
from tessera.train.optim import build_optimizer

STEPS = 3
# SEQ is the tiny presets' max_seq_len: the partitioning capture then has the run's shape and
# is reused (one torch.export per run instead of two).
MBS, SEQ = 2, 64


# "<arch>-bigvocab": a 4096-token vocabulary, so the LM head outweighs a stage and the
# partitioner slices it over the vocabulary across the last stages (pipeline/head.py).
BIG_VOCAB = 4096


def _hf_config(model_type: str, **fields):
    import transformers

    def make(n_layers: int, vocab: int):
        return transformers.AutoConfig.for_model(
            model_type, vocab_size=vocab, num_hidden_layers=n_layers, hidden_size=32,
            num_attention_heads=4, max_position_embeddings=SEQ, use_cache=False,
            bos_token_id=None, eos_token_id=None, pad_token_id=None, **fields)
    return make


# Architectures with no planner config reader (and Qwen2 no tensor-parallel policy of its
# own): the pipeline needs nothing from them but a torch.export capture. Phi runs attention
# and the MLP in parallel off one norm, with partial rotary and a biased LM head; Qwen2 has
# grouped key/value heads and biases on q/k/v only.
OTHER_HF = {
    "phi": _hf_config("phi", intermediate_size=64, resid_pdrop=0.0, embd_pdrop=0.0,
                      attention_dropout=0.0),
    "qwen2": _hf_config("qwen2", intermediate_size=64, num_key_value_heads=2),
}


# Classes with tensor-parallel policies of their own norms (parallel/tensor/policy.py), for
# tp x pp: Gemma 3's q/k norms share one weight over the heads (its gradient summed over the
# tp ranks inside the captured stages), Cohere's hold one per head (split by heads).
POLICY_HF = {
    "gemma3_text": _hf_config("gemma3_text", intermediate_size=64, num_key_value_heads=2,
                              head_dim=8),
    "cohere_qk": _hf_config("cohere", intermediate_size=64, num_key_value_heads=2,
                            use_qk_norm=True, logit_scale=1.0),
}


def split_arch(arch: str) -> tuple[str, int]:
    """"gpt2-bigvocab" -> ("gpt2", 4096); plain names keep the tiny presets' 256 tokens."""
    base, _, variant = arch.removesuffix("-meta").partition("-")
    return base, BIG_VOCAB if variant == "bigvocab" else 256


def make_model(arch: str, n_layers: int = 4) -> torch.nn.Module:
    """The model of ``arch``; "<arch>-meta" builds it on the meta device (materialised by
    ``materialize`` / ``DeferredInit`` with seed 0)."""
    torch.manual_seed(0)
    if arch.endswith("-meta"):
        with torch.device("meta"):
            return make_model(arch.removesuffix("-meta"), n_layers)
    arch, vocab = split_arch(arch)
    if arch in OTHER_HF or arch in POLICY_HF:
        import transformers

        make = OTHER_HF.get(arch) or POLICY_HF[arch]
        return transformers.AutoModelForCausalLM.from_config(make(n_layers, vocab))
    if arch == "ref":
        return Transformer(preset("tiny", n_layers=n_layers, vocab_size=vocab))
    base = preset("tiny-llama" if arch == "llama" else "tiny", n_layers=n_layers,
                  vocab_size=vocab)
    return build_hf_model(arch, **hf_config_from_reference(arch, base))


def micro_batches(step: int, count: int, vocab: int = 256) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + step)
    return [{"input_ids": torch.randint(0, vocab, (MBS, SEQ), generator=g),
             "labels": torch.randint(0, vocab, (MBS, SEQ), generator=g)} for _ in range(count)]


def _optimizer(module: torch.nn.Module) -> torch.optim.Optimizer:
    return build_optimizer(module, 1e-2, 0.1, (0.9, 0.95), 1e-8, torch.device("cpu"))


def parity(arch: str, text: str) -> dict[str, float]:
    """Max |loss| and |grad| differences over STEPS AdamW steps, pipeline vs one device.

    Every dp rank gets the same micro-batches, so the dp average equals the single-device
    gradient and the comparison needs no gathering.
    """
    strategy = Strategy.parse(text)
    n = strategy.grad_accum_steps
    ref, model = make_model(arch), make_model(arch)
    deferred = DeferredInit(torch.device("cpu"), seed=0)
    if has_meta(ref):  # one device materialises all of it, each stage its own share
        materialize(ref, "cpu", seed=0)
    ref_engine = Engine(Parallelized(ref, ref, None), Strategy(), torch.device("cpu"))
    ref_opt = _optimizer(ref)
    plan = parallelize(model, strategy, Mesh(strategy, "cpu"), deferred=deferred)
    on_meta = sum(p.numel() for p in model.parameters() if p.is_meta)
    engine = PipelineEngine(plan, strategy, torch.device("cpu"))
    opt = plan.build_optimizer(model, 1e-2, 0.1, (0.9, 0.95), 1e-8, torch.device("cpu"))
    loss_diff = grad_diff = 0.0
    for step in range(STEPS):
        batches = micro_batches(step, n, split_arch(arch)[1])
        want, got = ref_engine.forward_backward(batches), engine.forward_backward(batches)
        loss_diff = max(loss_diff, abs(float(want.loss) - float(got.loss)))
        ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0))
        norm = float(plan.clip_grad_norm(model, 1.0))
        grad_diff = max(grad_diff, abs(ref_norm - norm), _grad_diff(plan.module, ref))
        ref_opt.step(), opt.step()
        ref_opt.zero_grad(), opt.zero_grad()
    if plan.pipeline.program.graph.head_slices > 1:  # the sliced head's eval-mode graph too
        batch = micro_batches(STEPS, 1, split_arch(arch)[1])[0]
        ref.eval(), model.eval()
        eval_diff = abs(float(ref_engine.evaluate(batch)) - float(engine.evaluate(batch)))
        loss_diff = max(loss_diff, eval_diff)
    return {"loss": loss_diff, "grad": grad_diff, "loss_value": float(got.loss),
            "keys": sorted(plan.module.state_dict()), **_layout(plan),
            "timeline": [(k, s, m) for k, s, m, _ in engine.timeline.events],
            "keep": list(plan.pipeline.partition.keep),
            "params_left_on_meta": on_meta}


def estimate_against_saved(arch: str, layout: str = "pp=2",
                           precisions: tuple[str, ...] = ("fp32", "bf16")
                           ) -> dict[str, tuple[float, float]]:
    """The partition's activation estimate for this rank's stage against the peak of what
    autograd saves there during a 1F1B step (two micro-batches in flight on stage 0, no
    recomputation): (estimated, measured) bytes by precision. ``layout`` gives the pp (and
    dp, tp, sp) degrees; each dp rank runs 4 micro-batches."""
    from tessera.memory.saved_peak import SavedPeak

    out, m = {}, 4
    dp = int(dict(field.split("=") for field in layout.split(",")).get("dp", 1))
    for precision in precisions:
        strategy = Strategy.parse(f"{layout},mbs={MBS},gbs={m * MBS * dp},schedule=1f1b,"
                                  f"precision={precision}")
        model = make_model(arch)
        # At the run's length, as the Trainer partitions (each rank's share of it under sp).
        plan = parallelize(model, strategy, Mesh(strategy, "cpu"), seq_len=SEQ)
        engine = PipelineEngine(plan, strategy, torch.device("cpu"))
        batches = micro_batches(0, m, split_arch(arch)[1])
        engine.forward_backward(batches)  # builds the stages
        probe = SavedPeak(model.parameters())
        with probe:
            engine.forward_backward(batches)
        out[precision] = (stage_activation_estimate(plan, strategy, m), float(probe.peak))
    return out


def stage_activation_estimate(plan: Parallelized, strategy: Strategy, m: int) -> float:
    """The partition's estimate of the bytes this rank's stage keeps for backward at the
    peak of a 1F1B step of ``m`` micro-batches, recomputing nothing (sub-pipelined: both
    halves of each micro-batch, from the graph of one)."""
    from tessera.parallel.pipeline import priced_under
    from tessera.parallel.pipeline.partition import in_flight

    pipe = plan.pipeline
    stage, part = pipe.local_stages[0], pipe.partition
    table = CostTable(priced_under(pipe.program.graph, strategy, "cpu"), DeviceRates(),
                      pipe.program.sub_batches)
    a, b = part.bounds[stage], part.bounds[stage + 1]
    held = in_flight(stage, pipe.n_stages, m, "1f1b")
    return table.memory(a, b, 0.0, held, stage == pipe.n_stages - 1) - table.state_bytes(a, b)


def _layout(plan: Parallelized) -> dict[str, int]:
    """Vocabulary slices of the LM head, over how many stages they were placed, and how many
    stage boundaries fall inside attention or an MLP."""
    pipe = plan.pipeline
    graph = pipe.program.graph
    stage_of = pipe.partition.stage_of(graph)
    slices = [n for n in graph.compute if "logsumexp" in str(graph.nodes[n].node.target)]
    coarse = set(candidate_cuts(CostTable(graph, DeviceRates())))
    rows = pipe.rows.rows if pipe.rows is not None else {}
    return {"head_slices": graph.head_slices,
            "head_stages": len({stage_of[n] for n in slices}),
            # weights this rank holds only as rows (pipeline/rows.py): name -> rows held
            "rows_held": {name: tuple(t.shape) for name, t in rows.items()},
            # cuts inside attention or the MLP (partition's ``finer`` search)
            "finer_cuts": sum(c not in coarse for c in pipe.partition.bounds[1:-1])}


def _grad_diff(stage: torch.nn.Module, ref: torch.nn.Module) -> float:
    worst = 0.0
    for name, param in stage.named_parameters():
        assert param.grad is not None, f"{name} got no gradient"
        worst = max(worst, (param.grad - ref.get_parameter(name).grad).abs().max().item())
    return worst


def checkpoint_round_trip(root: str) -> dict[str, list[float]]:
    """pp=2 trains 3 steps and saves; pp=2 and pp=1 (dp=2) each resume and run step 4; a
    dp=2 run's step-3 checkpoint resumes at pp=2 too.

    The model's vocabulary is BIG_VOCAB, so at pp=2 its LM head is sliced over both stages
    and the second stage holds only its rows of the tied weight (pipeline/rows.py): the
    checkpoint has the weight from the first stage, and the resumed run refreshes the rows."""
    from tessera.run import build_datasets, build_model, build_tokenizer
    from tessera.testing import tiny_run_config
    from tessera.train.trainer import Trainer

    def train(out: Path, strategy: str, until=None, resume=False):
        config = tiny_run_config(out, strategy, train={"max_steps": 4, "resume": resume,
                                                               "eval_steps": 4, "eval_batches": 1},
                                 model={"preset": "tiny", "n_layers": 4,
                                        "vocab_size": BIG_VOCAB})
        tokenizer = build_tokenizer(config)
        train_ds, val_ds = build_datasets(config, tokenizer)
        trainer = Trainer(build_model(config), config.train, train_ds, val_ds,
                          strategy=config.strategy)
        return trainer.train(until_step=until), trainer

    root = Path(root)
    torch.distributed.barrier()
    first, _ = train(root / "pp2", "dp=1,tp=1,pp=2,mbs=2,gbs=8", until=3)
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        shutil.copytree(root / "pp2", root / "pp1")
    torch.distributed.barrier()
    on_pp2, resumed = train(root / "pp2", "dp=1,tp=1,pp=2,mbs=2,gbs=8", resume=True)
    rows = resumed.plan.pipeline.rows
    on_pp1, trainer = train(root / "pp1", "dp=2,tp=1,pp=1,mbs=2,gbs=8", resume=True)
    fresh, _ = train(root / "dp2", "dp=2,tp=1,pp=1,mbs=2,gbs=8", until=3)
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:  # and the other way: a pp=1 checkpoint at pp=2
        shutil.copytree(root / "dp2", root / "dp2_to_pp2")
    torch.distributed.barrier()
    from_pp1, _ = train(root / "dp2_to_pp2", "dp=1,tp=1,pp=2,mbs=2,gbs=8", resume=True)
    return {"pp2_first": first.losses, "pp2_step4": on_pp2.losses, "pp1_step4": on_pp1.losses,
            "pp2_step4_from_pp1": from_pp1.losses,
            "dp2_first": fresh.losses, "eval_pp2": [l for _, l in on_pp2.eval_losses],
            "rows_held": [] if rows is None else [tuple(t.shape) for t in rows.rows.values()]}


def meta_trainer_round_trip(root: str) -> dict:
    """The Trainer given a meta-device model at pp=2 with chunk memory and ``init_from``: each
    rank materialises and loads only its stages' weights; the run equals the one given the
    model already on the device, and save_model writes the same whole model."""
    from safetensors.torch import load_file

    from tessera.testing import tiny_trainer
    from tessera.train.export import REFERENCE_WEIGHTS, save_full_model

    root, strategy = Path(root), "pp=2,mbs=2,gbs=8,schedule=1f1b,memory=chunk"
    model_section = {"n_layers": 4}
    source = tiny_trainer(root / "source", "pp=2,mbs=2,gbs=8", steps=2, model=model_section)
    source.train()
    save_full_model(source, root / "weights")
    runs, left_on_meta = {}, 0
    for name, on_meta in (("on_device", False), ("on_meta", True)):
        trainer = tiny_trainer(root / name, strategy, steps=3,
                               model={**model_section, "on_meta": on_meta},
                               train={"init_from": str(root / "weights")})
        left_on_meta = left_on_meta or sum(p.numel() for p in trainer.model.parameters()
                                           if p.is_meta)
        runs[name] = trainer.train().losses
        # eval mode is captured anew: on meta stand-ins for the materialised share
        runs[f"{name}_eval"] = [trainer.evaluate()]
        save_full_model(trainer, root / f"saved_{name}")
    runs.update(_whole_model_on_meta(root, model_section))
    # HF GPT-2 on meta: rank 0 writes save_pretrained while holding only its stages.
    hf = tiny_trainer(root / "hf", "pp=2,mbs=2,gbs=8", steps=1,
                      model={**model_section, "hf": "gpt2", "on_meta": True})
    hf.train()
    save_full_model(hf, root / "saved_hf")
    saved = {}
    if torch.distributed.get_rank() == 0:
        a, b = (load_file(str(root / f"saved_{n}" / REFERENCE_WEIGHTS))
                for n in ("on_device", "on_meta"))
        whole = set(source.model.state_dict()) - {"lm_head.weight"}  # tied: stored once
        reloaded = _reload_hf(root / "saved_hf")
        saved = {"keys_equal": sorted(a) == sorted(b), "complete": set(a) == whole,
                 "max_diff": max((a[k] - b[k]).abs().max().item() for k in a),
                 "hf_reloaded_params": reloaded,
                 "hf_params": sum(p.numel() for p in hf.model.parameters())}
    return {**runs, "params_left_on_meta": left_on_meta, "saved": saved,
            "total_params": sum(p.numel() for p in source.model.parameters())}


def _reload_hf(folder: Path) -> int:
    """Parameters of the GPT-2 saved in ``folder``, reloaded by from_pretrained; -1 when
    some are not finite."""
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(folder)
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    return sum(p.numel() for p in model.parameters()) if finite else -1


def _whole_model_on_meta(root: Path, model_section: dict) -> dict[str, list[float]]:
    """Without pipeline stages (dp=2) the Trainer materialises the whole meta model first:
    the same run as a model materialised (same seed) before it is handed over."""
    from tessera.run import build_datasets, build_model, build_tokenizer
    from tessera.testing import tiny_run_config
    from tessera.train.trainer import Trainer

    runs = {}
    for name in ("dp_on_meta", "dp_materialised_first"):
        config = tiny_run_config(root / name, "dp=2,mbs=2,gbs=8", train={"max_steps": 2},
                                 model={**model_section, "on_meta": True})
        train_ds, val_ds = build_datasets(config, build_tokenizer(config))
        model = build_model(config)
        if name == "dp_materialised_first":
            materialize(model, "cpu", seed=config.train.seed)
        trainer = Trainer(model, config.train, train_ds, val_ds, strategy=config.strategy)
        runs[name] = trainer.train().losses
    return runs


def budget_trainer(root: str) -> dict:
    """The Trainer with ``train.stage_memory_budget`` at pp=2 (1f1b, 4 micro-batches): a
    budget halfway between the fullest stage's estimate without and with full recomputation
    has the stages choose their ratios; the run equals one given those ratios as the
    strategy's. A budget under the full-recomputation need is refused, naming it."""
    from tessera.parallel.pipeline.partition import partition as split
    from tessera.parallel.pipeline.program import capture_for_partition
    from tessera.strategy import StrategyError
    from tessera.testing import tiny_trainer

    root, text = Path(root), "pp=2,mbs=2,gbs=8,schedule=1f1b"
    section = {"model": {"n_layers": 4}}
    probe = tiny_trainer(root / "probe", text, steps=1, **section)
    graph = capture_for_partition(probe.model, 2, seq_len=probe._seq_len())
    need = {r: max(split(graph, 2, 4, "1f1b", recompute=(r,)).stage_memory) for r in (0.0, 1.0)}
    budget = int((need[0.0] + need[1.0]) / 2)
    chosen = tiny_trainer(root / "budget", text, steps=3,
                          train={"stage_memory_budget": budget}, **section)
    ratios = chosen.stage_recompute
    given = tiny_trainer(root / "given", f"{text},recompute={'/'.join(map(str, ratios))}",
                         steps=3, **section)
    try:
        tiny_trainer(root / "small", text, steps=1,
                     train={"stage_memory_budget": int(need[1.0] * 0.5)}, **section)
        refused = ""
    except StrategyError as err:
        refused = str(err)
    losses = given.train().losses
    # Without a budget too, the partition was made at the run's shape, and training ran that
    # capture's stages.
    program, shape = given.plan.pipeline.program, (2, given._seq_len())
    seed = program.graph
    return {"need": need, "budget": budget, "ratios": ratios,
            "chosen": chosen.train().losses, "given": losses, "refused": refused,
            "partition_shape": tuple(seed.nodes[seed.inputs[0]].node.meta["val"].shape),
            "run_shape": shape, "reused": program.get(shape, training=True).graph is seed}
