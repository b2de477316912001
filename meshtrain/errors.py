"""User-facing errors.

A `UserError` is a mistake in the input (config, mesh, layout, data path), not a bug.
The CLI prints its message as one paragraph and exits with status 2, without a
traceback. Messages say what was wrong, what was given, and how to fix it.

A `RunFailed` is a run that stopped for a reason found while training (non-finite
values, a checkpoint that could not be written): one paragraph and status 1.
"""


class UserError(Exception):
    """A bad config, mesh, layout or data argument; the message is the whole story."""


class RunFailed(Exception):
    """Training stopped on purpose: the message says at which step, why, and what is saved."""


def shown(value, limit: int = 40) -> str:
    """repr(value) for a message about bad input, cut after `limit` characters (the value
    may be a 10,000-digit variable or a stranger's record)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


MiB, GiB = 2**20, 2**30  # the byte units every message and report uses


def comma_list(key: str, text, names: tuple[str, ...], example: str) -> tuple[str, ...]:
    """A config value that is a comma list of `names`, each at most once ("" or "none":
    none): "a, b" -> ("a", "b"); else a UserError naming `key`, what is wrong and `example`."""
    given = tuple(n.strip().lower() for n in str(text).split(",") if n.strip())
    given = () if given == ("none",) else given
    unknown = [n for n in given if n not in names]
    if unknown or len(set(given)) != len(given):
        what = f"unknown {', '.join(map(repr, unknown))}" if unknown else "a name given twice"
        raise UserError(f"{key}={text!r}: {what}. Give a comma list of {', '.join(names)} (or none), "
                        f"e.g. --config.{key}={example}.")
    return given


def gib(nbytes: float) -> str:
    """Bytes as a message says them: GiB (MiB below one GiB), three significant figures or more."""
    if nbytes < GiB:
        return mib(nbytes)
    return f"{nbytes / GiB:,.2f} GiB" if nbytes < 10 * GiB else f"{nbytes / GiB:,.1f} GiB"


def mib(nbytes: float) -> str:
    """Bytes in MiB to a tenth, as the planner's figures are set side by side."""
    return f"{nbytes / MiB:,.1f} MiB"


def warn(message: str) -> None:
    """`meshtrain: warning: MESSAGE` on stderr, once per run (process 0 only)."""
    import sys

    import jax
    if jax.process_index() == 0:
        print(f"meshtrain: warning: {message}", file=sys.stderr, flush=True)


def run_command(run, argv, prog: str, ended: dict | None = None) -> int:
    """`run(argv)`'s exit status; a UserError becomes `PROG: error: MESSAGE` and status 2,
    a RunFailed the same message and status 1, Ctrl-C one line and status 130. `ended["message"]` receives that message."""
    import sys
    try:
        return run(sys.argv[1:] if argv is None else argv)
    except KeyboardInterrupt:  # Ctrl-C where no handler of ours saves anything: say so, no traceback
        print(f"{prog}: interrupted (Ctrl-C); nothing was saved.", file=sys.stderr, flush=True)
        if ended is not None:
            ended["message"] = "interrupted (Ctrl-C)"
        return 130
    except (UserError, RunFailed) as e:
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        if ended is not None:
            ended["message"] = str(e)
        return 2 if isinstance(e, UserError) else 1
