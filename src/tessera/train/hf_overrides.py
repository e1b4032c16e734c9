"""Which Hugging Face Trainer methods a subclass of tessera's Trainer may override.

Hugging Face scripts customise training by subclassing its Trainer (``compute_loss``,
``create_optimizer``, ``get_train_dataloader``, ...). tessera's Trainer runs the step, the
optimizer and the data order inside its layouts and never calls those methods, so such an
override would be silently ignored: it is refused when the Trainer is built, naming it.
"""

from __future__ import annotations

# Overridable: tessera calls these where Hugging Face does (``log`` for every training and
# evaluation log), or only a script calls them (``train``, the reports).
HONOURED = frozenset({
    "__init__", "train", "log", "log_metrics", "save_metrics", "save_state", "add_callback",
    "pop_callback", "remove_callback", "is_world_process_zero", "is_local_process_zero",
    "create_model_card"})
# Hugging Face also calls these during training (every evaluation; every checkpoint's
# weights), where tessera's core evaluates and checkpoints without them: overridable only
# when training does neither, so that only the script's own calls run them.
CALLED_DURING_TRAINING = {"evaluate": ("eval_strategy", "evaluations during training"),
                          "save_model": ("save_strategy", "checkpoints")}


def check_overrides(cls: type, base: type, args) -> None:
    """Refuse methods of Hugging Face's Trainer that ``cls`` (a subclass of ``base``,
    tessera's Trainer) or a mixin of it defines and tessera would not call.

    Raises:
        ValueError: naming the methods and what to do instead.
    """
    theirs = _hf_trainer_names()
    allowed = HONOURED | {name for name, (field, _) in CALLED_DURING_TRAINING.items()
                          if getattr(args, field) == "no"}
    defined = set()
    for klass in cls.__mro__:  # the user's classes and mixins, before or after ``base``
        if klass in base.__mro__:
            continue
        defined |= {name for name, value in vars(klass).items() if callable(value)
                    or isinstance(value, (staticmethod, classmethod, property))}
    ignored = sorted((defined & theirs) - allowed)
    if ignored:
        conditional = "".join(
            f"; {name} is overridable with {field}='no' ({what} do not call it)"
            for name, (field, what) in CALLED_DURING_TRAINING.items() if name in ignored)
        raise ValueError(
            f"{cls.__name__} overrides {', '.join(ignored)} of Hugging Face's Trainer, which "
            "tessera's Trainer never calls (the layout runs the loss, the step, the "
            "optimizer, the data order, evaluations and checkpoints), so the override would "
            f"be ignored. Overridable: {', '.join(sorted(HONOURED - {'__init__'}))}"
            f"{conditional}. A custom loss goes in the model's forward (its returned loss); "
            "optimizer settings in the arguments")


def _hf_trainer_names() -> set[str]:
    try:
        from transformers import Trainer
    except ImportError:  # no Hugging Face Trainer to mirror: the commonly overridden ones
        return {"compute_loss", "training_step", "prediction_step", "create_optimizer",
                "create_scheduler", "create_optimizer_and_scheduler", "get_train_dataloader",
                "get_eval_dataloader", "evaluate", "evaluation_loop"}
    return {name for name in dir(Trainer) if not name.startswith("__")} | {"__init__"}

