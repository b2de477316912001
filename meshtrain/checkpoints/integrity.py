"""Is a committed checkpoint step readable? A check made before resuming, sampling,
evaluating or converting, which reads the indexes and the small JSON files but no array data.

    damage = integrity.check_step(DIR / "step_N")   # None, or what is wrong and where
    step, damaged = integrity.newest_intact(DIR, steps)   # newest first, stops at the first good one
    with integrity.reading(DIR / "step_N", remedy):  # an Orbax read that fails anyway
        ...                                          # -> one UserError paragraph

What an Orbax step holds, and what is checked (paths relative to step_N):

    _CHECKPOINT_METADATA, meta/metadata          JSON: must parse
    state/_METADATA                              JSON: the tree, one entry per array
    state/_sharding, state/array_metadatas/*     JSON, when present: must parse
    state/manifest.ocdbt                         the OCDBT root: the newest version's B+tree
    state/d/*                                    B+tree nodes (every key -> inline bytes, or
                                                 (data file, offset, length))
    state/ocdbt.process_P/d/*                    the data files process P wrote

Every B+tree node is read (they are small) and every data file must be at least as long as
the largest offset + length the tree records in it: a file cut short, or missing, is caught
without reading a byte of it. Every array of _METADATA must have its zarr metadata in the
tree, parseable, and (Orbax writes every chunk) all of its chunks. Damage inside the bytes
of a data file (same length, other contents) is not seen here; `reading` turns the error
of the read that meets it into the same kind of paragraph.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import pathlib
import re
import urllib.parse

from meshtrain.errors import UserError

# The JSON files every committed step has, and those it may have.
REQUIRED_JSON = ("_CHECKPOINT_METADATA", "meta/metadata", "state/_METADATA")
OPTIONAL_JSON = ("state/_sharding",)
ARRAY_TYPES = ("jax.Array", "np.ndarray")


@dataclasses.dataclass(frozen=True)
class Damage:
    """What is wrong with one step: `file` (absolute) `problem` (a clause), `more` others."""

    step_dir: pathlib.Path
    file: pathlib.Path
    problem: str
    more: int = 0

    @property
    def step(self) -> int:
        return int(self.step_dir.name.rpartition("_")[2])

    def sentence(self) -> str:
        more = f" ({self.more} more file{'s' if self.more > 1 else ''} damaged too)" if self.more else ""
        return f"Checkpoint step {self.step} ({self.step_dir}) is damaged: {self.file} {self.problem}{more}."


def _json(path: pathlib.Path) -> tuple[object, str | None]:
    """(parsed JSON, None) or (None, what is wrong with the file)."""
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        return None, "is missing"
    except OSError as e:
        return None, f"cannot be read ({e.strerror or e})"
    if not text:
        return None, "is empty (0 bytes): it was cut short"
    try:
        return json.loads(text), None
    except (ValueError, UnicodeDecodeError) as e:
        where = f" at byte {e.pos:,} of {len(text):,}" if isinstance(e, json.JSONDecodeError) else ""
        reason = e.msg.removesuffix(" at") if isinstance(e, json.JSONDecodeError) else str(e)
        return None, f"is not valid JSON ({reason}{where}): it was cut short or overwritten"


def _location(loc: str) -> tuple[str, int, int]:
    """'value:ocdbt.process_0/:d/ab12:0:3841' -> ('ocdbt.process_0/d/ab12', 0, 3841)."""
    _kind, rest = loc.split(":", 1)
    where, offset, length = rest.rsplit(":", 2)
    base, _, rel = where.partition(":")
    return urllib.parse.unquote(base) + urllib.parse.unquote(rel), int(offset), int(length)


class _Tree:
    """The OCDBT B+tree of state/: keys -> inline bytes or data-file ranges, and the bytes
    each file must hold."""

    def __init__(self, state: pathlib.Path):
        import tensorstore as ts
        self.ts, self.state = ts, state
        self.base = ts.KvStore.open({"driver": "file", "path": str(state) + "/"}).result()
        self.inline: dict[str, bytes] = {}
        self.stored: dict[str, str] = {}    # key -> data file (relative to state/)
        self.need: dict[str, int] = {}      # data or node file -> bytes the tree records in it
        self.keys: dict[str, list[str]] = {}  # file -> keys stored in it

    def read(self) -> None:
        """Walks every node; raises _Bad(file, problem) for a node that cannot be read."""
        manifest = self.state / "manifest.ocdbt"
        if not manifest.exists():
            raise _Bad(manifest, "is missing (the index of every array in the step)")
        try:
            versions = self.ts.ocdbt.dump(self.base).result()["versions"]
        except Exception as e:  # noqa: BLE001 - tensorstore's errors are ValueErrors of many kinds
            raise _Bad(manifest, f"cannot be read ({_first_line(e)})") from None
        root = versions[-1]["root"] if versions else {}
        if "location" in root:
            self._node(root["location"], b"")

    def _node(self, loc: str, prefix: bytes) -> None:
        rel, offset, length = _location(loc)
        self._fits(rel, offset + length, "a B+tree node")
        try:
            node = self.ts.ocdbt.dump(self.base, loc).result()
        except Exception as e:  # noqa: BLE001
            raise _Bad(self.state / rel, f"holds a B+tree node of the index that cannot be read "
                                         f"({_first_line(e)})") from None
        for entry in node["entries"]:
            key = prefix + entry.get("subtree_common_prefix", b"")
            if "location" in entry:  # an interior node: its children hold the keys
                self._node(entry["location"], key)
                continue
            name = (key + entry["key"]).decode("utf-8", "replace")
            if "inline_value" in entry:
                self.inline[name] = entry["inline_value"]
            else:
                rel, offset, length = _location(entry["indirect_value"])
                self.stored[name] = rel
                self.need[rel] = max(self.need.get(rel, 0), offset + length)
                self.keys.setdefault(rel, []).append(name)

    def _fits(self, rel: str, end: int, what: str) -> None:
        path = self.state / rel
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise _Bad(path, f"is missing, but the index records {what} in it") from None
        if size < end:
            raise _Bad(path, f"is {size:,} bytes, but the index records {what} up to byte {end:,} "
                             f"in it: the file was cut short")


class _Bad(Exception):
    def __init__(self, file: pathlib.Path, problem: str):
        super().__init__(problem)
        self.file, self.problem = file, problem


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return (text[0] if text else type(error).__name__)[:300]


def _arrays(tree_metadata: dict) -> list[str]:
    """Orbax's name for each array of a state/_METADATA tree: its keys joined by '.'."""
    names = []
    for entry in tree_metadata.values():
        value = entry.get("value_metadata") or {}
        if value.get("value_type") in ARRAY_TYPES and not value.get("skip_deserialize"):
            names.append(".".join(str(k["key"]) for k in entry["key_metadata"]))
    return names


def _array_problems(tree: _Tree, names: list[str], zarr3: bool, every_chunk: bool) -> list[tuple[str, str]]:
    """(array, problem) for arrays whose zarr metadata or chunks are not in the tree."""
    chunks: dict[str, int] = {}
    for key in (*tree.inline, *tree.stored):
        array, _, leaf = key.rpartition("/")
        if leaf not in (".zarray", "zarr.json"):
            chunks[array] = chunks.get(array, 0) + 1
    meta_name = "zarr.json" if zarr3 else ".zarray"
    problems = []
    for name in names:
        key = f"{name}/{meta_name}"
        if key not in tree.inline and key not in tree.stored:
            problems.append((name, f"has no {meta_name} (its shape and dtype)"))
            continue
        if key not in tree.inline:
            continue  # in a data file, whose length was checked
        try:
            meta = json.loads(tree.inline[key])
        except ValueError:
            problems.append((name, f"has a {meta_name} that is not valid JSON"))
            continue
        if every_chunk and not zarr3:
            grid = math.prod(math.ceil(s / max(c, 1)) for s, c in zip(meta["shape"], meta["chunks"]))
            if chunks.get(name, 0) < grid:
                problems.append((name, f"has {chunks.get(name, 0)} of its {grid} chunks"))
    return problems


def check_step(step_dir: pathlib.Path) -> Damage | None:
    """What is wrong with the committed step `step_dir`, or None when every check passes."""
    step_dir = pathlib.Path(step_dir)
    bad: list[tuple[pathlib.Path, str]] = []
    parsed = {}
    extra = sorted(str(p.relative_to(step_dir)) for p in (step_dir / "state" / "array_metadatas").glob("*"))
    for rel in (*REQUIRED_JSON, *OPTIONAL_JSON, *extra):
        if rel in OPTIONAL_JSON and not (step_dir / rel).exists():
            continue
        value, problem = _json(step_dir / rel)
        if problem:
            bad.append((step_dir / rel, problem))
        parsed[rel] = value
    metadata = parsed.get("state/_METADATA")
    if metadata is not None and not isinstance((metadata or {}).get("tree_metadata"), dict):
        bad.append((step_dir / "state/_METADATA", "lacks its tree_metadata (the list of arrays)"))
        metadata = None
    if metadata is not None and metadata.get("use_ocdbt", True):
        tree = _Tree(step_dir / "state")
        try:
            tree.read()
        except _Bad as e:
            bad.append((e.file, e.problem))
        else:
            for rel, end in sorted(tree.need.items()):
                try:
                    tree._fits(rel, end, "array data")
                except _Bad as e:
                    held = sorted({k.rpartition("/")[0] for k in tree.keys[rel]})
                    shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
                    bad.append((e.file, f"{e.problem} (arrays in it: {shown})"))
            problems = _array_problems(tree, _arrays(metadata["tree_metadata"]),
                                       metadata.get("use_zarr3", False),
                                       metadata.get("store_array_data_equal_to_fill_value", False))
            if problems:
                names = ", ".join(f"{a} {p}" for a, p in problems[:2])
                more = f", and {len(problems) - 2} more arrays" if len(problems) > 2 else ""
                bad.append((step_dir / "state/manifest.ocdbt", f"(the index of the arrays) is "
                                                                f"incomplete: {names}{more}"))
    if not bad:
        return None
    return Damage(step_dir, bad[0][0], bad[0][1], len({f for f, _ in bad}) - 1)


def newest_intact(directory: pathlib.Path, steps: list[int], prefix: str) -> tuple[int | None, list[Damage]]:
    """(the newest of `steps` whose check passes or None, the damage of every newer one)."""
    damaged = []
    for step in sorted(steps, reverse=True):
        damage = check_step(directory / f"{prefix}_{step}")
        if damage is None:
            return step, damaged
        damaged.append(damage)
    return None, damaged


# Words of the errors a damaged file gives (tensorstore's status codes, its decoders', the OS's),
# as opposed to a bug or a full memory, which are not the checkpoint's fault.
DAMAGE_WORDS = ("Error reading", "DATA_LOSS", "OUT_OF_RANGE", "NOT_FOUND", "FAILED_PRECONDITION",
                "Error decoding", "No such file")


def _chain(error: BaseException) -> list[BaseException]:
    out = [error]
    while out[-1].__cause__ is not None or out[-1].__context__ is not None:
        nxt = out[-1].__cause__ or out[-1].__context__
        if nxt in out:
            break
        out.append(nxt)
    return out


def is_damage(error: BaseException) -> bool:
    """Whether a failed read looks like damage on disk (not a bug, not memory running out)."""
    return any(isinstance(e, OSError | json.JSONDecodeError)
               or any(w in f"{type(e).__name__}: {e}" for w in DAMAGE_WORDS) for e in _chain(error))


def read_failure(step_dir: pathlib.Path, error: BaseException) -> str:
    """One sentence on a read of `step_dir` that failed: the step, the array and its data
    file when the error names them, and the error's first line (check_step's finding,
    when it has one, is said instead)."""
    step_dir = pathlib.Path(step_dir)
    damage = check_step(step_dir)
    if damage is not None:
        return damage.sentence()
    error = _chain(error)[-1]  # Orbax wraps tensorstore's error, which names the key
    text = _first_line(error)
    key = re.search(r'Error reading "([^"]+)"', str(error))
    cause = re.search(r'in OCDBT database at [^"]*"[^"]*": (.*)', text)
    text = cause.group(1) if cause else text  # the path is said once, below
    where = ""
    if key:
        where = f" {key.group(1).rpartition('/')[0]}"
        try:
            tree = _Tree(step_dir / "state")
            tree.read()
            if key.group(1) in tree.stored:
                where += f" from {step_dir / 'state' / tree.stored[key.group(1)]}"
        except (_Bad, OSError, ValueError):
            pass  # the sentence still names the array
    return (f"Checkpoint step {step_dir.name.rpartition('_')[2]} ({step_dir}) is damaged: "
            f"reading{where or ' it'} failed ({text}). Its indexes, file lengths and JSON files "
            f"look right, so the bytes inside a data file are wrong.")


class _Held(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return False


@contextlib.contextmanager
def reading(step_dir: pathlib.Path, remedy):
    """Turns an exception of the Orbax read inside into a UserError: read_failure's sentence
    and `remedy()`'s (what to do). Orbax's and asyncio's log lines about the failed read,
    one per array still in flight, are held back meanwhile."""
    held, quiet = _Held(), [logging.getLogger(name) for name in ("absl", "asyncio")]
    for log in quiet:
        log.addFilter(held)
    try:
        yield
    except Exception as e:  # noqa: BLE001 - every failure to read from disk is the same story
        if isinstance(e, UserError) or not is_damage(e):
            raise
        raise UserError(f"{read_failure(step_dir, e)} {remedy()}") from None
    finally:
        for log in quiet:
            log.removeFilter(held)
