"""The model card a Hugging Face training script writes last (``trainer.create_model_card``).

``run_clm.py`` ends with ``trainer.create_model_card(**kwargs)`` when it does not push to the
Hub. The card is ``README.md`` in ``output_dir``: Hub metadata (YAML front matter) from the
script's keywords, then what the run was: layout, hyperparameters, the logged losses per
step and the library versions, read from the Trainer's arguments, state and strategy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

# Keywords of Hugging Face's create_model_card -> the card metadata key they fill, and
# whether it is written as a list (as its TrainingSummary writes them).
_METADATA = {"language": ("language", True), "license": ("license", False),
             "finetuned_from": ("base_model", False), "tags": ("tags", True),
             "dataset_tags": ("datasets", True)}


def model_card(title: str, args: Any, state: Any, strategy_text: str, *,
               is_transformers_model: bool, language: Any = None, license: Any = None,
               tags: Any = None, model_name: str | None = None, finetuned_from: Any = None,
               tasks: Any = None, dataset_tags: Any = None, dataset: Any = None,
               dataset_args: Any = None) -> str:
    """The card's text, its metadata as Hugging Face's ``TrainingSummary`` writes it
    (``language``, ``tags`` and ``datasets`` as lists, ``finetuned_from`` as ``base_model``,
    a ``model-index`` naming the model). Like Hugging Face's, the model index lists no
    results: it keeps a result only with a task, a dataset and a metric it knows, and a loss
    is not one, so ``tasks`` changes nothing here either. ``dataset`` and ``dataset_args``
    (its configuration) are shown in the text."""
    given = {"language": language, "license": license, "tags": tags,
             "finetuned_from": finetuned_from, "dataset_tags": dataset_tags}
    name = model_name or title
    metadata: dict[str, Any] = {"library_name": "transformers"} if is_transformers_model else {}
    for keyword, (key, as_list) in _METADATA.items():
        value = given[keyword]
        if value:
            metadata[key] = _as_list(value) if as_list else value
    metadata["tags"] = [*_as_list(metadata.get("tags")), "tessera"]
    metadata["model-index"] = [{"name": name, "results": []}]
    origin = f"a fine-tuned version of {finetuned_from}" if finetuned_from else "trained"
    data = f" on {_as_list(dataset)[0]}" if dataset else ""
    if dataset and dataset_args:
        data += f" ({_as_list(dataset_args)[0]})"
    lines = ["---", yaml.safe_dump(metadata, sort_keys=False).rstrip(), "---", "",
             f"# {name}", "", f"This model is {origin}{data}, with tessera "
             f"(layout `{strategy_text}`).", ""]
    lines += _evaluation(state.log_history)
    lines += ["## Training hyperparameters", ""]
    lines += [f"- {key}: {value}" for key, value in _hyperparameters(args, state, strategy_text)]
    lines += ["", "## Training results", ""] + _results(state.log_history)
    lines += ["", "## Framework versions", ""] + [f"- {n} {v}" for n, v in _versions()]
    return "\n".join(lines) + "\n"


def write_model_card(output_dir: str | Path, text: str) -> Path:
    """Write ``README.md`` in ``output_dir`` (created when missing); returns its path."""
    path = Path(output_dir) / "README.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _as_list(value: Any) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple, set)) else [value]


def _evaluation(history: list[dict[str, Any]]) -> list[str]:
    evals = [record for record in history if "eval_loss" in record]
    if not evals:
        return []
    return ["It reaches on the evaluation set:", "",
            f"- Loss: {evals[-1]['eval_loss']:.4f} (step {evals[-1].get('step')})", ""]


def _hyperparameters(args: Any, state: Any, strategy_text: str) -> list[tuple[str, Any]]:
    return [("learning_rate", args.learning_rate),
            ("train_batch_size", state.train_batch_size),
            ("seed", args.seed),
            ("gradient_accumulation_steps", args.gradient_accumulation_steps),
            ("layout (tessera strategy)", strategy_text),
            ("optimizer", f"AdamW with betas=({args.adam_beta1},{args.adam_beta2}), "
                          f"epsilon={args.adam_epsilon}, weight_decay={args.weight_decay}"),
            ("lr_scheduler_type", args.lr_scheduler_type),
            ("training_steps", state.max_steps)]


def _results(history: list[dict[str, Any]]) -> list[str]:
    """Hugging Face's table: the training loss of each logging step, and the evaluation
    loss where one was logged at that step."""
    rows: dict[int, dict[str, Any]] = {}
    for record in history:
        step = record.get("step")
        if step is None or not ({"loss", "eval_loss"} & set(record)):
            continue
        row = rows.setdefault(step, {"epoch": record.get("epoch")})
        for key in ("loss", "eval_loss"):
            if key in record:
                row[key] = record[key]
    if not rows:
        return ["No losses were logged."]
    table = ["| Training Loss | Epoch | Step | Validation Loss |",
             "|:-------------:|:-----:|:----:|:---------------:|"]
    for step, row in sorted(rows.items()):
        train = f"{row['loss']:.4f}" if "loss" in row else "No log"
        evaluated = f"{row['eval_loss']:.4f}" if "eval_loss" in row else "No log"
        table.append(f"| {train} | {row['epoch']} | {step} | {evaluated} |")
    return table


def _versions() -> list[tuple[str, str]]:
    import torch

    import tessera

    found = [("tessera", tessera.__version__),
             ("PyTorch", torch.__version__)]
    try:
        import transformers
    except ImportError:
        return found
    return found + [("Transformers", transformers.__version__)]
