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


def warn(message: str) -> None:
    """`meshtrain: warning: MESSAGE` on stderr, once per run (process 0 only)."""
    import sys

    import jax
    if jax.process_index() == 0:
        print(f"meshtrain: warning: {message}", file=sys.stderr, flush=True)


def run_command(run, argv, prog: str) -> int:
    """`run(argv)`'s exit status; a UserError becomes `PROG: error: MESSAGE` and status 2,
    a RunFailed the same message and status 1."""
    import sys
    try:
        return run(sys.argv[1:] if argv is None else argv)
    except UserError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except RunFailed as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
