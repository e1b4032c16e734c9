"""The Hugging Face-style Trainer: same loss as the HF model, callbacks, epochs, save_model."""

import inspect
import json
import math
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback

from tessera import Trainer, TrainingArguments
from tessera.parallel.pipeline.whole import PartialModelError
from tessera.strategy import Strategy, StrategyError
from tessera.testing import run_distributed
from tessera.train.hf_data import shift_for_next_token

ROOT = Path(__file__).resolve().parents[1]


def _tiny_gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=2,
                                      n_head=2, use_cache=False, bos_token_id=None,
                                      eos_token_id=None))


def test_shift_gives_the_loss_hugging_face_computes():
    model = _tiny_gpt2().eval()  # no dropout: both paths see the same network
    ids = torch.randint(0, 256, (3, 16))
    mask = torch.ones_like(ids)
    mask[0, 12:] = 0  # padding on one row
    labels = ids.masked_fill(mask == 0, -100)
    expected = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    batch = shift_for_next_token({"input_ids": ids, "attention_mask": mask})
    logits = model(batch["input_ids"]).logits
    got = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(),
                                            ignore_index=-100)
    # Causal attention: dropping the last input token leaves earlier logits unchanged, and a
    # padded row's masked positions carry no loss either way.
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step, self.seen = step, []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.seen.append(logs["step"])
        if state.global_step >= self.step:
            control.should_training_stop = True


def _script_and_callbacks(rank, world_size, root):
    import importlib.util

    spec = importlib.util.spec_from_file_location("script", ROOT / "examples/hf_gpt2_trainer.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    metrics = script.main(f"{root}/script", max_steps=20)

    data = script.ByteChunks(length=32)
    stopper = StopAt(3)
    trainer = Trainer(model=_tiny_gpt2(), args=TrainingArguments(
        output_dir=f"{root}/stopped", per_device_train_batch_size=4, num_train_epochs=2,
        logging_steps=1, learning_rate=1e-3, save_strategy="no"), train_dataset=data,
        callbacks=[Recorder])
    trainer.add_callback(stopper)
    removed = trainer.pop_callback(Recorder)  # a class: the first of it, returned
    try:
        trainer.remove_callback(Recorder())  # an instance it does not hold
        refused = None
    except ValueError as err:
        refused = str(err)
    epochs_steps = trainer.state.max_steps
    result = trainer.train()
    return {"metrics": metrics, "losses": result.losses, "stopped_at": result.step,
            "seen": stopper.seen, "epoch_steps": epochs_steps, "n": len(data),
            "removed": (type(removed).__name__, len(removed.events)), "refused": refused,
            **_meta_model_at_pp2(root, data), **_argument_mapping(root, data)}


class Recorder(TrainerCallback):
    """Passed as a class: the Trainer instantiates it, as Hugging Face does."""

    def __init__(self):
        self.events = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        # What Hugging Face's CallbackHandler passes with every event besides the logs.
        passed = {k: type(v).__name__ for k, v in kwargs.items()}
        self.events.append(("log", dict(logs), passed))

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.events.append(("evaluate", dict(metrics)))

    def on_save(self, args, state, control, **kwargs):
        self.events.append(("save", state.global_step, state.epoch))


class Processor:
    """What save_model needs of a processing_class (a tokenizer): save_pretrained(folder)."""

    def save_pretrained(self, folder):
        (Path(folder) / "processor.txt").write_text("saved")


def _argument_mapping(root, data) -> dict:
    """save_total_limit, save_strategy="no", report_to, on_save / on_log / on_evaluate, and
    evaluation over the whole set, each sample once, at per_device_eval_batch_size."""
    # 10 samples in micro-batches of 2 on 2 ranks: global batches 4 + 4 + 2, so one rank's
    # last micro-batch is fill only.
    evaluation = torch.utils.data.Subset(data, range(10))
    trainer = Trainer(model=_tiny_gpt2(), args=TrainingArguments(
        output_dir=f"{root}/mapped", per_device_train_batch_size=4, max_steps=4,
        logging_steps=1, save_steps=1, save_total_limit=2, eval_strategy="steps",
        eval_steps=2, learning_rate=1e-3, per_device_eval_batch_size=2), train_dataset=data,
        eval_dataset=evaluation,
        callbacks=[Recorder])
    trainer.train()
    evaluated = trainer.evaluate()["eval_loss"]
    # Other sets, as Hugging Face's evaluate takes them: a dict, each under its own prefix.
    other = torch.utils.data.Subset(data, range(10, 16))
    named = trainer.evaluate(eval_dataset={"same": evaluation, "other": other},
                             metric_key_prefix="test")
    # Resumed at step 4 (the newest kept checkpoint) and run to 6: the metrics count 2 steps.
    resumed = Trainer(model=_tiny_gpt2(), args=TrainingArguments(
        output_dir=f"{root}/mapped", per_device_train_batch_size=4, max_steps=6,
        save_strategy="no", learning_rate=1e-3), train_dataset=data,
        compute_metrics=None, preprocess_logits_for_metrics=None, optimizers=(None, None))
    step, loss, resumed_metrics = resumed.train(resume_from_checkpoint=True)
    model = trainer._core.model.eval()  # DDP replicas: every rank holds the trained weights
    with torch.no_grad():
        per_sample = [torch.nn.functional.cross_entropy(
            model(s["input_ids"][None, :-1]).logits[0], s["input_ids"][1:]).item()
            for s in evaluation]
    # Evaluation only (run_clm.py's --do_eval alone): no train_dataset.
    untrained = _tiny_gpt2().eval()
    with torch.no_grad():
        untrained_mean = sum(torch.nn.functional.cross_entropy(
            untrained(s["input_ids"][None, :-1]).logits[0], s["input_ids"][1:]).item()
            for s in evaluation) / len(evaluation)
    only_eval = Trainer(model=_tiny_gpt2(), args=TrainingArguments(
        output_dir=f"{root}/only_eval", per_device_eval_batch_size=2), eval_dataset=evaluation)
    only_eval_loss = only_eval.evaluate()["eval_loss"]
    try:
        only_eval.train()
        train_refused = None
    except ValueError as err:
        train_refused = str(err)
    unsaved = Trainer(model=_tiny_gpt2(), args=TrainingArguments(
        output_dir=f"{root}/unsaved", per_device_train_batch_size=4, max_steps=2,
        save_strategy="no", report_to="jsonl", average_tokens_across_devices=False,
        eval_strategy="steps", eval_steps=2),
        train_dataset=data, processing_class=Processor(),
        eval_dataset={"a": evaluation, "b": other})  # named sets, evaluated in training too
    unsaved.train()
    unsaved.save_model(f"{root}/unsaved_model")
    records = [json.loads(line) for line in
               (Path(root) / "unsaved" / "metrics.jsonl").read_text().splitlines()]
    recorder = trainer._hf_callbacks[0]
    return {"kept": sorted(p.name for p in Path(f"{root}/mapped/checkpoints").glob("step_*")),
            "events": recorder.events, "evaluated": evaluated, "named": named,
            "other_direct": trainer.evaluate(other)["eval_loss"],
            "per_sample_mean": sum(per_sample) / len(per_sample),
            "tokens_across": [t._core.args.average_tokens_across_devices
                              for t in (trainer, unsaved)],
            "mapped_files": sorted(p.name for p in Path(f"{root}/mapped").iterdir()),
            "unsaved_files": sorted(p.name for p in Path(f"{root}/unsaved").iterdir()),
            "processor_saved": (Path(root) / "unsaved_model" / "processor.txt").exists(),
            "resumed": (step, loss, resumed_metrics),
            "named_in_training": [r for r in records if "eval_a_loss" in r],
            "named_after": (unsaved.evaluate(), unsaved.evaluate("b")),
            "only_eval": (only_eval_loss, untrained_mean, train_refused)}


def _meta_model_at_pp2(root, data) -> dict:
    """A GPT-2 built on the meta device, trained at pp=2: each rank materialises its share."""
    with torch.device("meta"):
        model = _tiny_gpt2()
    trainer = Trainer(model=model, args=TrainingArguments(
        output_dir=f"{root}/meta", per_device_train_batch_size=2, max_steps=2,
        logging_steps=1, save_strategy="no", strategy="pp=2,mbs=2,gbs=4,schedule=1f1b",
        stage_memory_budget="1GiB"), train_dataset=data)
    losses = trainer.train().losses
    trainer.save_model(f"{root}/meta_saved")
    try:  # the other stage's weights never existed on this rank: calling it is refused
        model(torch.zeros(1, 4, dtype=torch.long))
        meta_call = None
    except PartialModelError as err:
        meta_call = str(err)
    return {"meta_losses": losses, "stage_recompute": trainer._core.stage_recompute,
            "meta_left": sum(p.numel() for p in model.parameters() if p.is_meta),
            "meta_total": sum(p.numel() for p in model.parameters()), "meta_call": meta_call,
            **_whole_after_pp2(root, data)}


def _whole_after_pp2(root, data) -> dict:
    """A model on the device trained at pp=2 is left trained on every rank, as Hugging
    Face's Trainer leaves it (each rank's stages hold only their own weights)."""
    from safetensors.torch import load_file

    model = _tiny_gpt2()
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer = Trainer(model=model, args=TrainingArguments(
        output_dir=f"{root}/whole", per_device_train_batch_size=2, max_steps=2,
        learning_rate=1e-3, save_strategy="no", strategy="pp=2,mbs=2,gbs=4,schedule=1f1b"),
        train_dataset=data)
    trainer.train()
    trainer.save_model(f"{root}/whole_saved")
    saved = load_file(f"{root}/whole_saved/model.safetensors")
    params = dict(model.named_parameters())
    off = max((params[k].detach() - v).abs().max().item() for k, v in saved.items()
              if k in params)
    unchanged = sum(torch.equal(p.detach(), initial[k]) for k, p in params.items())
    worst = torch.tensor([off, float(unchanged)])
    torch.distributed.all_reduce(worst, op=torch.distributed.ReduceOp.MAX)  # over both ranks
    with torch.no_grad():
        model(torch.zeros(1, 4, dtype=torch.long))  # callable: no refusal
    return {"whole_off": worst[0].item(), "whole_unchanged": int(worst[1]),
            "whole_compared": sum(k in params for k in saved), "whole_keys": sorted(saved)}


@pytest.mark.slow
def test_hf_script_runs_on_two_workers(tmp_path):
    outs = run_distributed(_script_and_callbacks, world_size=2, args=(str(tmp_path),),
                           timeout=300)
    out = outs[0]
    # Every event on every rank, with the same losses, as Hugging Face fires them (rank 1
    # once saw no on_log, on_evaluate or on_save, and an empty log_history).
    assert _logged(outs[1]["events"]) == _logged(out["events"])
    assert [e for e in outs[1]["events"] if e[0] == "save"] == \
        [e for e in out["events"] if e[0] == "save"]
    assert out["metrics"]["eval_loss"] < 5.0  # trained from ~5.5 (uniform over 256 bytes)
    # Two epochs of n samples at 4 per worker x 2 workers.
    assert out["epoch_steps"] == 2 * (out["n"] // 8)
    # Added with add_callback; the last is train()'s closing entry (train_runtime, ...).
    assert out["stopped_at"] == 3 and out["seen"] == [1, 2, 3, 3]
    assert out["removed"] == ("Recorder", 0)  # popped before training: saw nothing
    assert "Recorder is not one of this Trainer's callbacks" in out["refused"]
    reloaded = GPT2LMHeadModel.from_pretrained(tmp_path / "script" / "final")
    assert reloaded.config.n_layer == 2
    _check_script_reports(tmp_path / "script", out["metrics"])
    # The meta-device model: each rank left the other stage's weights on meta, trained, and
    # save_model gathered the whole model.
    assert len(out["meta_losses"]) == 2 and all(4.0 < v < 7.0 for v in out["meta_losses"])
    assert 0 < out["meta_left"] < out["meta_total"]
    assert out["stage_recompute"] == [0.0, 0.0]  # a 1 GiB stage budget: nothing to recompute
    whole = GPT2LMHeadModel.from_pretrained(tmp_path / "meta_saved")
    assert sum(p.numel() for p in whole.parameters()) == out["meta_total"]
    assert "built on the meta device" in out["meta_call"] and "save_model" in out["meta_call"]
    # On the device: every weight trained on every rank and equal to what save_model wrote
    # (the same values copied, so exactly; before, each rank's other stage stayed initial).
    assert out["whole_compared"] > 10 and out["whole_unchanged"] == 0
    # GPT-2's tied head written once, as save_pretrained writes it from one device (gathered
    # from the stages the two names held two tensors, and both were written).
    assert "transformer.wte.weight" in out["whole_keys"]
    assert "lm_head.weight" not in out["whole_keys"]
    assert out["whole_off"] == 0.0
    _check_argument_mapping(out)


def _logged(events):
    return [(e[1].get("step"), e[1].get("loss"), e[1].get("eval_loss")) for e in events
            if e[0] == "log"]


def _check_script_reports(folder, eval_metrics):
    """What the script's log_metrics / save_metrics / save_state calls left, as Hugging
    Face's names them."""

    train = json.loads((folder / "train_results.json").read_text())
    assert set(train) == {"train_runtime", "train_samples_per_second",
                          "train_steps_per_second", "train_loss", "epoch"}
    assert 0 < train["train_loss"] < 6 and train["train_steps_per_second"] > 0
    # 20 steps of 16 samples: the rates agree with each other and the runtime.
    assert abs(train["train_samples_per_second"] / train["train_steps_per_second"] - 16) < 0.1
    evaluated = json.loads((folder / "eval_results.json").read_text())
    assert evaluated["perplexity"] == pytest.approx(math.exp(eval_metrics["eval_loss"]))
    assert json.loads((folder / "all_results.json").read_text()) == {**train, **evaluated}
    state = json.loads((folder / "trainer_state.json").read_text())
    assert state["global_step"] == state["max_steps"] == 20
    closing = state["log_history"][-1]  # train()'s closing log entry, as Hugging Face's
    assert closing["train_loss"] == train["train_loss"] and closing["step"] == 20
    logged = [r["loss"] for r in state["log_history"] if "loss" in r]
    assert len(logged) == 4  # logging_steps=5
    # train_loss is the mean over all 20 steps; the log holds 5-step means: their mean.
    assert train["train_loss"] == pytest.approx(sum(logged) / 4, rel=1e-6)
    # run_clm.py's last call: a model card with the logged losses, Hub metadata first
    card = (folder / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers\ntags:\n- tessera\nmodel-index:")
    assert "on bytes of this file" in card and f"| {logged[-1]:.4f} | " in card


def _check_argument_mapping(out):
    assert out["kept"] == ["step_00000003", "step_00000004"]  # save_total_limit=2
    only_eval, direct, refused = out["only_eval"]
    assert abs(only_eval - direct) < 1e-5  # fp32 sums in another order
    assert "training requires a train_dataset" in refused
    step, loss, metrics = out["resumed"]  # unpacked as Hugging Face's TrainOutput
    assert step == 6 and loss == metrics["train_loss"] and 0 < loss < 6
    # Two steps ran after the resume (not six): rate x runtime, to the rounding of both.
    ran = metrics["train_steps_per_second"] * metrics["train_runtime"]
    assert abs(ran - 2) < 0.05, metrics
    assert out["processor_saved"]  # save_model writes the processing_class beside the model
    assert out["tokens_across"] == [True, False]  # Hugging Face's default, and passed on
    saves = [e[1] for e in out["events"] if e[0] == "save"]
    assert saves == [1, 2, 3, 4]
    # The epoch at each save, not the last logging step's (a save need not fall on one).
    per_epoch = out["n"] // 8
    assert [e[2] for e in out["events"] if e[0] == "save"] == \
        pytest.approx([step / per_epoch for step in saves], abs=1e-4)
    passed = [e[2] for e in out["events"] if e[0] == "log"]
    assert all(p == {"model": "GPT2LMHeadModel", "processing_class": "NoneType",
                     "optimizer": p["optimizer"], "lr_scheduler": p["lr_scheduler"],
                     "train_dataloader": "NoneType", "eval_dataloader": "NoneType"}
               and p["optimizer"] != "NoneType" and p["lr_scheduler"] != "NoneType"
               for p in passed), passed[0]
    logs = [e[1] for e in out["events"] if e[0] == "log"]
    assert all("learning_rate" in r and "lr" not in r for r in logs if "loss" in r)
    # The rate each step trained at (linear decay over 4 steps, no warm-up), as Hugging Face
    # logs it: not the next step's.
    rates = [r["learning_rate"] for r in logs if "loss" in r]
    assert rates == pytest.approx([1e-3, 7.5e-4, 5e-4, 2.5e-4])
    # An evaluation is logged, then reported to on_evaluate (at steps 2 and 4, and the
    # explicit evaluate() calls after training: the Trainer's set, the two named ones, the
    # other set unnamed).
    kinds = [(e[0], any(k.endswith("_loss") and k != "train_loss" for k in e[1]))
             for e in out["events"] if e[0] != "save"]
    evals = [i for i, k in enumerate(kinds) if k == ("log", True)]
    assert len(evals) == 6 and all(kinds[i + 1] == ("evaluate", True) for i in evals)
    # The whole evaluation set, each sample once: the mean of the samples' own losses
    # (equal lengths; fp32 sums in another order, 1e-5 on losses near 5).
    assert abs(out["evaluated"] - out["per_sample_mean"]) < 1e-5
    # The same set under another name gives the same loss (the same sums); another set its own
    # (and the epoch, which Hugging Face's log adds to the metrics evaluate returns)
    speeds = ("runtime", "samples_per_second", "steps_per_second")
    assert set(out["named"]) == {"epoch"} | {f"test_{name}_{what}" for name in ("same", "other")
                                             for what in ("loss", *speeds)}
    # A dict eval_dataset during training: each set evaluated at the evaluation step, under
    # its own name, with its speed (Hugging Face's names); evaluate() after training gives
    # the same losses (the same weights), and a set's name picks it alone ("eval_loss").
    during = out["named_in_training"]
    assert [r["step"] for r in during] == [2] and "eval_b_loss" not in during[0]
    after, by_name = out["named_after"]
    assert after["eval_a_loss"] == pytest.approx(during[0]["eval_a_loss"], abs=1e-6)
    assert by_name["eval_loss"] == after["eval_b_loss"] != after["eval_a_loss"]
    assert all(after[f"eval_{name}_{what}"] > 0 for name in "ab" for what in speeds)
    assert out["named"]["test_same_loss"] == out["evaluated"]
    assert out["named"]["test_other_loss"] == out["other_direct"] != out["evaluated"]
    assert "metrics.jsonl" not in out["mapped_files"]  # report_to="none" (the default)
    assert out["unsaved_files"] == ["metrics.jsonl"]  # save_strategy="no": no checkpoint


def test_script_differs_from_its_hf_original_in_two_lines():
    import ast

    import transformers

    lines = (ROOT / "examples/hf_gpt2_trainer.py").read_text().splitlines()
    changed = [i for i, line in enumerate(lines) if "# CHANGED" in line]
    assert len(changed) == 2
    # Revert both: the import comes from transformers, the strategy argument goes.
    hf = list(lines)
    hf[changed[0]] = lines[changed[0]].replace("from tessera import",
                                               "from transformers import").split("  #")[0]
    assert hf[changed[1] - 1].endswith(",") and lines[changed[1]].strip().startswith("strategy=")
    hf[changed[1] - 1] = hf[changed[1] - 1][:-1] + ")"
    del hf[changed[1]]
    # What is left is a Hugging Face script: every keyword its TrainingArguments and Trainer
    # calls pass is one transformers' own classes take.
    tree = ast.parse("\n".join(hf))
    for call in ast.walk(tree):
        name = getattr(getattr(call, "func", None), "id", None)
        if isinstance(call, ast.Call) and name in ("TrainingArguments", "Trainer"):
            accepted = inspect.signature(getattr(transformers, name)).parameters
            assert {kw.arg for kw in call.keywords} <= set(accepted), name
    # ... and every Trainer method it calls (run_clm.py's train / log_metrics / save_metrics /
    # save_state / evaluate / save_model) is one transformers' Trainer has, and tessera's.
    called = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
              and getattr(node.value, "id", None) == "trainer"}
    assert {"log_metrics", "save_metrics", "save_state"} <= called
    assert called <= set(dir(transformers.Trainer)) & set(dir(Trainer)), called


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(report_to="wandb"), "other reporters"),
    (dict(per_device_train_batch_size=0), "must be >= 1"),
    (dict(dataloader_num_workers=4), "dataloader_num_workers: only 0 .what tessera does: "
                                     "tessera's loader reads samples in the training process"),
    (dict(optim="adafactor"), "optim: only 'adamw_torch' or 'adamw_torch_fused'"),
    (dict(label_smoothing_factor=0.1), "plain cross-entropy"),
    (dict(load_best_model_at_end=True), "load_best_model_at_end is a Hugging Face "
                                        "TrainingArguments field that tessera does not take"),
    (dict(no_such_argument=1), "Extra inputs are not permitted"),
    (dict(save_steps=0), "save_steps=0 with save_strategy='steps'"),
    (dict(logging_steps=0), "logging_steps=0: must be a whole number"),
    (dict(logging_steps=2.5), "a whole number of steps"),
    (dict(stage_memory_budget="lots"), "must be bytes"),
])
def test_bad_arguments_are_refused(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        TrainingArguments(**kwargs)


def test_hugging_face_defaults_that_describe_tessera_are_taken():
    # A script's explicit Hugging Face defaults (and enum members) were refused as unknown.
    from transformers.trainer_utils import IntervalStrategy

    args = TrainingArguments(
        optim="adamw_torch_fused", optim_args=None, lr_scheduler_kwargs={},
        logging_strategy=IntervalStrategy.STEPS, logging_first_step=False,
        remove_unused_columns=True, label_names=["labels"], label_smoothing_factor=0.0,
        dataloader_num_workers=0, push_to_hub=False, overwrite_output_dir=True,
        report_to=None, use_cpu=True)
    assert args.report_to is None and args.use_cpu
    # Readable as in Hugging Face (run_clm.py ends with `if training_args.push_to_hub:`)
    assert (args.push_to_hub, args.optim, args.label_names) == (False, "adamw_torch_fused",
                                                                ["labels"])
    assert args.logging_strategy == "steps"  # the enum member's text
    # Counts stay ints; eval_steps=0 falls back to logging_steps as in Hugging Face, and
    # save_steps=0 is not read under save_strategy="no"
    counted = TrainingArguments(logging_steps=10, eval_steps=0, save_steps=0,
                                save_strategy="no")
    assert type(counted.logging_steps) is int and counted.logging_steps == 10
    # Intervals below 1 are ratios of the training steps, rounded up, as Hugging Face's
    assert [TrainingArguments.steps_of(v, 25) for v in (0.1, 0.5, 3)] == [3, 13, 3]


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(per_device_train_batch_size=8), "per_device_train_batch_size=8 disagrees"),
    (dict(gradient_accumulation_steps=3), "gradient_accumulation_steps=3 disagrees"),
])
def test_batch_arguments_the_strategy_overrides_are_refused(kwargs, fragment):
    from tessera.train.hf_strategy import check_batch_arguments

    strategy = Strategy.parse("pp=2,mbs=2,gbs=8")
    args = TrainingArguments(strategy="pp=2,mbs=2,gbs=8", **kwargs)
    with pytest.raises(StrategyError, match=fragment):
        check_batch_arguments(args, strategy)
    agreeing = dict(per_device_train_batch_size=2, gradient_accumulation_steps=4)
    check_batch_arguments(TrainingArguments(strategy="pp=2,mbs=2,gbs=8", **agreeing), strategy)
    check_batch_arguments(TrainingArguments(strategy="pp=2,mbs=2,gbs=8"), strategy)  # unset


def test_strategy_text_without_a_batch_takes_the_hugging_face_arguments():
    from tessera.train.hf_strategy import resolve_strategy

    # Left out, mbs and gbs were the Strategy's defaults, 1 and 1: one sample a step.
    # (per_device_train_batch_size=4, gradient_accumulation_steps=2, dp=2 of 4 workers)
    text = resolve_strategy("dp=2,pp=2,schedule=gpipe", _tiny_gpt2(), 4, 4, 2, "fp32")
    assert (text.micro_batch_size, text.global_batch_size) == (4, 16)
    assert resolve_strategy("pp=2,mbs=2", _tiny_gpt2(), 2, 8, 3, "fp32"
                            ).global_batch_size == 6
    # gbs alone: mbs from gbs = mbs x accumulation x dp, as Hugging Face's batch arguments
    assert resolve_strategy("pp=2,gbs=32", _tiny_gpt2(), 2, 8, 2, "fp32"
                            ).micro_batch_size == 16
    assert resolve_strategy("dp=2,gbs=4", _tiny_gpt2(), 2, 8, 1, "fp32"
                            ).micro_batch_size == 2
    with pytest.raises(StrategyError, match="gbs=6 without mbs.*not whole; add mbs"):
        resolve_strategy("dp=2,gbs=6", _tiny_gpt2(), 2, 8, 2, "fp32")
    with pytest.raises(StrategyError, match="mbs"):
        resolve_strategy("pp=2,mbs=two", _tiny_gpt2(), 2, 8, 1, "fp32")
    with pytest.raises(StrategyError, match="given twice"):
        resolve_strategy("mbs=2,micro_batch_size=4", _tiny_gpt2(), 1, 8, 1, "fp32")


def test_an_evaluation_micro_batch_the_layout_cannot_run_is_refused():
    from tessera.train.evaluation import check_eval_micro_batch

    with pytest.raises(StrategyError, match="pipeline stages .pp=2. run the training"):
        check_eval_micro_batch(4, Strategy.parse("pp=2,mbs=2,gbs=8"))
    with pytest.raises(StrategyError, match="must be divisible by 2"):
        check_eval_micro_batch(3, Strategy.parse("tp=4,tp_mode=2d,mbs=2,gbs=2"))
    check_eval_micro_batch(2, Strategy.parse("pp=2,mbs=2,gbs=8"))  # the training size
    check_eval_micro_batch(16, Strategy.parse("dp=2,mbs=2,gbs=8"))  # pp=1: any size


def test_evaluation_without_an_eval_dataset_is_refused():
    with pytest.raises(ValueError, match="eval_strategy='steps' needs an eval_dataset"):
        Trainer(model=_tiny_gpt2(), args=TrainingArguments(eval_strategy="steps"),
                train_dataset=[{"input_ids": torch.zeros(8, dtype=torch.long)}])


def test_conflicting_precision_is_refused():
    from tessera.train.hf_strategy import resolve_strategy

    # Text that says another precision than the bf16/fp16 flags is refused...
    for text in ("dp=1,mbs=1,gbs=1,precision=fp32", "dp=1,mbs=1,gbs=1,precision=fp16"):
        with pytest.raises(StrategyError, match="strategy says precision=fp"):
            resolve_strategy(text, _tiny_gpt2(), 1, 1, 1, "bf16")
    # ...text that says none takes the flags, as it takes the batch arguments.
    assert resolve_strategy("dp=1,mbs=1,gbs=1", _tiny_gpt2(), 1, 1, 1, "bf16").precision == \
        "bf16"
    with pytest.raises(StrategyError, match="fields held after 'auto' are read by tessera "
                                            "train's config only"):
        resolve_strategy("auto,sp=2", _tiny_gpt2(), 1, 1, 1, "fp32")
    assert resolve_strategy(None, _tiny_gpt2(), 2, 4, 2, "bf16").to_text() == \
        "dp=2,tp=1,pp=1,mbs=4,gbs=16,precision=bf16"


def test_auto_strategy_asks_the_planner_for_a_runnable_layout():
    from tessera.models import Transformer, preset
    from tessera.strategy import AVAILABLE
    from tessera.train.hf_strategy import resolve_strategy

    strategy = resolve_strategy("auto", Transformer(preset("tiny")), 2, 4, 2, "fp32")
    assert strategy.world_size == 2 and strategy.global_batch_size == 16
    strategy.require_available(AVAILABLE)  # only what this build runs
