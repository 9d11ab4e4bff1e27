"""The one base class for errors a user can act on. The CLI prints them as one line and exits with
exit_code; anything else is a bug and keeps its traceback."""


class UserError(Exception):
    """Bad input or an unusable environment; the message names the problem."""

    exit_code = 2


class JobFailed(UserError):
    """The job ran and its result is a failure (for instance parity outside tolerance)."""

    exit_code = 1
