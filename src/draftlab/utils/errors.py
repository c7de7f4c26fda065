"""User errors: bad input a user can fix, with where it is (file, line, field), shown as one line at the CLI.

Every layer raises a subclass of ``UserError`` for a mistake in what it was given (``data.errors.DataError``
for data files, ``ConfigError`` for settings); the command-line entry points print ``error: <message>`` on
stderr and exit with code 2 (``cli.report_user_errors``); ``DRAFTLAB_DEBUG=1`` shows the traceback instead.
Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

from pathlib import Path


class UserError(ValueError):
    """Bad input, located: the message reads ``file:line: field 'x': message`` (unknown parts left out).

    ``record`` is for sources without meaningful line numbers (a JSON array, a datasets row) and renders as
    ``file: record N``. The parts stay available as attributes so callers can collect errors instead of
    parsing messages.
    """

    def __init__(self, message: str, *, file: str | Path | None = None, line: int | None = None,
                 field: str | None = None, record: int | None = None) -> None:
        self.message = message
        self.file = None if file is None else str(file)
        self.line = line
        self.field = field
        self.record = record
        super().__init__(self._format())

    def _format(self) -> str:
        where = ""
        if self.file is not None:
            where = self.file
            if self.line is not None:
                where += f":{self.line}"
        elif self.line is not None:
            where = f"line {self.line}"
        if self.record is not None:
            where = f"{where}: record {self.record}" if where else f"record {self.record}"
        parts = [where] if where else []
        if self.field is not None:
            parts.append(f"field '{self.field}'")
        parts.append(self.message)
        return ": ".join(parts)


class ConfigError(UserError):
    """A setting that cannot work: unknown, unread or out of range (``field`` is its dotted path)."""


class ArtifactError(UserError):
    """A saved artifact (draft export, checkpoint) that is corrupt or does not fit what it is used with
    (``file`` is the file read, ``field`` the entry that disagrees)."""
