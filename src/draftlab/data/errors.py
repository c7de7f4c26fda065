"""The one exception type the data layer raises for bad input, with a location a user can open."""

from __future__ import annotations

from pathlib import Path


class DataError(ValueError):
    """Bad or unusable input data.

    The message is prefixed with where the problem is, as ``file:line: field 'x': message``; parts that
    are unknown are left out. ``record`` is for sources without meaningful line numbers (a JSON array,
    a datasets row) and renders as ``file: record N``. The parts stay available as attributes so callers
    can collect errors instead of parsing messages.
    """

    def __init__(
        self,
        message: str,
        *,
        file: str | Path | None = None,
        line: int | None = None,
        field: str | None = None,
        record: int | None = None,
    ) -> None:
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
