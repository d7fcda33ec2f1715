"""Errors that mean "the input is wrong": the CLI turns them into one line and exit status 2."""


SHOWN_CHARS = 120  # of a user's text echoed into an error line: a 4 KB path would bury the message


def shown(text: object, limit: int = SHOWN_CHARS) -> str:
    """User text (a path, a value) as an error line may echo it: characters that are not printable
    (a newline, a control character) escaped as Python writes them, and past `limit` characters
    cut, saying how long it was, so that an error stays one readable line."""
    text = str(text)
    escaped = text if text.isprintable() else repr(text)[1:-1]
    if len(escaped) <= limit:
        return escaped
    return f"{escaped[:limit]}... ({len(text)} characters)"


def error_line(err: BaseException | None) -> str | None:
    """An exception as one line (its type and the first line of its message), None for none: what
    a long run records of a part that failed while the rest goes on."""
    return None if err is None else f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:300]}"


class UserInputError(ValueError):
    """Bad input from a user: a profile field, a CLI value, an unreachable target."""


class InfeasibleError(UserInputError):
    """No plan meets the deadline; carries the fastest time any plan reaches."""

    def __init__(self, message: str, fastest_time_s: float | None = None):
        super().__init__(message)
        self.fastest_time_s = fastest_time_s


def one_line(err: BaseException) -> str:
    """The message of an error bad input caused, as one line naming the problem."""
    if isinstance(err, UnicodeDecodeError):
        return f"input is not UTF-8 text (byte {err.object[err.start:err.start + 1]!r} at offset {err.start})"
    if isinstance(err, OSError) and err.strerror:
        where = f": {shown(err.filename)}" if err.filename is not None else ""
        return f"{err.strerror}{where}"
    if isinstance(err, RecursionError):
        return "input nested too deeply (JSON or YAML deeper than Python can read)"
    if isinstance(err, OverflowError):
        return f"a number is out of range ({err})"
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= 400 else text[:400] + "..."
