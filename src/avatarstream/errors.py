"""The one error type a user can cause. The CLI prints its message and exits non-zero."""


class AvatarStreamError(Exception):
    """A problem the user can fix (bad file, wrong path, unknown model...). Message says what to do."""

    exit_code = 2


class InputError(AvatarStreamError):
    """An input file is missing, unreadable, empty, or of the wrong kind."""


class OutputError(AvatarStreamError):
    """The output cannot be written where asked."""


class ConfigError(AvatarStreamError):
    """An option or model name is not valid."""
