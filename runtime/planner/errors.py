"""The one error type of the planner."""

from __future__ import annotations


class PlanError(ValueError):
    """A spec or architecture the planner cannot work with.

    `reason` is a CamelCase word for a status condition; the message says what is wrong and
    how to fix it.
    """

    def __init__(self, message: str, reason: str = "InvalidSpec") -> None:
        super().__init__(message)
        self.reason = reason
