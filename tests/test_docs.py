"""The docs name only what exists: every `--config.KEY` in README.md and docs/ is a config
key, every command (`meshtrain X`, `python -m meshtrain.X`) is one, every file path under
meshtrain/ is a file, and nothing installs meshtrain by a bare package name."""

import importlib.util
import pathlib
import re

import pytest

from meshtrain import __main__ as entry, config as config_lib

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def texts():
    return [(p.relative_to(ROOT), p.read_text()) for p in DOCS + NOTEBOOKS]


@pytest.mark.parametrize("path,text", texts(), ids=lambda x: str(x) if isinstance(x, pathlib.Path) else "")
def test_named_config_keys_exist(path, text):
    keys = set(config_lib.keys(config_lib.base()))
    named = set(re.findall(r"--(?:no)?config\.([a-z_]+(?:\.[a-z_]+)+)", text))
    unknown = sorted(k for k in named if k not in keys and k not in ("a.b",))  # a.b: the syntax's example
    assert not unknown, f"{path} names config keys that do not exist: {unknown}"


@pytest.mark.parametrize("path,text", texts(), ids=lambda x: str(x) if isinstance(x, pathlib.Path) else "")
def test_named_commands_exist(path, text):
    modules = set(re.findall(r"python3? -m (meshtrain(?:\.[a-z_]+)*)\b", text))
    missing = [m for m in sorted(modules) if importlib.util.find_spec(m) is None]
    assert not missing, f"{path} runs modules that do not exist: {missing}"
    code = re.findall(r"```.*?```|`[^`\n]+`", text, re.S)  # commands are in code, not prose
    subcommands = {s for span in code for f, s in re.findall(r"(?:^|[\s`(])(from )?meshtrain ([a-z_]+)\b", span, re.M)
                   if not f}  # `from meshtrain import x` is Python
    unknown = sorted(s for s in subcommands if s not in entry.COMMANDS)
    assert not unknown, f"{path} runs `meshtrain X` for X not a command: {unknown}"


@pytest.mark.parametrize("path,text", texts(), ids=lambda x: str(x) if isinstance(x, pathlib.Path) else "")
def test_named_files_exist(path, text):
    named = set(re.findall(r"(?<![\w/.-])((?:meshtrain|tests|benchmarks|launch|configs|notebooks|docs)/[\w/.-]*\w\."
                           r"(?:py|md|sh|sbatch|ipynb))\b", text))
    # Paths with a placeholder (configs/NAME.py) stand for files a user writes.
    missing = sorted(n for n in named if not (ROOT / n).exists() and not re.search(r"[A-Z]{3,}", n))
    assert not missing, f"{path} names files that do not exist: {missing}"


@pytest.mark.parametrize("path,text", texts(), ids=lambda x: str(x) if isinstance(x, pathlib.Path) else "")
def test_nothing_installs_meshtrain_by_a_bare_name(path, text):
    """`pip install meshtrain` would fetch an unrelated project of that name; installs are
    from a checkout (`pip install .`, `-e .`) or from the repository (`meshtrain-jax @ URL`)."""
    for command in re.findall(r"pip install[^\n`&;|]*", text):
        for word in command.split()[2:]:
            word = word.strip("\"'")
            if re.fullmatch(r"meshtrain(-jax)?(\[[\w,]+\])?", word):
                assert "@" in command, f"{path}: `{command}` installs meshtrain by a bare name"
