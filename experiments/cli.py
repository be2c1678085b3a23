"""The error boundary of the entry points: `cli.run(main)` in place of absl's `app.run(main)`.

Bad input ends a run with one line, `error: <message>`, on stderr and exit status 2: a ValueError,
FileNotFoundError or `app.UsageError` raised by `main`, or a flag that does not parse or fails its validator.
`--verbose` prints the full traceback instead (same status). Ctrl-C exits 130 with one line. Any other exception
is a bug and keeps absl's behaviour and its traceback; this module does not turn bugs into one-liners.
"""

from __future__ import annotations

import functools
import sys
import traceback

from absl import app, flags

VERBOSE = flags.DEFINE_boolean("verbose", False, "On bad input, print the full traceback instead of one line.")

BAD_INPUT = (ValueError, FileNotFoundError, app.UsageError)
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C


def one_line(error: BaseException) -> str:
    """The message of `error` on one line (multi-line messages joined with '; ')."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return "; ".join(lines) or type(error).__name__


def _verbose() -> bool:
    return flags.FLAGS.is_parsed() and VERBOSE.value


def _fail(error: BaseException, status: int, message: str | None = None):
    if _verbose():
        traceback.print_exception(error)
    else:
        print(message or f"error: {one_line(error)}", file=sys.stderr, flush=True)
    sys.exit(status)


def _parse_flags(argv):
    """absl's parse_flags_with_usage with the one-line error: `flag --x=y: <why>`."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        _fail(e, EXIT_BAD_INPUT)


def _guard(main):
    @functools.wraps(main)
    def guarded(argv):
        try:
            return main(argv)
        except BAD_INPUT as e:  # caught here, inside app.run, which would print its usage text for a UsageError
            _fail(e, EXIT_BAD_INPUT)

    return guarded


def run(main, argv=None):
    """app.run(main, argv) behind the error boundary of the module docstring."""
    try:
        app.run(_guard(main), argv=argv, flags_parser=_parse_flags)
    except KeyboardInterrupt as e:
        _fail(e, EXIT_INTERRUPTED, "interrupted")
