"""The one exception type the data layer raises for bad input, with a location a user can open."""

from __future__ import annotations

from draftlab.utils.errors import UserError


class DataError(UserError):
    """Bad or unusable input data (a ``UserError``: ``file:line: field 'x': message``)."""
