"""Options declared once: a dataclass field made with :func:`option` is a typed command-line option.

The field holds everything about one option: its type (the annotation), default, flag, help,
choices, valid range (a :class:`Check`) and whether a resume must keep its value. The engine's
options (``trainbridge.training.config.TrainConfig``) and each task's own (``Task.Options``) are
declared so; ``trainbridge train``'s parser, its range checks and the options a resume compares
are all read from the declarations (:func:`add_to_parser`, :func:`check_values`, :func:`resume_kept`).

    @dataclasses.dataclass
    class Options:
        noise: float = option(0.05, help="standard deviation of the label noise (default: {default})",
                              check=at_least(0), same_on_resume=True)

A field's type is ``int``, ``float``, ``str``, ``bool`` (a switch, off by default) or any class built
from one string (``pathlib.Path``), each possibly ``Optional[...]`` (None: not given).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import typing
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from ..errors import UserError


@dataclasses.dataclass(frozen=True)
class Check:
    """A valid value: ``ok(value)`` holds; else ``--flag must be <must> (got value[; note])[why]``."""

    ok: Callable[[Any], bool]
    must: str
    note: str = ""
    why: str = ""

    def problem(self, flag: str, value: Any) -> Optional[str]:
        """The error line for ``value``, or None when it is valid (None itself always is: not given)."""
        if value is None or self.ok(value):
            return None
        return f"{flag} must be {self.must} (got {value}{'; ' + self.note if self.note else ''}){self.why}"


def at_least(low: float, note: str = "", why: str = "") -> Check:
    return Check(lambda value: value >= low, f"at least {low}", note, why)


def positive_finite() -> Check:
    return Check(lambda value: value > 0 and math.isfinite(value), "a positive finite number")


@dataclasses.dataclass(frozen=True)
class Option:
    """How one dataclass field appears on the command line; made by :func:`option`."""

    help: Optional[str] = None
    flag: Optional[str] = None
    choices: Optional[Sequence[str]] = None
    metavar: Optional[str] = None
    check: Optional[Check] = None
    same_on_resume: bool = False
    group: Optional[str] = None


def option(
    default: Any,
    help: Optional[str] = None,
    *,
    flag: Optional[str] = None,  # noqa: A002 - argparse's word
    choices: Optional[Sequence[str]] = None,
    metavar: Optional[str] = None,
    check: Optional[Check] = None,
    same_on_resume: bool = False,
    group: Optional[str] = None,
) -> Any:
    """A dataclass field that is a command-line option.

    ``help`` may name its default as ``{default}``; ``flag`` defaults to ``--the-field-name``;
    ``check`` is the valid range, checked before any process group starts; ``same_on_resume``: the
    option changes what training computes, so a resume with another value is refused (unless
    ``--allow-option-changes``); ``group`` titles a section of ``--help``.
    """
    declared = Option(
        help, flag, tuple(choices) if choices is not None else None, metavar, check, same_on_resume, group
    )
    return dataclasses.field(default=default, metadata={"option": declared})


def declared(options_class: type) -> Iterator[Tuple[dataclasses.Field, Option]]:
    """The fields of ``options_class`` made with :func:`option`, in their order, each with its declaration."""
    for field in dataclasses.fields(options_class):
        if "option" in field.metadata:
            yield field, field.metadata["option"]


def flag_of(field: dataclasses.Field) -> str:
    return field.metadata["option"].flag or "--" + field.name.replace("_", "-")


def flags(options_class: type) -> Dict[str, str]:
    """Each declared option's flag, by field name."""
    return {field.name: flag_of(field) for field, _ in declared(options_class)}


def resume_kept(options_class: type) -> Tuple[str, ...]:
    """The names of the options a resume must keep (``same_on_resume``)."""
    return tuple(field.name for field, declaration in declared(options_class) if declaration.same_on_resume)


def shown(default: Any) -> str:
    """A default as help shows it: 300.0 as 300."""
    return str(int(default)) if isinstance(default, float) and default.is_integer() else str(default)


def value_type(annotation: Any) -> Any:
    """``int`` for ``int`` and ``Optional[int]``: what one value on the command line becomes."""
    if typing.get_origin(annotation) is typing.Union:
        kinds = [kind for kind in typing.get_args(annotation) if kind is not type(None)]
        if len(kinds) == 1:
            return kinds[0]
    return annotation


def add_to_parser(
    parser: argparse.ArgumentParser,
    options_class: type,
    title: Optional[str] = None,
    suppress_defaults: bool = False,
    skip: Sequence[str] = (),
) -> List[str]:
    """Add ``options_class``'s declared options to ``parser`` (in a group titled ``title``, or each in its
    declaration's ``group``); returns their field names. ``suppress_defaults``: an option not given is left out
    of the parsed namespace. Flags in ``skip`` are left out."""
    hints = typing.get_type_hints(options_class)
    groups: Dict[Optional[str], Any] = {None: parser.add_argument_group(title) if title else parser}
    added = []
    for field, declaration in declared(options_class):
        flag = flag_of(field)
        if flag in skip:
            continue
        default = field.default
        kind = value_type(hints[field.name])
        text = declaration.help.replace("{default}", shown(default)) if declaration.help else declaration.help
        settings: Dict[str, Any] = {
            "dest": field.name,
            "help": text,
            "default": argparse.SUPPRESS if suppress_defaults else default,
        }
        if kind is bool:
            settings["action"] = argparse.BooleanOptionalAction if default else "store_true"
        else:
            if kind is not str:
                settings["type"] = kind
            if declaration.choices is not None:
                settings["choices"] = list(declaration.choices)
            if declaration.metavar:
                settings["metavar"] = declaration.metavar
        group_title = None if title else declaration.group
        if group_title not in groups:
            groups[group_title] = parser.add_argument_group(group_title)
        groups[group_title].add_argument(flag, **settings)
        added.append(field.name)
    return added


def check_values(options: Any) -> None:
    """Raise UserError, naming the flag and the value, for the first declared option outside its range."""
    for field, declaration in declared(type(options)):
        if declaration.check is not None:
            problem = declaration.check.problem(flag_of(field), getattr(options, field.name))
            if problem:
                raise UserError(problem)
