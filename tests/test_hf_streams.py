"""Iterable (streaming) datasets through the Hugging Face-style Trainer: read in order, each
dp rank its share, new passes after set_epoch, resumed at the exact sample."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from tessera import Trainer, TrainingArguments
from tessera.data.dataset import GlobalBatchOrder
from tessera.data.stream import StreamError, StreamSamples
from tessera.testing import run_distributed

SEED, N, GBS = 42, 6, 4  # 6 samples, 4 a step: step 2 reads into the second pass


def _samples(n: int = N) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, 64, (n, 16), generator=torch.Generator().manual_seed(7))
    return [{"input_ids": row} for row in ids]


class Passes(torch.utils.data.IterableDataset):
    """Yields the samples in the order tessera's map-style sampler reads them in pass
    ``epoch`` (the epoch set_epoch names), so a stream run and a map-style run train on the
    same global batches."""

    def __init__(self, samples, shift: int = 0):
        self.samples, self.shift, self.epochs, self.epoch = samples, shift, [], 0

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)
        self.epoch = epoch

    def __iter__(self):
        order = np.random.default_rng([SEED, self.epoch]).permutation(len(self.samples))
        for i in order:
            yield {"input_ids": (self.samples[i]["input_ids"] + self.shift) % 64}


def _gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2,
                                      n_head=2, use_cache=False, bos_token_id=None,
                                      eos_token_id=None))


def test_a_stream_is_read_in_order_pass_after_pass():
    stream = Passes(_samples())
    view = StreamSamples(stream)
    order = GlobalBatchOrder(None, GBS, SEED)  # a stream: positions are the indices
    assert order.global_batch(1).tolist() == [4, 5, 6, 7]
    assert order.rank_batch(1, 1, 2).tolist() == [6, 7]
    mapped = GlobalBatchOrder(N, GBS, SEED)
    samples = _samples()
    for step in range(3):  # the stream's positions hold the map-style order's samples
        for position, index in zip(order.global_batch(step), mapped.global_batch(step)):
            assert torch.equal(view[int(position)]["input_ids"], samples[index]["input_ids"])
    assert stream.epochs == [0, 1]  # a new pass after its set_epoch
    first = view[0]["input_ids"]  # kept: the run's shape is read from it
    assert torch.equal(first, samples[mapped.global_batch(0)[0]]["input_ids"])
    again = view[3]  # behind the stream: read again from its first pass
    assert torch.equal(again["input_ids"], samples[mapped.global_batch(0)[3]]["input_ids"])
    assert stream.epochs == [0, 1, 0]
    # Equal streams digest alike, another differs.
    assert StreamSamples(Passes(_samples())).digest_through(8) == view.digest_through(8)
    assert StreamSamples(Passes(_samples(), shift=1)).digest_through(8) != \
        view.digest_through(8)


def test_a_stream_that_cannot_start_again_is_refused_naming_why():
    # A generator cannot start a new pass, nor go back for a resume (it went on instead).
    with pytest.raises(StreamError, match="one-pass generator .iter.. returns itself.: a "
                                          "stream must start again on iter"):
        StreamSamples(sample for sample in _samples(2))

    class Empty(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(())

    with pytest.raises(StreamError, match="Empty yields no sample in pass 1"):
        StreamSamples(Empty())[0]


def test_samples_differing_anywhere_digest_apart():
    from tessera.data.stream import samples_digest

    big = {"input_ids": torch.zeros(5000, dtype=torch.long), "text": "a"}
    other = {"input_ids": big["input_ids"].clone(), "text": "a"}
    other["input_ids"][2500] = 1  # repr would print both alike ("...")
    assert samples_digest([big]) != samples_digest([other])
    assert samples_digest([big]) != samples_digest([{**big, "text": "b"}])
    assert samples_digest([big]) != samples_digest([big, big])  # the count too
    assert samples_digest([big]) == samples_digest([dict(big)])


def test_a_stream_without_max_steps_is_refused():
    with pytest.raises(ValueError, match="iterable .no length.* set max_steps > 0"):
        Trainer(model=_gpt2(), args=TrainingArguments(per_device_train_batch_size=2),
                train_dataset=Passes(_samples()))


def _stream_runs(rank, world_size, root):
    args = dict(per_device_train_batch_size=2, max_steps=4, logging_steps=1,
                learning_rate=1e-2, seed=SEED, disable_tqdm=True)
    samples = _samples()
    mapped = Trainer(model=_gpt2(), args=TrainingArguments(
        output_dir=f"{root}/mapped", save_strategy="no", **args), train_dataset=samples)
    streamed = Trainer(model=_gpt2(), args=TrainingArguments(
        output_dir=f"{root}/streamed", save_steps=2, **args),
        train_dataset=Passes(samples), eval_dataset=Passes(samples))
    out = {"mapped": mapped.train().losses, "streamed": streamed.train().losses,
           "eval": streamed.evaluate()["eval_loss"]}
    resumed = Trainer(model=_gpt2(), args=TrainingArguments(
        output_dir=f"{root}/resumed", save_strategy="no", **args),
        train_dataset=Passes(samples))
    out["resumed"] = resumed.train(
        resume_from_checkpoint=f"{root}/streamed/checkpoints/step_00000002").losses
    # An evaluation stream is read whole: the same loss as the same samples as a list.
    out["eval_list"] = streamed.evaluate(samples)["eval_loss"]
    split = Trainer(model=_gpt2(), args=TrainingArguments(
        output_dir=f"{root}/split", save_strategy="no", **args),
        train_dataset=Passes(samples, shift=rank),  # each rank its own stream: refused
        eval_dataset=Passes(samples[rank:]))  # each rank its own evaluation stream too
    for key, run in (("split", split.train), ("split_eval", split.evaluate)):
        try:
            run()
            out[key] = None
        except StreamError as err:
            out[key] = str(err)
    return out


@pytest.mark.slow
def test_a_stream_trains_as_the_same_samples_indexed(tmp_path):
    outs = run_distributed(_stream_runs, world_size=2, args=(str(tmp_path),), timeout=240)
    out = outs[0]
    # The stream yields the global batches the map-style order reads (dp=2, gbs=4, across
    # passes), so the runs match; fp32 sums of the same values in the same order: 1e-6.
    assert out["streamed"] == pytest.approx(out["mapped"], abs=1e-6)
    # Resumed at step 2: the stream read again past the first 8 samples, steps 3-4 alike.
    assert out["resumed"] == pytest.approx(out["streamed"][2:], abs=1e-6)
    assert out["eval"] == pytest.approx(out["eval_list"], abs=1e-6)
    assert all("ranks read different samples from the training stream" in o["split"]
               and "split_dataset_by_node" in o["split"] for o in outs)
    assert all("ranks read different samples from an evaluation stream" in o["split_eval"]
               for o in outs)
