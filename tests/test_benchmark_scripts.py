"""Every script in benchmarks/ (a file with a __main__ block; the others are its modules)
answers --help: its usage, exit 0, nothing measured. All run at once (each is mostly
imports), so a moved script that lost its imports, or one that reads its own argv and
ignores --help, fails here instead of in a reader's hands."""

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
