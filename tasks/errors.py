"""Errors that mean "the input is wrong": the CLI turns them into one line and exit status 2."""


class UserInputError(ValueError):
    """Bad input from a user: a profile field, a CLI value, an unreachable target."""


class InfeasibleError(UserInputError):
    """No plan meets the deadline; carries the fastest time any plan reaches."""

    def __init__(self, message: str, fastest_time_s: float | None = None):
        super().__init__(message)
        self.fastest_time_s = fastest_time_s
