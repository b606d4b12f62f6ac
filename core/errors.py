"""Errors a user can fix: the CLI prints them as one line, the dashboard as a message box."""


class UserError(Exception):
    """Bad input or an environment the run cannot use; the message says what to do."""


class EngineError(RuntimeError):
    """A backend worker failed or died while loading or scoring."""
