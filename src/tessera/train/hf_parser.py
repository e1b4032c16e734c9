"""``HfArgumentParser`` that also reads tessera's ``TrainingArguments`` (a pydantic model).

transformers' parser builds its command line from dataclass fields, so it refuses tessera's
arguments. This one stands in a dataclass with the same names for them; what it parses
(command line, dict, JSON or YAML file) comes back as tessera's ``TrainingArguments``,
validated, with only the arguments actually given counted as set (``model_fields_set``:
batch arguments given beside strategy text are checked against it). Other dataclasses
(a script's ``ModelArguments``) are parsed as transformers parses them. A script changes its
import of ``HfArgumentParser`` with ``Trainer`` and ``TrainingArguments``.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any, Iterable, Literal, Union

from pydantic import BaseModel
from transformers import HfArgumentParser as _HfArgumentParser

from tessera.train.hf_arguments import hf_bool_fields, hf_only_fields, screen_hf_values

# Fields read as text on the command line, where pydantic parses the text: byte budgets
# such as "12GiB" (parse_budget).
_AS_TEXT = frozenset({"stage_memory_budget"})


class _Unset:
    """The default of every stand-in field: an argument not given stays unset."""

    def __repr__(self) -> str:
        return "tessera's default"


UNSET = _Unset()


class HfArgumentParser(_HfArgumentParser):
    """transformers' ``HfArgumentParser``, taking tessera's ``TrainingArguments`` too.

    Args:
        dataclass_types: a class or several: dataclasses, and pydantic models such as
            :class:`tessera.TrainingArguments`.
        **kwargs: passed to ``argparse.ArgumentParser``.
    """

    def __init__(self, dataclass_types: Any = None, **kwargs: Any) -> None:
        if dataclass_types is None:
            dataclass_types = []
        elif isinstance(dataclass_types, type) or not isinstance(dataclass_types, Iterable):
            dataclass_types = [dataclass_types]
        dataclass_types = list(dataclass_types)  # read more than once below
        models = [t for t in dataclass_types if _is_model(t)]
        # Hugging Face names the script's own dataclasses declare are theirs, not refused.
        self._screened = hf_only_fields() - {
            f.name for t in dataclass_types if not _is_model(t) for f in dataclasses.fields(t)
        } if models else set()
        super().__init__([stand_in(t) if _is_model(t) else t for t in dataclass_types],
                         **kwargs)
        for model in models:
            self._add_negations(model)

    def _add_negations(self, model: type[BaseModel]) -> None:
        """``--no_<flag>`` for a flag that defaults to True, as transformers' parser adds
        (it adds them from the dataclass defaults, which are UNSET in the stand-in)."""
        for name, info in model.model_fields.items():
            if info.annotation is bool and info.default is True:
                self.add_argument(f"--no_{name}", f"--no-{name.replace('_', '-')}",
                                  action="store_false", dest=name, default=UNSET,
                                  help=f"set {name} to False")

    def parse_dict(self, args: dict[str, Any], allow_extra_keys: bool = False) -> tuple:
        """As transformers' (JSON and YAML files come through here), with Hugging Face
        arguments tessera does not take screened as its constructor screens them: refused by
        name, or at Hugging Face's default dropped (``--gradient_checkpointing false``)."""
        screened = {k: v for k, v in args.items() if k in self._screened}
        screen_hf_values(screened)
        return super().parse_dict({k: v for k, v in args.items() if k not in screened},
                                  allow_extra_keys)

    def parse_args_into_dataclasses(self, args: Any = None, return_remaining_strings: bool = False,
                                    **kwargs: Any) -> tuple:
        """As transformers' (``args``: the command line, default ``sys.argv[1:]``), and a
        Hugging Face argument tessera does not take is refused naming why, not only as
        unused."""
        *outputs, remaining = super().parse_args_into_dataclasses(
            args, return_remaining_strings=True, **kwargs)
        remaining = screen_hf_flags(remaining, self._screened)
        if return_remaining_strings:
            return (*outputs, remaining)
        if remaining:
            raise ValueError(f"Some specified arguments are not used by the HfArgumentParser: "
                             f"{remaining}")
        return tuple(outputs)


def screen_hf_flags(remaining: list[str], screened: set[str]) -> list[str]:
    """``remaining`` without the ``--name [value]`` (and ``--no_name``) flags of Hugging
    Face arguments tessera does not take, each screened as its constructor screens it.

    Raises:
        ValueError: naming the first refused, and what to do instead.
    """
    flags = hf_bool_fields()
    kept, i = [], 0
    while i < len(remaining):
        token = remaining[i]
        name, has_value, value = token.removeprefix("--").partition("=")
        name = name.replace("-", "_")
        negated = name.startswith("no_") and name[3:] in screened and name[3:] in flags
        if not token.startswith("--") or not (name in screened or negated):
            kept.append(token)
            i += 1
            continue
        if negated:  # transformers' --no_<flag>: the flag at False
            name, given = name[3:], False
        else:
            if not has_value and i + 1 < len(remaining) and \
                    not remaining[i + 1].startswith("--"):
                value, has_value, i = remaining[i + 1], "=", i + 1
            # A bare flag asks for True; a value is text, read as a flag's only for flags.
            given = (True if not has_value else
                     _flag_value(value) if name in flags else value)
        try:
            screen_hf_values({name: given})
        except ValueError as err:
            raise ValueError(f"--{token.removeprefix('--').split('=')[0]}: {err}") from None
        i += 1
    return kept


def _flag_value(text: str) -> Any:
    """A flag's value as transformers' parser reads it (string_to_bool), None for none."""
    lowered = text.strip().lower()
    if lowered in ("", "none"):
        return None
    return lowered not in ("false", "no", "0", "f", "n")


def _is_model(cls: Any) -> bool:
    return isinstance(cls, type) and issubclass(cls, BaseModel)


def stand_in(model: type[BaseModel]) -> type:
    """A dataclass with ``model``'s fields, each defaulting to UNSET, that transformers'
    parser reads; calling it builds ``model`` from the arguments given."""

    def build(cls: type, **values: Any) -> BaseModel:
        given = {k: _from_text(model, k, v) for k, v in values.items() if v is not UNSET}
        # argparse gives None for list arguments not given: None is their default too
        given = {k: v for k, v in given.items()
                 if not (v is None and model.model_fields[k].default is None)}
        return model(**given)

    fields = [(name, _parser_type(name, info.annotation), dataclasses.field(default=UNSET))
              for name, info in model.model_fields.items()]
    shim = dataclasses.make_dataclass(f"{model.__name__}Fields", fields)
    shim.__new__ = build  # a call returns the model: __init__ is then not run
    return shim


def _from_text(model: type[BaseModel], name: str, value: Any) -> Any:
    """A dict field given as JSON text (Hugging Face's ``lr_scheduler_kwargs`` is)."""
    annotation = model.model_fields[name].annotation
    if isinstance(value, str) and dict in _members(annotation) and value.lstrip().startswith("{"):
        return json.loads(value)
    return value


def _members(annotation: Any) -> tuple:
    """The types of a union (``X | None`` too), or the annotation itself."""
    if typing.get_origin(annotation) in (Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def _parser_type(name: str, annotation: Any) -> Any:
    """The type transformers' parser handles for a pydantic annotation: optional where the
    field takes None; text for unions of other types and for dicts (parsed back)."""
    members = [m for m in _members(annotation) if m is not type(None)]
    optional = len(members) < len(_members(annotation))
    if name in _AS_TEXT or dict in members or len(members) > 1:
        kind: Any = str
    else:
        kind = members[0]
    if typing.get_origin(kind) is Literal or kind is bool:
        return kind  # choices / a flag: None is not among them
    return typing.Optional[kind] if optional else kind
