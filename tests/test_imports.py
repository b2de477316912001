"""The package's imports run one way: no circles, and no module imports one in a layer
above its own. The layers are the table in docs/architecture.md ("Layers"), read here,
so the document and the code cannot drift apart."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "meshtrain"


def modules() -> dict[str, pathlib.Path]:
    """'meshtrain.x.y' -> file, for every module of the package (configs are data)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if "configs" in parts:
            continue
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The package's modules that `name` imports, anywhere in it (inside functions too:
    a lazy import is still a dependency)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # `import meshtrain.a.b.c` of a non-module name
                t = t.rpartition(".")[0]
            if t.startswith("meshtrain") and t != name and t != "meshtrain":
                found.add(t)
    return found


def layers() -> list[list[str]]:
    """docs/architecture.md's layer table, bottom first: [[entries of layer 1], ...]."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if re.match(r"\|\s*\d+\s*\|", line)]
    assert rows, "docs/architecture.md has no '## Layers' table"
    return [re.findall(r"`([^`]+)`", row.split("|")[2]) for row in rows]


def layer_of(name: str, table: list[list[str]]) -> int | None:
    """The layer of the longest table entry naming `name` (`cluster/` names a package)."""
    best, level = -1, None
    rel = name.removeprefix("meshtrain.").replace(".", "/")
    for i, entries in enumerate(table):
        for entry in entries:
            entry = entry.removesuffix(".py")
            if rel == entry.rstrip("/") or (entry.endswith("/") and rel.startswith(entry)):
                if len(entry) > best:
                    best, level = len(entry), i
    return level


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(name, path, set(mods)) for name, path in mods.items()}


def test_every_module_has_a_layer():
    table = layers()
    missing = [m for m in graph() if m != "meshtrain" and layer_of(m, table) is None]
    assert not missing, f"add these modules to the layer table of docs/architecture.md: {missing}"


def test_no_module_imports_one_in_a_higher_layer():
    table = layers()
    g = graph()
    upward = [f"{a} (layer {layer_of(a, table) + 1}) imports {b} (layer {layer_of(b, table) + 1})"
              for a, targets in g.items() for b in targets
              if a != "meshtrain" and layer_of(b, table) is not None and layer_of(a, table) is not None
              and layer_of(b, table) > layer_of(a, table)]
    assert not upward, "imports against the layers of docs/architecture.md:\n" + "\n".join(upward)


def test_no_import_circles():
    g = graph()
    # Tarjan's strongly connected components; any of more than one module is a circle.
    index, low, stack, on, circles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(g):
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


def test_the_checker_sees_a_circle_and_an_upward_import(tmp_path):
    """The rules above fail on what they should: a fake pair of modules importing each
    other, one of them from a higher layer."""
    a = tmp_path / "a.py"
    a.write_text("from meshtrain import train\n")
    found = imports("meshtrain.mesh", a, {"meshtrain.train", "meshtrain.mesh"})
    assert found == {"meshtrain.train"}
    table = layers()
    assert layer_of("meshtrain.train", table) > layer_of("meshtrain.mesh", table)


def _table(section: str) -> list[list[str]]:
    """The cells of the first table under docs/architecture.md's `## {section}`."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in body.splitlines() if line.startswith("| ") and not line.startswith("| role")
            and not line.startswith("| #")]


def _size(paths: list[pathlib.Path]) -> tuple[int, int]:
    """(files, lines) of the .py files at or under `paths`."""
    files = {f for p in paths for f in ([p] if p.is_file() else p.rglob("*.py"))}
    return len(files), sum(len(f.read_text().splitlines()) for f in files)


def _hundreds(lines: int) -> str:
    return f"{round(lines, -2):,}"


def test_the_map_names_every_entry_of_the_package_once_with_its_size():
    listed, wrong = [], []
    for role, entries, files, lines in _table("The map"):
        names = [e.rstrip("/") for e in re.findall(r"`([^`]+)`", entries)]
        listed += names
        n, counted = _size([PACKAGE / name for name in names])
        if (str(n), _hundreds(counted)) != (files, lines):
            wrong.append(f"{role}: the map says {files} files, {lines} lines; counted {n} files, "
                         f"{counted} lines (write {n} | {_hundreds(counted)})")
    present = sorted(p.name for p in PACKAGE.iterdir() if p.name != "__pycache__" and not p.name.startswith("."))
    assert sorted(listed) == present, (f"docs/architecture.md's map lists {sorted(listed)}; `ls meshtrain/` "
                                       f"shows {present}: each entry once")
    assert not wrong, "\n".join(wrong)


def test_the_reading_order_says_how_much_it_is():
    rows = _table("Read in this order")
    paths = {ROOT / p for _, files, _, _ in rows for p in re.findall(r"`([^`]+\.py)`", files)}
    missing = sorted(str(p) for p in paths if not p.is_file())
    assert not missing, f"the reading order names files that do not exist: {missing}"
    wrong = []
    for number, files, lines, _ in rows:
        counted = _size([ROOT / p for p in re.findall(r"`([^`]+\.py)`", files)])[1]
        if lines != f"{round(counted, -1):,}":
            wrong.append(f"row {number}: says {lines} lines, counted {counted} (write {round(counted, -1):,})")
    assert not wrong, "\n".join(wrong)
    n, lines = _size(sorted(paths))
    text = (ROOT / "docs" / "architecture.md").read_text().split("## Read in this order\n", 1)[1]
    assert f"{n} files, about {_hundreds(lines)} lines" in text.split("\n\n", 1)[0].replace("\n", " "), (
        f"the reading order's headline should say '{n} files, about {_hundreds(lines)} lines'")


def test_parallelism_lives_in_one_room_above_the_models():
    """The models ask their layout through the hook they are handed (models/hook.py) and
    import nothing from parallel/; parallel/ takes what it needs of the step (the loss at
    the last pipeline stage) as an argument and imports nothing from step/. The layer
    table says the same; this names the two rules the room depends on."""
    g = graph()
    wrong = [f"{a} imports {b}" for a, targets in g.items() for b in targets
             if (a.startswith("meshtrain.models") and b.startswith("meshtrain.parallel"))
             or (a.startswith("meshtrain.parallel") and b.startswith("meshtrain.step"))]
    assert not wrong, "\n".join(wrong)
    outside = [m for m in g if any(w in m for w in ("layouts", "grad_reduce", "pipeline", "context_attention"))
               and not m.startswith(("meshtrain.parallel", "meshtrain.planner"))]  # the planner's formulas for them
    assert not outside, f"parallelism outside meshtrain/parallel/: {outside}"


PLANNER_LINES = 4_000


def test_the_planner_stays_within_its_line_budget():
    """The planner writes each fact once (issue 54 took it from 4,560 lines, and verify and
    the memory probe out of it, to under 4,000): a formula written twice, or a docstring
    copied from docs/planner.md, shows here first."""
    lines = sum(len(p.read_text().splitlines()) for p in (PACKAGE / "planner").glob("*.py"))
    assert lines <= PLANNER_LINES, (
        f"meshtrain/planner/*.py is {lines:,} lines, over its {PLANNER_LINES:,}: ask an existing "
        f"formula (planner/analytic.py, bounds.py) before writing one, and point to docs/ "
        f"instead of repeating it")


def test_models_own_no_mesh():
    """The models receive the hook (models/hook.py), whose implementation on a mesh is
    parallel/hook.py: no model file imports jax.sharding, calls shard_map itself, or
    probes the hook with getattr/hasattr."""
    found = []
    for path in sorted((PACKAGE / "models").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            name = path.relative_to(ROOT)
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jax.sharding"):
                found.append(f"{name}:{node.lineno} imports {node.module}")
            elif isinstance(node, ast.Import) and any(a.name.startswith("jax.sharding") for a in node.names):
                found.append(f"{name}:{node.lineno} imports jax.sharding")
            elif isinstance(node, ast.Attribute) and node.attr in ("sharding", "shard_map") \
                    and isinstance(node.value, ast.Name) and node.value.id == "jax":
                found.append(f"{name}:{node.lineno} uses jax.{node.attr}")
            elif isinstance(node, ast.Name) and node.id in ("shard_map", "NamedSharding", "PartitionSpec"):
                found.append(f"{name}:{node.lineno} uses {node.id}")
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "hasattr") and node.args
                  and isinstance(node.args[0], ast.Name) and node.args[0].id == "constrain"):
                found.append(f"{name}:{node.lineno} probes the hook with {node.func.id}")
    assert not found, "models/ must leave meshes to parallel/:\n" + "\n".join(found)


def private_uses(path: pathlib.Path, known: set[str]) -> list[str]:
    """Where a module reaches another module's private name (a leading underscore, not a
    dunder): `from meshtrain.x import _name`, or `x._name` on a module it imported."""
    tree = ast.parse(path.read_text(), str(path))
    found, imported = [], set()
    private = lambda n: n.startswith("_") and not n.startswith("__")  # noqa: E731
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("meshtrain"):
            found += [f"{node.lineno}: from {node.module} import {a.name}" for a in node.names if private(a.name)]
            imported |= {a.asname or a.name for a in node.names if f"{node.module}.{a.name}" in known}
        elif isinstance(node, ast.Import):
            imported |= {a.asname for a in node.names if a.asname and a.name in known}
    found += [f"{node.lineno}: {node.value.id}.{node.attr}" for node in ast.walk(tree)
              if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
              and node.value.id in imported and private(node.attr)]
    return found


def test_no_module_uses_another_modules_private_names():
    """A name one module shares with another is public (no underscore): what is private can
    change without a look outside its file."""
    mods = modules()
    found = [f"{path.relative_to(ROOT)}:{use}" for path in mods.values() for use in private_uses(path, set(mods))]
    assert not found, "private names used across modules (make them public or keep them home):\n" + "\n".join(found)


def test_the_private_name_check_sees_both_forms(tmp_path):
    a = tmp_path / "a.py"
    a.write_text("from meshtrain.planner import hlo\nfrom meshtrain.planner.analytic import _size, gathered\n"
                 "hlo._calls(x)\nhlo.__name__\n")
    assert private_uses(a, {"meshtrain.planner.hlo", "meshtrain.planner.analytic"}) == [
        "2: from meshtrain.planner.analytic import _size", "3: hlo._calls"]


# Functions allowed past LONGEST lines, and why: a table read top to bottom, not a procedure.
LONG_FUNCTIONS = {"meshtrain.config.base": "every config key with its default, one per line"}
LONGEST = 80


def test_no_function_is_longer_than_a_reader_can_hold():
    long = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > LONGEST and f"{name}.{node.name}" not in LONG_FUNCTIONS:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines} lines")
    assert not long, f"functions over {LONGEST} lines (name their phases):\n" + "\n".join(long)


# Packages whose docstring is an index of their modules, one entry a line ("  name  what it is").
INDEXED = ["checkpoints", "cluster", "parallel", "parallel/pipeline", "planner", "run", "runlog", "sampling", "step"]


def index_entries(package: pathlib.Path) -> set[str]:
    """The modules a package's docstring indexes: each line's leading name(s), e.g.
    "  store   ..." or "  save_failure, orbax_log   ..." ("tasks/" names a subpackage)."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text()), clean=False) or ""
    names = set()
    for line in doc.splitlines():
        m = re.match(r"  ([a-z_0-9]+/?(?:, [a-z_0-9]+/?)*)\s{2,}\S", line)
        if m:
            names |= {n.rstrip("/") for n in m.group(1).split(", ")}
    return names


def test_every_package_index_names_each_of_its_modules_once():
    """A package's index (its __init__ docstring) lists exactly its modules and subpackages,
    so a module added or moved cannot be missing from it."""
    wrong = []
    for rel in INDEXED:
        package = PACKAGE / rel
        present = {p.stem for p in package.glob("*.py") if p.name != "__init__.py"}
        present |= {p.parent.name for p in package.glob("*/__init__.py")}
        listed = index_entries(package)
        if listed != present:
            wrong.append(f"meshtrain/{rel}/__init__.py: not listed {sorted(present - listed)}, "
                         f"not a module {sorted(listed - present)}")
    assert not wrong, "\n".join(wrong)
