"""The error boundary of the entry points: `cli.run(main)` in place of absl's `app.run(main)`.

Bad input ends a run with one line, `error: <message>`, on stderr and exit status 2: a ValueError,
FileNotFoundError, `app.UsageError` or a missing data package (`kascade_jax.tasks.packages.MissingPackageError`)
raised by `main`, or a flag that does not parse or fails its validator.
`--verbose` prints the full traceback instead (same status). Ctrl-C exits 130 with one line. Any other exception
is a bug and keeps absl's behaviour and its traceback; this module does not turn bugs into one-liners.

`--help` (`-h`, `-?`, `--helpshort`) prints every flag of the project's modules the command uses (its own, the
shared ones of experiments.common / recipe_flags / timing, `--verbose`), not only the main module's, and exits 0;
`--helpfull` adds absl's and the libraries' flags. `deprecated_alias` keeps an old flag name working with a warning.
"""

from __future__ import annotations

import functools
import sys
import traceback

from absl import app, flags

VERBOSE = flags.DEFINE_boolean("verbose", False, "On bad input, print the full traceback instead of one line.")
OVERWRITE = flags.DEFINE_boolean("overwrite", False, "Replace the results an earlier run left at this command's "
                                 "output path (without it, such a path is refused before any work)")

from kascade_jax.tasks.packages import MissingPackageError  # noqa: E402  (stdlib only: cheap)

BAD_INPUT = (ValueError, FileNotFoundError, app.UsageError, MissingPackageError)
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C


def check_output(paths, flag: str) -> None:
    """Refuse, before any work, to write over result files that exist unless --overwrite (no result is ever
    replaced silently; default outputs live under the git-ignored runs/), and a folder the files cannot be written
    into (created now if missing), so a run does not fail at its end."""
    import os  # noqa: PLC0415

    from kascade_jax.eval.report import check_writable  # noqa: PLC0415

    held = [str(p) for p in paths if os.path.exists(p)]
    if held and not OVERWRITE.value:
        raise ValueError(f"{flag} would replace {', '.join(held[:3])}{', ...' if len(held) > 3 else ''}: pass "
                         f"--overwrite to replace them, or choose another {flag}")
    for folder in dict.fromkeys(os.path.dirname(os.path.abspath(p)) for p in paths):
        check_writable(folder, f"{flag}: the folder")


def number_list(name: str, kind: str, example: str) -> None:
    """Validate the list flag --name at parsing: every item a positive integer (kind "int") or a number in (0, 1]
    (kind "frac"); otherwise one line naming the flag, before any work."""
    def ok(values):
        try:
            return all(int(v) > 0 if kind == "int" else 0 < float(v) <= 1 for v in values)
        except ValueError:
            return False

    what = {"int": "positive integers", "frac": "numbers in (0, 1]"}[kind]
    flags.register_validator(name, ok, message=f"--{name} takes {what}, e.g. {example}")


def read_text_file(path: str, flag: str) -> str:
    """A UTF-8 text file given by `flag`, with one clear line for a missing, unreadable or binary file."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise ValueError(f"{flag}: no file at {path!r}") from None
    except IsADirectoryError:
        raise ValueError(f"{flag}: {path!r} is a directory, not a text file") from None
    except UnicodeDecodeError:
        raise ValueError(f"{flag}: {path!r} is not UTF-8 text (a binary file?)") from None
    except OSError as e:
        raise ValueError(f"{flag}: cannot read {path!r}: {e.strerror or e}") from None


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


_ALIASES: dict[str, str] = {}  # deprecated flag name -> its current name


def deprecated_alias(old: str, new: str) -> None:
    """Define --old as a deprecated spelling of the already defined --new: given, it prints a warning and sets
    --new (giving both is an error). An --old that some module already defines is a programming error (the alias
    would silently do nothing): a ValueError naming that module."""
    if old in flags.FLAGS:
        owner = flags.FLAGS.find_module_defining_flag(old) or "another module"
        raise ValueError(f"deprecated_alias({old!r}, {new!r}): --{old} is already defined by {owner}; the alias "
                         f"would never set --{new}. Rename one of them")
    if new not in flags.FLAGS:
        raise ValueError(f"deprecated_alias({old!r}, {new!r}): define --{new} first")
    flags.DEFINE_string(old, None, f"deprecated: use --{new}")
    _ALIASES[old] = new


def _apply_aliases():
    for old, new in _ALIASES.items():
        if old in flags.FLAGS and flags.FLAGS[old].present:
            if flags.FLAGS[new].present:
                raise flags.Error(f"give --{new} only (--{old} is its deprecated spelling)")
            print(f"warning: --{old} is deprecated, use --{new}", file=sys.stderr, flush=True)
            flags.FLAGS[new].parse(flags.FLAGS[old].value)
            flags.FLAGS.validate_all_flags()


HELP_ARGS = ("--help", "-h", "-?", "--helpshort")


def help_text(argv0: str | None = None) -> str:
    """Usage of the running command: its docstring's first line, then the flags of every project module it loaded
    (the command's own first), deprecated aliases left out."""
    main_mod = sys.modules.get("__main__")
    doc = (getattr(main_mod, "__doc__", None) or "").strip().splitlines()
    by_module = flags.FLAGS.flags_by_module_dict()
    ours = [m for m in by_module if ("/experiments/" in m and m.endswith(".py")) or m.startswith("experiments")]
    main_path = getattr(main_mod, "__file__", None) or argv0 or ""
    ours.sort(key=lambda m: (not main_path.endswith(m.split("experiments")[-1].replace(".", "/") + ".py")
                             and m != main_path, m))
    out = [doc[0] if doc else "", ""] if doc else []
    for m in ours:
        fl = sorted((f for f in by_module[m] if f.name not in _ALIASES), key=lambda f: f.name)
        if not fl:
            continue
        out.append(f"{m}:")
        for f in fl:
            default = "" if f.default is None else f" (default: {f.default_as_str})"
            out.append(f"  --{'[no]' if f.boolean else ''}{f.name}: {f.help}{default}")
    out += ["", "Try --helpfull to list absl's and the libraries' flags too."]
    return "\n".join(out)


def _parse_flags(argv):
    """absl's parse_flags_with_usage with the one-line error: `flag --x=y: <why>`; --help exits 0."""
    args = list(argv[1:])
    if "--" in args:
        args = args[: args.index("--")]
    if any(a in HELP_ARGS for a in args):
        print(help_text(argv[0]))
        sys.exit(0)
    try:
        rest = flags.FLAGS(argv)
        _apply_aliases()
        return rest
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
