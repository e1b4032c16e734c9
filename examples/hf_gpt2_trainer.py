"""A Hugging Face Trainer script moved to tessera: the two lines marked CHANGED differ.

Run: torchrun --nproc-per-node 2 examples/hf_gpt2_trainer.py  (or plain python for 1 worker)
"""

import math
import sysconfig
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from tessera import Trainer, TrainingArguments  # CHANGED: was `from transformers import ...`


class ByteChunks(torch.utils.data.Dataset):
    """Fixed-length byte sequences of the Python standard library's argparse module."""

    def __init__(self, length: int = 64) -> None:
        data = Path(sysconfig.get_paths()["stdlib"], "argparse.py").read_bytes()
        ids = torch.tensor(list(data), dtype=torch.long)
        self.samples = ids[: len(ids) // length * length].view(-1, length)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.samples[i]}


def main(output_dir: str = "runs/hf_gpt2", max_steps: int = 30) -> dict:
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2,
                                       n_head=4, use_cache=False, bos_token_id=None,
                                       eos_token_id=None))
    dataset = ByteChunks()
    args = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=8,
                             learning_rate=3e-3, max_steps=max_steps, logging_steps=5,
                             save_steps=max_steps, report_to="none",
                             strategy=None)  # CHANGED: tessera's layout (None: data parallel)
    trainer = Trainer(model=model, args=args, train_dataset=dataset, eval_dataset=dataset)
    train_result = trainer.train()
    trainer.log_metrics("train", train_result.metrics)
    trainer.save_metrics("train", train_result.metrics)
    trainer.save_state()
    metrics = trainer.evaluate()
    metrics["perplexity"] = math.exp(metrics["eval_loss"])
    trainer.log_metrics("eval", metrics)
    trainer.save_metrics("eval", metrics)
    trainer.save_model(f"{output_dir}/final")
    trainer.create_model_card(tasks="text-generation", dataset="bytes of this file")
    return metrics


if __name__ == "__main__":
    print(main())
