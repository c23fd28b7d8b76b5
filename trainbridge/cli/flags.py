"""The library's errors in the command line's words.

Library errors name the arguments of ``tb.init`` and ``job.prepare`` as a script writes them
(``dist_backend="gloo"``); ``trainbridge train`` takes the same settings as flags
(``--dist-backend gloo``), so its errors name the flags instead.
"""

from __future__ import annotations

import dataclasses
import re

from ..api.files import ELSEWHERE
from ..errors import UserError
from ..training.config import TrainConfig

OPTIONS = {field.name for field in dataclasses.fields(TrainConfig)}
# name="value", name='value', or name=value (a number, True): one argument as Python spells it.
ARGUMENT = re.compile(r"""\b([a-z_]+)=(?:"([^"]*)"|'([^']*)'|([\w.+-]+))""")
# --flag a or --flag b: the flag once (--flag a or b).
ALTERNATIVE = re.compile(r"(--[a-z-]+) (\S+) or \1 ")
# Phrases of the library whose command-line form is a flag: trainbridge train writes its checkpoints in
# --output-dir, so a write that failed there is fixed by another one.
PHRASES = {ELSEWHERE: "pass another --output-dir"}


def flag(match: re.Match) -> str:
    name = match.group(1)
    if name not in OPTIONS:
        return match.group(0)
    value = next(group for group in match.groups()[1:] if group is not None)
    dashed = "--" + name.replace("_", "-")
    return dashed if value == "True" else f"{dashed} {value}"


def in_cli_words(message: str) -> str:
    """``message`` with every argument that is also an option of trainbridge train written as that flag."""
    message = ALTERNATIVE.sub(r"\1 \2 or ", ARGUMENT.sub(flag, message))
    for library, command_line in PHRASES.items():
        message = message.replace(library, command_line)
    return message


def cli_error(exc: BaseException) -> BaseException:
    """A library UserError as the command line reports it; any other exception as it is."""
    if isinstance(exc, UserError):
        translated = UserError(in_cli_words(str(exc)), quiet=exc.quiet)
        translated.__cause__ = exc
        return translated
    return exc
