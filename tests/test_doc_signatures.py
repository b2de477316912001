"""docs/architecture.md's signatures are the code's: every `name(arg, ...)` it writes whose
name is one function or class of the package (a dotted suffix of its module path and
qualified name: `make_train_step`, `Layout.spec`, `hlo.collective_table`) lists that
definition's parameters in order, leaving out at most defaulted ones at the end. A call
written with values (`parse_shape("data:8")`) or an elision (`...`) is an example, not a
signature, and is not checked."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "architecture.md"


def definitions() -> dict[str, list[tuple[list[str], int]]]:
    """'meshtrain.x.y.name' and 'meshtrain.x.y.Class.method' -> [(parameter names, how many
    have defaults)]; a dataclass's fields are its parameters."""
    out = {}
    for path in sorted((ROOT / "meshtrain").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.setdefault(f"{module}.{node.name}", []).append(_params(node))
            elif isinstance(node, ast.ClassDef):
                fields = [s for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
                init = next((s for s in node.body if isinstance(s, ast.FunctionDef) and s.name == "__init__"), None)
                if init is not None:
                    out.setdefault(f"{module}.{node.name}", []).append(_params(init))
                elif fields:
                    names = [f.target.id for f in fields if "ClassVar" not in ast.unparse(f.annotation)]
                    defaults = sum(1 for f in fields if f.value is not None)
                    out.setdefault(f"{module}.{node.name}", []).append((names, defaults))
                for s in node.body:
                    if isinstance(s, ast.FunctionDef) and not s.name.startswith("_") or (
                            isinstance(s, ast.FunctionDef) and s.name == "__call__"):
                        out.setdefault(f"{module}.{node.name}.{s.name}", []).append(_params(s))
    return out


def _params(fn: ast.FunctionDef) -> tuple[list[str], int]:
    a = fn.args
    positional = [p.arg for p in a.posonlyargs + a.args if p.arg not in ("self", "cls")]
    names = positional + ([a.vararg.arg] if a.vararg else []) + [p.arg for p in a.kwonlyargs]
    return names, len(a.defaults) + sum(d is not None for d in a.kw_defaults) + bool(a.vararg)


def split_args(text: str) -> list[str]:
    """Top-level comma-separated pieces of an argument list (brackets kept whole)."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += ch in "([{" and 1 or ch in ")]}" and -1 or 0
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return [p for p in out + [cur.strip()] if p]


def written_signatures(text: str):
    """(name, parameter names) for each `name(...)` span that reads as a signature."""
    for name, args in re.findall(r"`([A-Za-z_][\w.]*)\(([^`]*)\)`", " ".join(text.split())):
        if "..." in args or "->" in args:
            continue
        names = []
        for piece in split_args(args):
            word = piece.split("=")[0].strip().lstrip("*").split(" ")[0]
            if word and not re.fullmatch(r"[A-Za-z_]\w*", word):
                break  # a value: an example call
            if word:
                names.append(word)
        else:
            yield name, names


def test_the_architecture_page_writes_each_signature_as_the_code_has_it():
    defs = definitions()
    checked, wrong = 0, []
    for name, written in written_signatures(PAGE.read_text()):
        matches = [k for k in defs if k == f"meshtrain.{name}" or k.endswith(f".{name}")]
        if len(matches) != 1 or len(defs[matches[0]]) != 1:
            continue  # not the package's, or not one definition (jax.jit, `validate` of several)
        real, defaults = defs[matches[0]][0]
        checked += 1
        required = len(real) - defaults
        if written != real[:len(written)] or len(written) < required:
            wrong.append(f"`{name}({', '.join(written)})`: the code has {matches[0]}({', '.join(real)})")
    print(f"{checked} signatures checked")
    assert not wrong, "docs/architecture.md:\n" + "\n".join(wrong)
    assert checked >= 20, f"only {checked} signatures were recognised: the reader has gone blind"


def test_the_field_lists_on_the_architecture_page_are_the_classes_fields():
    """"`X` holds:" followed by a bullet a field ("- `name`, ...") lists X's fields, in order."""
    defs = definitions()
    text = PAGE.read_text()
    found = re.findall(r"`(\w+)` holds:\n((?:\s*- `\w+`.*\n(?:\s{4,}.*\n)*)+)", text)
    assert found, "no field list found: the reader has gone blind"
    for name, bullets in found:
        written = re.findall(r"^\s*- `(\w+)`", bullets, re.M)
        matches = [k for k in defs if k.endswith(f".{name}")]
        assert len(matches) == 1, (name, matches)
        assert written == defs[matches[0]][0][0], f"`{name}` holds {written}; the code has {defs[matches[0]][0][0]}"
