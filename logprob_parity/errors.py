"""Errors a user can fix or must be told about: the CLI prints them as one line (exit 2 for a
UserError, 3 for an EngineError), the dashboard as a message box that is visible at once."""


class UserError(Exception):
    """Bad input or an environment the run cannot use; the message says what to do."""


class EngineError(RuntimeError):
    """A backend host failed or died while loading or scoring."""


class ProtocolError(EngineError):
    """A host answered out of turn: a request before its engine loaded, or an unknown request."""


class TokenMismatchError(EngineError):
    """A backend scored other token ids than the run's: its numbers cannot be compared."""
