"""`meshtrain COMMAND [flags]`, the console script; `python -m meshtrain` lists the commands.

Each command is also `python -m meshtrain.COMMAND` (prepare: `python -m
meshtrain.data.prepare`); both forms run the same `main(argv)`.
"""

from __future__ import annotations

import importlib
import sys

# name -> (module, one line). The order is a first session's: look, train, check, use.
COMMANDS = {
    "configs": ("meshtrain.configs_list", "list the shipped configs with their model, mesh and layout"),
    "train": ("meshtrain.train", "train a config on its mesh (--config=NAME --workdir=DIR)"),
    "eval": ("meshtrain.eval", "loss and perplexity of a run's or a converted checkpoint over a split"),
    "sample": ("meshtrain.sample", "text from a run or a converted checkpoint, with a KV cache"),
    "plan": ("meshtrain.plan", "memory, collectives and step time of a layout before renting it"),
    "compare": ("meshtrain.compare", "several runs' loss against time and tokens, in one figure"),
    "convert": ("meshtrain.convert", "Hugging Face GPT-2 and Llama checkpoints in and out"),
    "prepare": ("meshtrain.data.prepare", "turn local text into a dataset of token ids, offline"),
}


def usage() -> str:
    from meshtrain import __version__
    width = max(map(len, COMMANDS))
    lines = [f"usage: meshtrain COMMAND [flags]   (meshtrain {__version__})", "",
             "Train Flax models on an n-dimensional device mesh. Commands:", ""]
    lines += [f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items()]
    lines += ["", "`meshtrain COMMAND --help` gives a command's flags; `python -m meshtrain.COMMAND`",
              "is the same command. First run: meshtrain train --config=gpt2_tiny_dp2_tp4 --workdir=runs/tiny",
              "Docs: README.md and docs/ in the repository."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if args[0] == "--version":
        from meshtrain import __version__
        print(f"meshtrain {__version__}")
        return 0
    name = args[0]
    if name not in COMMANDS:
        import difflib
        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f" Did you mean `meshtrain {close[0]}`?" if close else ""
        print(f"meshtrain: error: unknown command {name!r}.{hint} The commands are "
              f"{', '.join(COMMANDS)}; `meshtrain --help` says what each does.", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return module.main(args[1:], prog=f"meshtrain {name}")


if __name__ == "__main__":
    sys.exit(main())
