"""The command-line convention every meshtrain command shares (argparse, one module).

    def parser():
        p = cli.command_parser("meshtrain plan", __doc__, config=True)
        p.add_argument("--hardware", default="h100", help="...")
        return p
    def execute(args): ...        # args.config: the locked config, overrides applied
    run, main = cli.entry_points(parser, execute)   # run(argv) raises UserError; main prints it

What every command gets:
  --help, -h          usage, every flag with its default and one line of help; exit 0.
                      With --config=NAME (config commands) it also prints the resolved
                      config: the keys as the run reads them, overrides applied.
  --print_config      (config commands) the resolved config alone; exit 0.
  --config=NAME       (config commands) a file in configs/ or a path to a .py file with
  --config.KEY=VALUE  get_config(); any key overridden, `--config.KEY VALUE` and
  --noconfig.KEY      `--noconfig.KEY` (false) too, each value parsed to the key's type.
  errors              bad input is `PROG: error: ONE PARAGRAPH` on stderr and status 2 (a
                      RunFailed status 1), never a traceback (errors.run_command).

Why argparse and not absl flags with ml_collections' config_flags (the JAX ecosystem's
convention): absl keeps one global flag registry per process, so two commands cannot
define their flags side by side (the `meshtrain` console script imports several, tests
run them in-process); its --help lists absl's own logging flags beside ours; and
config_flags takes a file path and reports unknown keys in its own words, where meshtrain
takes config names and answers with the closest keys. argparse is in the standard
library and gives --help and subcommands; the --config.KEY overrides stay meshtrain's
own (config.override), so they behave alike in every command. docs/architecture.md.
"""

from __future__ import annotations

import argparse
import gc
import sys
import textwrap

from meshtrain import config as config_lib
from meshtrain.errors import UserError, run_command

# Python's cyclic collector for a command (and the test processes): gen0 at 10,000
# allocations, not 700. Tracing and lowering allocate millions of small objects, and at 700
# the collector's passes over the heap of JAX, Flax and Orbax took about 7% of a short run
# (gpt2_tiny_dp8, 3 steps, cache warm: 3.3 -> 3.1 s wall, 3 runs each), at the same peak
# memory.
GC_THRESHOLDS = (10_000, 10, 10)


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults after each flag's help; the description's own line breaks kept."""

    def _get_help_string(self, action):
        # "(default: None)" and "(default: False)" say nothing; a required flag has none.
        if action.default in (None, False, argparse.SUPPRESS) or action.required:
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are UserErrors (one paragraph, status 2)."""

    def __init__(self, *args, takes_config: bool = False, takes_overrides: bool = False, **kwargs):
        kwargs.setdefault("formatter_class", _Formatter)
        kwargs.setdefault("allow_abbrev", False)  # --work would silently mean --workdir
        super().__init__(*args, **kwargs)
        self.takes_config = takes_config
        self.takes_overrides = takes_config or takes_overrides

    def error(self, message: str):
        raise UserError(f"{message[0].upper()}{message[1:]}. `{self.prog} --help` lists the flags.")


def command_parser(prog: str, doc: str | None, *, config: bool = False, overrides: bool = False) -> Parser:
    """A command's parser: its docstring's first paragraph as the description. With
    `config`, the --config flags every config command shares; with `overrides` alone,
    --config.KEY=VALUE overrides of a config the command finds itself (a run's), left
    in `args.overrides` as [(key, value)]."""
    description = (doc or "").strip().split("\n\n")[0]
    epilog = None
    if config:
        epilog = ("Any config key can be overridden: --config.KEY=VALUE (e.g. --config.train.steps=20, "
                  "--config.mesh.shape=data:2,tensor:4), or --noconfig.KEY for false. "
                  "--config=NAME --help also prints the resolved config.")
    elif overrides:
        epilog = ("Keys of the run's config can be overridden: --config.KEY=VALUE (e.g. "
                  "--config.data.kind=text --config.data.path=FILE), or --noconfig.KEY for false.")
    if epilog:  # the formatter keeps line breaks as written, so break the lines here
        epilog = textwrap.fill(epilog, 88)
    p = Parser(prog=prog, description=description, epilog=epilog, takes_config=config,
               takes_overrides=overrides)
    if config:
        p.add_argument("--config", metavar="NAME",
                       help=f"a config in configs/ ({', '.join(config_lib.available()[:3])}, ...; "
                            f"`meshtrain configs` lists them) or a path to a .py file with get_config()")
        p.add_argument("--print_config", action="store_true",
                       help="print the resolved config (overrides applied) and exit")
    return p


def split_overrides(argv: list[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """argv -> (the rest, [(key, value)] of --config.KEY=VALUE / --config.KEY VALUE /
    --noconfig.KEY). A bare --config.KEY followed by another flag (or nothing) is true."""
    rest, overrides, args = [], [], list(argv)
    while args:
        arg = args.pop(0)
        if arg == "--":
            rest += [arg, *args]
            break
        flag, sep, value = arg.partition("=")
        if flag.startswith("--noconfig."):
            overrides.append((flag[len("--noconfig."):], "false"))
        elif flag.startswith("--config."):
            if not sep:
                value = args.pop(0) if args and not args[0].startswith("--") else "true"
            overrides.append((flag[len("--config."):], value))
        else:
            rest.append(arg)
    return rest, overrides


def load_config(name: str | None, overrides: list[tuple[str, str]], prog: str):
    """The locked config `name` names, with `overrides` applied; a UserError without a name."""
    if not name:
        raise UserError(f"No --config given. Usage: {prog} --config=NAME [--config.key=value ...]; "
                        f"names: {', '.join(config_lib.available())} (or a path to a .py file).")
    return config_lib.load(name, overrides)


def parse(parser: Parser, argv: list[str]) -> argparse.Namespace | None:
    """Parses argv; None when --help or --print_config was answered (print only).
    A config command's namespace gains `config` (the locked config, overrides applied),
    `config_name` and `overrides`."""
    wants_help = any(a in ("-h", "--help") for a in argv)
    rest, overrides = split_overrides(argv) if parser.takes_overrides else (list(argv), [])
    if wants_help and parser.takes_config:
        parser.print_help()
        known, _ = parser.parse_known_args([a for a in rest if a not in ("-h", "--help")])
        if known.config:
            print("\n" + describe_config(known.config, load_config(known.config, overrides, parser.prog),
                                         overrides))
        return None
    if wants_help:  # argparse answers, a subcommand's own help included (`convert to_hf -h`)
        try:
            parser.parse_args(rest)
        except SystemExit as e:
            if e.code:
                raise
        return None
    args = parser.parse_args(rest)
    args.prog, args.argv = parser.prog, list(argv)  # the command as given, e.g. for a resume line
    args.overrides = overrides
    if parser.takes_config:
        args.config_name = args.config
        args.config = load_config(args.config, overrides, parser.prog)
        if args.print_config:
            print(describe_config(args.config_name, args.config, overrides))
            return None
    return args


def describe_config(name: str, cfg, overrides) -> str:
    """The config as the run reads it, one `key = value` a line; init.from resolved (the
    model and tokenizer a checkpoint implies), and model dims left to model.size shown
    with the value the size gives them."""
    from meshtrain import models
    from meshtrain.checkpoints import init_from
    from meshtrain.run.experiment import resolve
    init = init_from.read(cfg.init["from"]) if cfg.init["from"] else None
    cfg = resolve(cfg, init)
    sized = {}
    if init is None:
        try:
            sized = models.size_dims(cfg.model)
        except UserError:
            pass  # validation says what is wrong with the model keys; print what was given
    keys = config_lib.keys(cfg)
    width = max(map(len, keys))
    head = f"# --config={name}" + (f" with {len(overrides)} override(s)" if overrides else "")
    if init is not None:
        head += f"; model and tokenizer from init.from ({init.source})"
    lines = [head]
    for key in keys:
        value = config_lib.get(cfg, key)
        note = ""
        if value is None and key.startswith("model.") and key[len("model."):] in sized:
            note = f"  # {sized[key[len('model.'):]]!r} from model.size={cfg.model.size!r}"
        lines.append(f"{key:<{width}} = {value!r}{note}")
    return "\n".join(lines)


def entry_points(parser, execute):
    """A command's `run(argv)` (raises UserError: for tests and notebooks) and
    `main(argv=None, prog=None)` (prints it, status 2: for the command line), from its
    `parser()` factory and `execute(args)`."""
    def command_run(argv: list[str]) -> int:
        return run(execute, parser(), argv)

    def command_main(argv: list[str] | None = None, prog: str | None = None) -> int:
        return main(execute, parser(), argv, prog)
    return command_run, command_main


def run(execute, parser: Parser, argv: list[str]) -> int:
    """Parses argv with `parser` and returns execute(args); a UserError propagates (the
    commands' `run(argv)`, which tests and notebooks call)."""
    args = parse(parser, list(argv))
    return 0 if args is None else execute(args)


def main(execute, parser: Parser, argv: list[str] | None, prog: str | None = None,
         ended: dict | None = None) -> int:
    """`run`, with user errors as one paragraph and status 2 (the commands' `main`);
    `prog` names the command as the console script calls it."""
    if prog:
        parser.prog = prog
    gc.set_threshold(*GC_THRESHOLDS)
    return run_command(lambda a: run(execute, parser, a), sys.argv[1:] if argv is None else argv,
                       parser.prog, ended)
