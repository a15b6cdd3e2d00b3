"""User-facing errors: the CLIs print ``str(err)`` as one line and exit with status 2."""


class SpecBlockError(Exception):
    """Bad input or configuration: the message says what to fix."""
