"""The failures distill reports to its user as one line, and how (``distill.__main__`` prints them).

A ``UserError``'s message is the whole report: it names the key, the process or the file, and
the fix. The entry point prints it on stderr and exits with ``exit_code``, without a traceback
unless ``HYDRA_FULL_ERROR=1`` or ``log_level=DEBUG`` asks for one. Importing this is free (no torch).
"""

from __future__ import annotations

INTERRUPTED = "interrupted; run the same command to resume"
INTERRUPTED_EXIT_CODE = 130
"""128 + SIGINT, as shells report a Ctrl-C."""


class UserError(Exception):
    """A failure the user can act on, reported as its message alone."""

    exit_code = 1


class ConfigError(UserError, ValueError):
    """A setting that cannot work, found before any process starts; the message names the key and the fix."""

    exit_code = 2


class ChildFailed(UserError, RuntimeError):
    """A process of a ``mode=local`` job exited early; the message names it and its last error line."""


class BrokerNotFound(UserError, ConnectionError):
    """No broker answers at the endpoint a client was given (``mode=stats``); the message names
    the endpoint and how long it was asked."""
