"""Every script in benchmarks/ (a file with a __main__ block; the others are its modules)
answers --help: its usage, exit 0, nothing measured. All run at once (each is mostly
imports), so a moved script that lost its imports, or one that reads its own argv and
ignores --help, fails here instead of in a reader's hands."""

import ast
import importlib
import importlib.util
import subprocess
import sys

from support.processes import ROOT


def test_every_benchmark_script_answers_help():
    scripts = sorted(s for s in (ROOT / "benchmarks").rglob("*.py") if '__name__ == "__main__"' in s.read_text())
    assert len(scripts) >= 15
    running = {s: subprocess.Popen([sys.executable, str(s), "--help"], cwd=ROOT, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True) for s in scripts}
    failed = []
    for script, proc in running.items():
        out, _ = proc.communicate(timeout=300)
        if proc.returncode != 0 or "usage:" not in out:
            failed.append(f"{script.relative_to(ROOT)}: exit {proc.returncode}\n{out[-1500:]}")
    assert not failed, "\n\n".join(failed)


def _module_aliases(tree) -> dict[str, str]:
    """{local name: module} for each meshtrain module a file imports."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update({a.asname or a.name: a.name for a in node.names if a.name.startswith("meshtrain")})
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("meshtrain"):
            for a in node.names:
                try:
                    if importlib.util.find_spec(f"{node.module}.{a.name}") is not None:
                        out[a.asname or a.name] = f"{node.module}.{a.name}"
                except ModuleNotFoundError:  # a name in a module, not a module
                    pass
    return out


def test_every_meshtrain_name_a_script_reads_exists():
    """module.name, for every meshtrain module a script in benchmarks/ or tools/ imports: a
    function moved to another module fails here, not when a reader's run reaches it (--help
    stops before)."""
    missing = []
    for path in sorted([*(ROOT / "benchmarks").rglob("*.py"), *(ROOT / "tools").glob("*.py")]):
        tree = ast.parse(path.read_text())
        aliases = _module_aliases(tree)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and not hasattr(importlib.import_module(aliases[node.value.id]), node.attr)):
                missing.append(f"{path.relative_to(ROOT)}:{node.lineno}: {aliases[node.value.id]}.{node.attr}")
    assert not missing, "\n".join(missing)
