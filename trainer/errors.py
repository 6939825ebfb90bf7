"""The trainer's user errors, each a `UserError` (models/errors.py) so one `except UserError` catches them all, and
`RunFailed`, the one failure that is not the user's mistake but still ends in one line (summary.json says how)."""

from __future__ import annotations

from models.errors import UserError


class ConfigError(UserError):
    """A bad configuration value."""


class PolicyError(UserError):
    """A policy or plan this model cannot take."""


class DataError(UserError):
    """A corpus, tokenizer or data setting that cannot be used."""


class RunFailed(RuntimeError):
    """The run started and then failed; summary.json holds `status` ("oom" | "error") and what it reached."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(message)
        self.status = status


__all__ = ["ConfigError", "DataError", "PolicyError", "RunFailed", "UserError"]
