"""The user's path, as a user takes it: the wheel, installed non-editable into a fresh
virtual environment, used from a directory outside the checkout.

The tests and CI install meshtrain in editable mode, which hides a module or config left
out of the wheel; this tier does not. The fresh environment gets meshtrain from the wheel
alone. Its dependencies are this test environment's, reached through a plain path entry
(a .pth line: no editable finder of this checkout is activated through it), so the tier
needs no network and no 2-minute reinstall of jax; `test_every_import_is_a_declared_
dependency` checks the other half, that pyproject.toml declares what the package imports.
"""

import ast
import fcntl
import importlib.metadata
import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tomllib

import pytest

from support import notebooks
from support.processes import metric_rows

ROOT = pathlib.Path(__file__).resolve().parent.parent
COMMANDS = ["configs", "train", "eval", "sample", "plan", "compare", "convert", "prepare"]


@pytest.fixture(scope="session")
def installed(tmp_path_factory):
    """(python, meshtrain script, environment, a directory outside the checkout) of a fresh
    venv holding the wheel built from this checkout. Built once for all xdist workers."""
    # One per pytest run: xdist workers' base temps share the run's directory as parent; a
    # run without xdist has its own base temp (whose parent every run shares).
    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "installed-meshtrain"
    shared.mkdir(exist_ok=True)
    with open(shared / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        venv, ready = shared / "venv", shared / "ready"
        if not ready.exists():
            wheels, source = shared / "wheels", shared / "source"
            shutil.rmtree(wheels, ignore_errors=True)
            # Built from a copy of the sources: setuptools reuses a checkout's build/ directory,
            # where modules of older builds (since renamed or removed) would land in the wheel.
            shutil.rmtree(source, ignore_errors=True)
            shutil.copytree(ROOT, source, symlinks=True, ignore=shutil.ignore_patterns(
                ".git", ".venv", "build", "*.egg-info", "__pycache__", ".pytest_cache", "runs"))
            subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                            "--wheel-dir", str(wheels), str(source)], check=True, capture_output=True)
            subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
            python = venv / "bin" / "python"
            site = pathlib.Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                               check=True, capture_output=True, text=True).stdout.strip())
            (site / "test-dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
            (wheel,) = wheels.glob("meshtrain_jax-*.whl")
            subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps",
                            "--no-index", str(wheel)], check=True, capture_output=True)
            ready.touch()
    outside = tmp_path_factory.mktemp("elsewhere")
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(outside), "JAX_PLATFORMS": "cpu",
           "PYTHONDONTWRITEBYTECODE": "1"}
    return venv / "bin" / "python", venv / "bin" / "meshtrain", env, outside


def run(args, installed, timeout=600, cwd=None):
    python, script, env, outside = installed
    return subprocess.run([str(a) for a in args], cwd=cwd or outside, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_the_installed_package_is_the_wheel_and_imports_every_module(installed):
    python = installed[0]
    probe = ("import importlib, pkgutil, meshtrain, json; names = [m.name for m in "
             "pkgutil.walk_packages(meshtrain.__path__, 'meshtrain.')]; [importlib.import_module(n) for n in names]; "
             "print(json.dumps([meshtrain.__file__, names]))")
    r = run([python, "-c", probe], installed)
    assert r.returncode == 0, r.stderr
    where, names = json.loads(r.stdout)
    assert ROOT not in pathlib.Path(where).parents and "site-packages" in where, where
    ours = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            for p in (ROOT / "meshtrain").rglob("*.py")}
    assert ours - {"meshtrain"} == set(names), "modules of the checkout missing from the wheel, or extra"


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_help_names_every_flag(command, installed):
    from meshtrain import __main__ as entry
    import importlib
    parser = importlib.import_module(entry.COMMANDS[command][0]).parser()
    flags = {o for a in parser._actions for o in a.option_strings}
    for sub in (a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"):
        flags |= {o for p in sub.choices.values() for a in p._actions for o in a.option_strings}
    for form in ("--help", "-h"):
        r = run([installed[1], command, form], installed)
        assert r.returncode == 0 and r.stderr == "", (form, r.stderr)
        assert r.stdout.startswith(f"usage: meshtrain {command}"), r.stdout[:200]
        text = r.stdout
        if command == "convert":  # its flags live on the subcommands' own --help
            text += "".join(run([installed[1], command, sub, form], installed).stdout for sub in ("from_hf", "to_hf"))
        missing = [f for f in flags if f not in text]
        assert not missing, f"meshtrain {command} {form} does not name {missing}"
    r = run([installed[0], "-m", entry.COMMANDS[command][0], "--help"], installed)
    assert r.returncode == 0 and "usage:" in r.stdout


def test_meshtrain_lists_the_commands(installed):
    for args in ([installed[1]], [installed[1], "--help"], [installed[0], "-m", "meshtrain"]):
        r = run(args, installed)
        assert r.returncode == 0, r.stderr
        for command in COMMANDS:
            assert re.search(rf"^  {command} +\S", r.stdout, re.M), (command, r.stdout)
    r = run([installed[1], "trian"], installed)
    assert r.returncode == 2 and "Did you mean `meshtrain train`?" in r.stderr


def test_configs_lists_every_shipped_config(installed):
    r = run([installed[1], "configs", "--json"], installed)
    assert r.returncode == 0, r.stderr
    names = [json.loads(line)["name"] for line in r.stdout.splitlines()]
    assert names == sorted(p.stem for p in (ROOT / "configs").glob("*.py") if not p.stem.startswith("_"))


def readme_train_command() -> list[str]:
    """The README's first `meshtrain train ...` command, as written there."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    command = next(part.strip() for line in block.splitlines() for part in line.split("&&")
                   if part.strip().startswith("meshtrain train"))
    return shlex.split(command)


@pytest.mark.slow
def test_the_readme_run_trains_and_ends_with_its_summary(installed):
    args = readme_train_command()
    r = run([installed[1], *args[1:]], installed, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    workdir = installed[3] / next(a.split("=", 1)[1] for a in args if a.startswith("--workdir="))
    rows = metric_rows(workdir)
    evals = [row["eval_loss"] for row in rows if "eval_loss" in row]
    assert evals and evals[-1] < evals[0]
    summary = r.stdout[r.stdout.index("done: "):]
    assert "best possible" in summary and f"checkpoint: {workdir}/checkpoints/step_" in summary
    assert f"meshtrain sample --workdir={workdir.relative_to(installed[3])}" in summary


@pytest.mark.slow
def test_plan_answers_in_json(installed):
    r = run([installed[1], "plan", "--config=gpt2_tiny_dp2_tp4", "--json"], installed)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout)
    assert report["config_name"] == "gpt2_tiny_dp2_tp4" and report["memory_per_device_bytes"]["total"] > 0


@pytest.mark.slow
def test_a_notebook_runs_against_the_installed_package(installed, tmp_path, monkeypatch):
    """layouts.ipynb from a directory outside the checkout, in a kernel of the fresh venv:
    it imports meshtrain from site-packages, runs every cell and draws every figure
    (test_notebooks.py runs the other notebook from the checkout)."""
    python, _, env, outside = installed
    notebooks.kernel_spec(tmp_path / "jupyter", python)
    work = outside / "notebook"
    work.mkdir(exist_ok=True)
    kernel_env = {**env, "JUPYTER_PATH": str(tmp_path / "jupyter"), "PYDEVD_DISABLE_FILE_VALIDATION": "1"}
    nb, elapsed = notebooks.execute("layouts.ipynb", kernel_env, work, monkeypatch)
    figures = notebooks.assert_runs_and_draws("layouts.ipynb", nb)
    text = "".join(o.get("text", "") for c in notebooks.code_cells(nb) for o in c.outputs)
    assert "site-packages" in text and str(ROOT) not in text.split("meshtrain from:")[-1].splitlines()[0]
    print(f"layouts.ipynb (installed): {elapsed:.1f} s, {figures} figures")


def test_the_declared_jax_is_the_one_the_suite_runs_on():
    """pyproject declares the JAX versions the tests ran on, not an open floor, and the same
    in the cuda12 extra: widening it takes a whole-suite run (docs/install.md)."""
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = [*project["dependencies"], *project["optional-dependencies"]["cuda12"]]
    specs = [r.specifier for r in map(Requirement, declared) if r.name == "jax"]
    assert len(specs) == 2 and specs[0] == specs[1], specs
    spec = specs[0]
    assert spec.contains(importlib.metadata.version("jax")), (spec, importlib.metadata.version("jax"))
    assert any(s.operator in ("==", "<", "<=", "~=") for s in spec), f"jax{spec} has no upper bound"


def _top_level_imports(lazy: bool | None = None) -> set[str]:
    """Third-party top-level module names the package imports: all of them (`lazy` None),
    only those imported at module level (False), or only those imported inside functions
    (True)."""
    names = set()
    for path in (ROOT / "meshtrain").rglob("*.py"):
        tree = ast.parse(path.read_text())
        inside = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                  for n in ast.walk(f) if n is not f}
        for node in ast.walk(tree):
            if lazy is not None and (id(node) in inside) != lazy:
                continue
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"meshtrain", "__future__"}


def _extra_requirements(dist: str, skip: tuple[str, ...]) -> set[str]:
    """What `dist`'s extras (but `skip`) require, transitively."""
    seen: set[str] = set()
    for req in importlib.metadata.requires(dist) or []:
        extra = re.search(r"""extra\s*==\s*["']([^"']+)["']""", req)
        if extra and extra.group(1) not in skip:
            _requirements(re.match(r"[A-Za-z0-9_.-]+", req).group(0), seen)
    return seen


def _requirements(dist: str, seen: set[str]) -> set[str]:
    """`dist` and what it requires, transitively (extras left out)."""
    key = re.sub(r"[-_.]+", "-", dist).lower()
    if key in seen:
        return seen
    seen.add(key)
    try:
        requires = importlib.metadata.requires(dist) or []
    except importlib.metadata.PackageNotFoundError:
        return seen
    for req in requires:
        if "extra ==" in req:
            continue
        _requirements(re.match(r"[A-Za-z0-9_.-]+", req).group(0), seen)
    return seen


def test_every_import_is_a_declared_dependency():
    """Each third-party module the package imports comes from a distribution meshtrain-jax
    requires (directly or through one of its requirements), so a fresh install has it; or,
    imported only inside functions (lazily), from one of its optional extras (test aside),
    e.g. wandb for train.trackers=wandb."""
    declared = _requirements("meshtrain-jax", set())
    optional = _extra_requirements("meshtrain-jax", skip=("test",))
    providers = importlib.metadata.packages_distributions()
    lazy_only = _top_level_imports(lazy=True) - _top_level_imports(lazy=False)
    undeclared = {}
    for module in sorted(_top_level_imports()):
        dists = {re.sub(r"[-_.]+", "-", d).lower() for d in providers.get(module, [])}
        if not dists & declared and not (module in lazy_only and dists & optional):
            undeclared[module] = sorted(dists) or ["not installed"]
    assert not undeclared, (f"imported but not declared in pyproject.toml dependencies (or, imported "
                            f"lazily, in an extra): {undeclared}")
    assert "wandb" in lazy_only, "wandb is an optional extra: import it inside the function that needs it"
