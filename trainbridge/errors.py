"""The one exception type that means "the user asked for something we cannot do".

Entry points catch it and print its message as a single line, with no traceback,
then exit with status 2. The message names the problem and the fix.
"""


class UserError(Exception):
    """Bad input or a bad environment: reported as one line, never as a traceback.

    ``quiet=True`` marks a copy of an error another rank already reported.
    """

    def __init__(self, message: str, quiet: bool = False) -> None:
        super().__init__(message)
        self.quiet = quiet


def first_line(exc: BaseException | str, limit: int = 300) -> str:
    """The first line of an exception's message, or its type's name (collective errors can run to pages)."""
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:limit]
