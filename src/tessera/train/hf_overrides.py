"""Which Hugging Face Trainer methods a subclass of tessera's Trainer may override.

Hugging Face scripts customise training by subclassing its Trainer (``compute_loss``,
``create_optimizer``, ``get_train_dataloader``, ...). tessera's Trainer runs the step, the
optimizer and the data order inside its layouts and never calls those methods, so such an
override would be silently ignored: it is refused when the Trainer is built, naming it.
"""

from __future__ import annotations

# Overridable: tessera calls these where Hugging Face does (``log`` for every training and
# evaluation log), or only a script calls them (``train``, ``save_model``, the reports).
HONOURED = frozenset({
    "__init__", "train", "log", "save_model", "log_metrics", "save_metrics", "save_state",
    "add_callback", "pop_callback", "remove_callback", "is_world_process_zero",
    "is_local_process_zero", "create_model_card"})
# Honoured only when nothing evaluates during training: those evaluations run in the core.
HONOURED_WITHOUT_EVAL_STRATEGY = frozenset({"evaluate"})


def check_overrides(cls: type, base: type, eval_strategy: str) -> None:
    """Refuse methods of Hugging Face's Trainer that ``cls`` (a subclass of ``base``,
    tessera's Trainer) defines and tessera would not call.

    Raises:
        ValueError: naming the methods and what to do instead.
    """
    theirs = _hf_trainer_names()
    allowed = HONOURED | (HONOURED_WITHOUT_EVAL_STRATEGY if eval_strategy == "no" else set())
    defined = set()
    for klass in cls.__mro__:
        if klass is base or not issubclass(klass, base):
            break
        defined |= {name for name, value in vars(klass).items() if callable(value)
                    or isinstance(value, (staticmethod, classmethod, property))}
    ignored = sorted((defined & theirs) - allowed)
    if ignored:
        evaluate = ("; evaluate is overridable with eval_strategy='no' (evaluations during "
                    "training do not call it)" if "evaluate" in ignored else "")
        raise ValueError(
            f"{cls.__name__} overrides {', '.join(ignored)} of Hugging Face's Trainer, which "
            "tessera's Trainer never calls (the layout runs the loss, the step, the "
            "optimizer and the data order), so the override would be ignored. Overridable: "
            f"{', '.join(sorted(HONOURED - {'__init__'}))}{evaluate}. A custom loss goes in "
            "the model's forward (its returned loss); optimizer settings in the arguments")


def _hf_trainer_names() -> set[str]:
    try:
        from transformers import Trainer
    except ImportError:  # no Hugging Face Trainer to mirror: the commonly overridden ones
        return {"compute_loss", "training_step", "prediction_step", "create_optimizer",
                "create_scheduler", "create_optimizer_and_scheduler", "get_train_dataloader",
                "get_eval_dataloader", "evaluate", "evaluation_loop"}
    return {name for name in dir(Trainer) if not name.startswith("__")} | {"__init__"}

