"""The Hugging Face front's rules that need no workers: what it refuses instead of ignoring,
how it treats batches and datasets, and the core's batch check (plan.fit_batch)."""

from __future__ import annotations

import math
import numpy as np
import pytest
import torch
from torch.utils.data import ConcatDataset, Subset, random_split
from transformers import EarlyStoppingCallback, TrainerCallback

from tessera import Trainer, TrainingArguments
from tessera.data.dataset import TokenDataset
from tessera.parallel.plan import fit_batch
from tessera.strategy import StrategyError
from tessera.train.hf_callbacks import TrainerControl, check_callback_events
from tessera.train.hf_data import hf_collator, labels_shifted, model_columns, shift_for_next_token


class OnStepEnd(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        control.should_save = True


class OnPushBegin(TrainerCallback):
    def on_push_begin(self, args, state, control, **kwargs):
        pass


class OnLogOnly(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        pass


def test_a_callback_handling_an_event_never_fired_is_refused_by_name():
    with pytest.raises(ValueError, match="OnStepEnd handles on_step_end, which tessera's"):
        check_callback_events(OnStepEnd())
    # Any event transformers' TrainerCallback defines, not only the ones named here.
    with pytest.raises(ValueError, match="handles on_push_begin"):
        check_callback_events(OnPushBegin())
    check_callback_events(OnLogOnly())  # TrainerCallback's own no-op events do not count
    check_callback_events(EarlyStoppingCallback())  # on_train_begin / on_evaluate: fired


def test_a_control_flag_tessera_does_not_act_on_cannot_be_set():
    control = TrainerControl()
    control.should_training_stop = True
    with pytest.raises(AttributeError, match="should_save is not supported"):
        control.should_save = True


def test_max_steps_overrides_epochs_even_at_zero():
    assert TrainingArguments(num_train_epochs=0, max_steps=10).max_steps == 10
    args = TrainingArguments()
    args.num_train_epochs = 0  # then max_steps, as Hugging Face allows (no refusal between)
    args.max_steps = 10
    assert (args.num_train_epochs, args.max_steps) == (0, 10)


def test_the_trainer_takes_keywords_after_args():
    # Hugging Face's positional order puts data_collator third: refused, not misread.
    with pytest.raises(TypeError):
        Trainer(torch.nn.Linear(2, 2), TrainingArguments(), [0, 1])


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(compute_metrics=lambda prediction: {}), "compute_metrics is not supported"),
    (dict(preprocess_logits_for_metrics=lambda x, y: x), "preprocess_logits_for_metrics"),
    (dict(optimizers=(object(), None)), "optimizers is not supported"),
    (dict(train_dataset=None), "needs a train_dataset or an eval_dataset"),
])
def test_trainer_arguments_it_does_not_act_on_are_refused(kwargs, fragment):
    # Refused before any worker starts; Hugging Face's defaults (None, (None, None)) pass
    # this check (the two-worker launch in test_hf_api.py builds Trainers with them).
    arguments = {"train_dataset": [0, 1], **kwargs}
    with pytest.raises(ValueError, match=fragment):
        Trainer(model=torch.nn.Linear(2, 2), args=TrainingArguments(), **arguments)


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(num_train_epochs=-1), "num_train_epochs"),
    (dict(num_train_epochs=0), "num_train_epochs=0 with max_steps unset"),
    (dict(warmup_ratio=1.5), "warmup_ratio"),
    (dict(warmup_ratio=-0.1), "warmup_ratio"),
    (dict(warmup_steps=-1), "warmup_steps"),
    (dict(lr_scheduler_type="polynomial"), "lr_scheduler_type"),
    (dict(gradient_checkpointing=True), "add recompute=full .or a ratio. to the strategy"),
    (dict(evaluation_strategy="steps"), "renamed eval_strategy"),
    (dict(fsdp="full_shard"), "tessera lays the model out itself"),
])
def test_out_of_range_arguments_are_refused_naming_them(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        TrainingArguments(**kwargs)


def test_wrapped_tessera_datasets_keep_their_labels_unshifted():
    data = TokenDataset(np.arange(100), 8)
    train, val = random_split(data, [8, 4])
    assert labels_shifted(train, val)
    assert labels_shifted(ConcatDataset([train, Subset(data, [0])]), None)
    plain = [{"input_ids": torch.arange(9)}]
    assert not labels_shifted(plain, None)
    with pytest.raises(ValueError, match="mix labels already shifted"):
        labels_shifted(train, plain)
    with pytest.raises(ValueError, match="ConcatDataset mixes"):
        labels_shifted(ConcatDataset([train, plain]), None)


def test_columns_the_model_does_not_take_are_dropped_others_kept():
    model = torch.nn.Module()
    model.forward = lambda input_ids, attention_mask=None, position_ids=None: None
    columns = model_columns(model)
    collate = hf_collator(None, shift=True, columns=columns)
    batch = collate([{"input_ids": [1, 2, 3, 4], "attention_mask": [1, 1, 1, 0],
                      "text": "a b c"}] * 2)
    assert set(batch) == {"input_ids", "labels", "attention_mask"}  # text dropped
    # The mask keeps the inputs' positions; the padded position's label is ignored.
    assert batch["attention_mask"].tolist() == [[1, 1, 1]] * 2
    assert batch["labels"].tolist() == [[2, 3, -100]] * 2


def test_right_padding_is_run_exactly_left_padding_and_unread_keys_are_refused():
    ids = torch.arange(12).view(2, 6)
    right = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    batch = shift_for_next_token({"input_ids": ids, "attention_mask": right})
    fitted = fit_batch(batch, frozenset())
    assert set(fitted) == {"input_ids", "labels"}
    assert fitted["labels"][0].tolist() == [1, 2, 3, -100, -100]
    # Sequence parallelism reads the mask itself: handed over unchanged.
    assert fit_batch(batch, frozenset({"attention_mask"})) is batch
    left = right.flip(1)
    with pytest.raises(ValueError, match="left padding"):
        fit_batch(shift_for_next_token({"input_ids": ids, "attention_mask": left}), frozenset())
    with pytest.raises(ValueError, match=r"\['document_ids', 'position_ids'\] would be ignored"):
        fit_batch({"input_ids": ids, "labels": ids, "position_ids": ids,
                   "document_ids": ids}, frozenset())


def test_a_collator_returning_python_numbers_is_refused_naming_them():
    # DataCollatorWithFlattening(return_flash_attn_kwargs=True) adds max_length_q/k as ints:
    # they failed as an AttributeError ('int' object has no attribute 'dim').
    from transformers import DataCollatorWithFlattening

    samples = [{"input_ids": list(range(1, n + 1))} for n in (5, 7)]
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(samples)
    with pytest.raises(ValueError, match=r"\['max_length_k', 'max_length_q'\] as \['int', "
                                         r"'int'\], not tensors.*return_flash_attn_kwargs"):
        shift_for_next_token(batch)


def test_a_callback_reading_a_field_tessera_lacks_fails_naming_it():
    from tessera.train.hf_callbacks import TrainerState

    trainer = Trainer.__new__(Trainer)  # the event dispatch alone, no workers
    trainer.args, trainer.state, trainer.control = (TrainingArguments(), TrainerState(),
                                                    TrainerControl())
    trainer.model = trainer.processing_class = None
    trainer._hf_callbacks = [EarlyStoppingCallback()]
    with pytest.raises(ValueError, match="EarlyStoppingCallback.on_train_begin reads "
                                         "TrainingArguments.load_best_model_at_end"):
        trainer._each("on_train_begin")


class OnSave(TrainerCallback):
    def __init__(self):
        self.seen = []

    def on_save(self, args, state, control, **kwargs):
        self.seen.append((state.global_step, state.epoch))


def test_a_save_between_logging_steps_shows_its_own_epoch():
    from types import SimpleNamespace

    from tessera.train.hf_callbacks import TrainerState

    trainer = Trainer.__new__(Trainer)  # the event dispatch alone, no workers
    trainer.args, trainer.state, trainer.control = (TrainingArguments(), TrainerState(),
                                                    TrainerControl())
    trainer.model = trainer.processing_class = None
    trainer._steps_per_epoch, trainer._core = 2, SimpleNamespace(step=3)
    trainer._hf_callbacks = [OnSave()]
    trainer._saved(None)  # step 3, last logged at step 0: Hugging Face shows epoch 1.5
    assert trainer._hf_callbacks[0].seen == [(3, 1.5)]


class ComputesItsLoss(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return 0 * model(**inputs).loss


class EvaluatesItsWay(Trainer):
    def evaluate(self, *args, **kwargs):
        return {"eval_loss": 0.0}

    def my_own_helper(self):  # not a Hugging Face Trainer method: the user's own
        return 1


class LossMixin:
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return 0 * model(**inputs).loss


class MixedBefore(LossMixin, Trainer):
    pass


class MixedAfter(Trainer, LossMixin):
    pass


class SavesItsWay(Trainer):
    def save_model(self, output_dir=None, _internal_call=False):
        return None


class LogsItsWay(Trainer):
    def log(self, logs, start_time=None):  # does not call super().log
        self.seen = [*getattr(self, "seen", []), dict(logs)]


class OnEvaluate(TrainerCallback):
    def __init__(self):
        self.metrics = []

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.metrics.append(dict(metrics))


def test_a_log_override_sees_every_log_and_on_evaluate_its_metrics():
    from types import SimpleNamespace

    from tessera.train.hf_callbacks import TrainerState

    trainer = LogsItsWay.__new__(LogsItsWay)  # the event dispatch alone, no workers
    trainer.args, trainer.state, trainer.control = (TrainingArguments(), TrainerState(),
                                                    TrainerControl())
    trainer.model = trainer.processing_class = None
    trainer._steps_per_epoch, trainer._core = 2, SimpleNamespace(stop_requested=False)
    trainer._hf_callbacks = [OnEvaluate()]
    trainer._dispatch({"step": 1, "loss": 3.0, "lr": 0.1})
    trainer._dispatch({"step": 2, "eval_loss": 2.5})
    # The override saw both logs (Hugging Face's names); on_evaluate the evaluation's own
    # metrics, not a stale history record (the override appended none).
    assert trainer.seen == [{"loss": 3.0, "learning_rate": 0.1}, {"eval_loss": 2.5}]
    assert trainer._hf_callbacks[0].metrics == [{"eval_loss": 2.5}]


def test_overriding_what_tessera_never_calls_is_refused_by_name(own_process_group):
    data = TokenDataset(np.arange(200) % 50, seq_len=16)
    from tessera.models import Transformer, preset

    args = TrainingArguments(max_steps=1, per_device_train_batch_size=2)
    with pytest.raises(ValueError, match="ComputesItsLoss overrides compute_loss of Hugging "
                                         "Face's Trainer, which tessera's Trainer never calls"):
        ComputesItsLoss(model=Transformer(preset("tiny")), args=args, train_dataset=data)
    # evaluate runs where a script calls it, but evaluations during training do not call it
    evaluating = TrainingArguments(max_steps=1, per_device_train_batch_size=2,
                                   eval_strategy="steps", eval_steps=1)
    with pytest.raises(ValueError, match="overrides evaluate.*eval_strategy='no'"):
        EvaluatesItsWay(model=Transformer(preset("tiny")), args=evaluating,
                        train_dataset=data, eval_dataset=data)
    trainer = EvaluatesItsWay(model=Transformer(preset("tiny")), args=args, train_dataset=data)
    assert trainer.evaluate() == {"eval_loss": 0.0} and trainer.my_own_helper() == 1
    # A mixin's override counts, before or after Trainer in the bases
    for mixed in (MixedBefore, MixedAfter):
        with pytest.raises(ValueError, match=f"{mixed.__name__} overrides compute_loss"):
            mixed(model=Transformer(preset("tiny")), args=args, train_dataset=data)
    # save_model: Hugging Face also calls it for every checkpoint, tessera's core does not
    with pytest.raises(ValueError, match="save_model is overridable with save_strategy='no'"):
        SavesItsWay(model=Transformer(preset("tiny")), args=args, train_dataset=data)
    unsaved = TrainingArguments(max_steps=1, per_device_train_batch_size=2, save_strategy="no")
    SavesItsWay(model=Transformer(preset("tiny")), args=unsaved, train_dataset=data)


def test_metrics_are_printed_and_saved_as_hugging_face_names_them(tmp_path):
    from tessera.train.hf_reports import format_metrics, write_metrics

    text = format_metrics("eval", {"eval_loss": 2.3456789, "epoch": 1,
                                   "eval_runtime": 3725.5})
    assert text.splitlines() == ["***** eval metrics *****",
                                 "  epoch        =          1",
                                 "  eval_loss    =     2.3457",
                                 "  eval_runtime = 1:02:05.50"]
    write_metrics(tmp_path, "train", {"train_loss": 3.0})
    write_metrics(tmp_path, "eval", {"eval_loss": 2.0})
    write_metrics(tmp_path, "test", {"test_loss": 1.0}, combined=False)
    import json

    assert json.loads((tmp_path / "all_results.json").read_text()) == {
        "train_loss": 3.0, "eval_loss": 2.0}
    assert json.loads((tmp_path / "test_results.json").read_text()) == {"test_loss": 1.0}
    with pytest.raises(ValueError, match="metric 'loss' is a Tensor"):
        write_metrics(tmp_path, "bad", {"loss": torch.tensor(1.0)})


@pytest.mark.parametrize("seconds", [0.0, 12.3456, 59.999, 119.996, 3725.5, 86400.25])
def test_runtimes_are_shown_as_hugging_faces_log_metrics_shows_them(seconds):
    # Hugging Face truncates to hundredths: rounding showed 59.999 s as 0:00:60.00
    from transformers.trainer_pt_utils import _secs2timedelta

    from tessera.train.hf_reports import _shown

    assert _shown("train_runtime", seconds) == _secs2timedelta(seconds)


@pytest.mark.parametrize("kind", ["linear", "cosine", "constant_with_warmup"])
def test_learning_rate_schedules_are_hugging_faces_step_for_step(kind):
    # The front's schedules (min ratio 0, the warm-up's first step at lr 0) against
    # transformers' own, over warm-up and decay.
    import transformers

    from tessera.train.optim import build_scheduler

    def rates(make):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        scheduler = make(optimizer)
        out = []
        for _ in range(10):
            out.append(scheduler.get_last_lr()[0])
            optimizer.step()
            scheduler.step()
        return out

    theirs = rates(lambda opt: transformers.get_scheduler(kind, opt, num_warmup_steps=3,
                                                          num_training_steps=10))
    ours = rates(lambda opt: build_scheduler(opt, 3, 10, 0.0, kind.removesuffix("_with_warmup"),
                                             warmup_from_zero=True))
    assert ours == pytest.approx(theirs, abs=1e-12)
    assert theirs[0] == 0.0 and max(theirs) == 1.0  # the check covers warm-up and the peak


def test_layout_arguments_at_hugging_faces_defaults_are_taken():
    # gradient_checkpointing / deepspeed / fsdp at transformers' defaults ask for nothing;
    # set, they are refused (test_out_of_range_arguments_are_refused_naming_them).
    args = TrainingArguments(gradient_checkpointing=False, deepspeed=None, fsdp="")
    assert args == TrainingArguments()
    assert TrainingArguments(gradient_checkpointing=None, fsdp=None) == TrainingArguments()


@pytest.mark.parametrize("warmup", [dict(warmup_steps=0.1), dict(warmup_steps=0.25),
                                    dict(warmup_steps=7), dict(warmup_steps=7.6),
                                    dict(warmup_steps=0), dict(warmup_ratio=0.1)])
def test_warmup_steps_are_read_as_transformers_reads_them(warmup):
    # transformers 5: warmup_steps below 1 is a ratio of the steps, 1 or more a count
    # (truncated); transformers 4's warmup_ratio is its own field, which 5 dropped.
    # (transformers' TrainingArguments needs accelerate to build: its method runs unbound)
    from types import SimpleNamespace

    from transformers import TrainingArguments as Theirs

    for max_steps in (9, 40, 101):
        ours = TrainingArguments(**warmup).warmup_steps_of(max_steps)
        if "warmup_steps" in warmup:
            expected = Theirs.get_warmup_steps(SimpleNamespace(**warmup), max_steps)
        else:
            expected = math.ceil(0.1 * max_steps)
        assert ours == expected


def test_script_flags_hugging_face_does_not_read_are_taken():
    # run_clm.py passes do_train / do_eval and branches on them; the Trainer reads neither.
    args = TrainingArguments(do_train=True, do_eval=True)
    assert args.do_train and args.do_eval


def test_an_eval_batch_pipeline_stages_cannot_run_is_refused_by_its_own_name(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # the launch the strategy text is for
    args = TrainingArguments(strategy="pp=2,mbs=2,gbs=8", per_device_eval_batch_size=4,
                             max_steps=1)
    with pytest.raises(StrategyError, match="per_device_eval_batch_size=4 differs from mbs=2.*"
                                            "leave it unset"):
        Trainer(model=torch.nn.Linear(2, 2), args=args, train_dataset=[0, 1])


def test_use_cpu_plans_auto_for_the_host_not_its_gpu(monkeypatch, own_process_group):
    # A GPU without a planner preset: "auto" is refused for it, but use_cpu=True trains on
    # the host, so the planner is asked about the host.
    import tessera.train.auto as auto
    from tessera.models import Transformer, preset

    monkeypatch.setattr(auto.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(auto.torch.cuda, "get_device_name", lambda index=0: "Tesla T4")
    data = TokenDataset(np.arange(200) % 50, seq_len=16)
    for use_cpu in (False, True):
        args = TrainingArguments(strategy="auto", use_cpu=use_cpu, max_steps=1,
                                 per_device_train_batch_size=2)
        if not use_cpu:
            with pytest.raises(StrategyError, match="no planner preset for GPU 'Tesla T4'"):
                Trainer(model=Transformer(preset("tiny")), args=args, train_dataset=data)
        else:
            trainer = Trainer(model=Transformer(preset("tiny")), args=args, train_dataset=data)
            assert trainer._core.strategy.world_size == 1
            assert trainer._core.ctx.device.type == "cpu"


def test_auto_plans_for_the_planner_cluster_file(tmp_path, own_process_group):
    import dataclasses

    from tessera.models import Transformer, preset
    from tessera.planner import parse_cluster, save_cluster
    from tessera.planner.hardware import Link

    cluster = parse_cluster("cpu:1x1")
    # Memory for nothing: planning reads this file, so nothing fits.
    small = dataclasses.replace(cluster.device, memory_bytes=1e3, intra=Link("shm", 1e9, 1e-5))
    path = tmp_path / "cluster.yaml"
    save_cluster(dataclasses.replace(cluster, device=small), str(path))
    data = TokenDataset(np.arange(200) % 50, seq_len=16)
    args = TrainingArguments(strategy="auto", planner_cluster=str(path), max_steps=1,
                             per_device_train_batch_size=2, use_cpu=True)
    with pytest.raises(StrategyError, match="strategy=auto: nothing runs on 1 device"):
        Trainer(model=Transformer(preset("tiny")), args=args, train_dataset=data)
    args = TrainingArguments(strategy="dp=1,mbs=2,gbs=2", planner_cluster=str(path),
                             max_steps=1, per_device_train_batch_size=2)
    with pytest.raises(StrategyError, match="planner_cluster is what strategy='auto' plans "
                                            "for; with strategy 'dp=1,mbs=2,gbs=2' nothing"):
        Trainer(model=Transformer(preset("tiny")), args=args, train_dataset=data)


def test_datasets_tessera_cannot_read_are_refused_naming_the_way():
    from tessera.train.hf_data import check_readable
    from tessera.train.hf_eval import eval_sets

    # A dict eval_dataset holds named sets (Hugging Face's eval_<name>_loss); each is checked.
    assert list(eval_sets({"wiki": [0], "code": [1]})) == ["wiki", "code"]
    with pytest.raises(ValueError, match=r"eval_dataset\['code'\] is a dict of datasets "
                                         r"\(a\): give one set"):
        eval_sets({"wiki": [0], "code": {"a": [1]}})
    with pytest.raises(ValueError, match="eval_dataset is an empty dict"):
        eval_sets({})
    with pytest.raises(ValueError, match="keys name metrics .* got 0, a int"):
        eval_sets({0: [1]})
    with pytest.raises(ValueError, match="train_dataset is a dict.*give one split"):
        check_readable("train_dataset", {"train": [0], "validation": [1]})

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield {"input_ids": torch.zeros(4, dtype=torch.long)}

    check_readable("train_dataset", Stream())  # read in order (test_hf_streams.py)
    assert len(eval_sets({"a": Stream()})["a"]) == 1  # an evaluation stream: read whole
    with pytest.raises(ValueError, match="train_dataset is a int, which has no length and "
                                         "index and is not iterable"):
        check_readable("train_dataset", 5)
    check_readable("train_dataset", [{"input_ids": [1, 2]}])  # a list indexes


def test_a_router_loss_no_layout_trains_is_refused_not_dropped(own_process_group):
    import transformers as T

    def mixtral(**extra):
        return T.MixtralForCausalLM(T.MixtralConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
            num_experts_per_tok=2, use_cache=False, **extra))

    data = [{"input_ids": torch.arange(8)} for _ in range(4)]
    args = TrainingArguments(max_steps=1, per_device_train_batch_size=2, save_strategy="no")
    # At pp=1 (no capture to notice it) the load-balancing term was silently left out.
    with pytest.raises(ValueError, match="output_router_logits=True: its own loss adds the "
                                         "router's load-balancing loss .x router_aux_loss_coef"
                                         "=0.5.*output_router_logits=False"):
        Trainer(model=mixtral(output_router_logits=True, router_aux_loss_coef=0.5), args=args,
                train_dataset=data)
    # Other families name the coefficient otherwise (JetMoE's aux_loss_coef).
    from tessera.parallel.plan import refuse_extra_losses

    jetmoe = T.JetMoeForCausalLM(T.JetMoeConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, kv_channels=8, intermediate_size=64, num_local_experts=4,
        num_experts_per_tok=2, output_router_logits=True, use_cache=False))
    with pytest.raises(ValueError, match=r"JetMoeForCausalLM .*\(x aux_loss_coef=0.01\)"):
        refuse_extra_losses(jetmoe)
    # A zero coefficient adds nothing: taken.
    Trainer(model=mixtral(output_router_logits=True, router_aux_loss_coef=0.0), args=args,
            train_dataset=data)
