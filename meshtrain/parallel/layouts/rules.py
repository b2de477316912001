"""Layouts: ordered rule tables from logical axis names to mesh axes.

A layout has four rule tables:
  params       how weights are stored (FSDP/ZeRO-3 shards them here),
  opt_state    how optimizer moments are stored, and where the step's gradients are
               reduced to once the backward pass is done (ZeRO-1 shards here),
  grads        where each layer's weight gradients are reduced to *inside* the backward
               pass, as the layer scan makes them (ZeRO-2 shards here); follows params,
               so by default gradients stay where the weights are until the pass is done,
  activations  how compute is split (batch over data, heads over tensor, ...).

Resolution of one array with logical axes (n1, n2, ...) under a table:
  for each rule (name -> mesh axes) in table order:
      for each dim whose logical name is `name` and that is still unassigned:
          if none of the rule's mesh axes is used by this array yet: assign them
  dims left unassigned are replicated.
So rule order is priority: with "batch:data+fsdp;embed:fsdp", activations
[batch, length, embed] put fsdp on batch and replicate embed, while a weight
[embed, mlp] puts fsdp on embed. A logical name outside the vocabulary is an error.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from jax.sharding import PartitionSpec as P

from meshtrain.errors import UserError
from meshtrain.mesh import AXES
from meshtrain.parallel.layouts.vocabulary import VOCABULARY

Rules = tuple[tuple[str, tuple[str, ...]], ...]
TARGETS = ("params", "opt_state", "grads", "activations")


@dataclasses.dataclass(frozen=True)
class Layout:
    """A named set of rule tables. Hashable, so it can be closed over by jit."""

    name: str
    params: Rules
    opt_state: Rules
    activations: Rules
    grads: Rules = None  # None: follows params

    def __post_init__(self):
        if self.grads is None:
            object.__setattr__(self, "grads", self.params)

    def rules(self, target: str) -> Rules:
        return getattr(self, target)

    @property
    def splits_grads(self) -> bool:
        """Whether gradients have rules of their own (ZeRO-2): the step then pins each
        layer's gradient to them inside the backward pass (grad_reduce.grads_pins)."""
        return self.grads != self.params

    def spec(self, axes: Sequence[str | None], target: str = "params", where: str = "") -> P:
        """Logical axes, e.g. ("embed", "mlp") -> PartitionSpec("fsdp", "tensor")."""
        return resolve(axes, self.rules(target), where=where)

    def without(self, *mesh_axes: str) -> "Layout":
        """The layout with `mesh_axes` struck from every rule (emptied rules dropped): what
        code vmapped over those axes sees (inside a pipeline stage the `stage` axis, per
        batch shard or replica the batch axes, are taken by the vmapped dim)."""
        def strip(rules: Rules) -> Rules:
            kept = ((n, tuple(a for a in axes if a not in mesh_axes)) for n, axes in rules)
            return tuple((n, axes) for n, axes in kept if axes)
        return Layout(f"{self.name} without {'+'.join(mesh_axes)}", strip(self.params),
                      strip(self.opt_state), strip(self.activations), strip(self.grads))

    def shards(self, name: str, shape, target: str = "activations") -> tuple[int, tuple[str, ...]]:
        """How many pieces a lone logical dim `name` is split into under `target`, and over
        which mesh axes; `shape` maps mesh axes to sizes (a Mesh's `.shape`, or a dict)."""
        return self.split((name,), name, shape, target)

    def split(self, axes: Sequence[str | None], name: str, shape,
              target: str = "activations") -> tuple[int, tuple[str, ...]]:
        """As `shards`, for the dim `name` of an array with logical `axes` (the other dims
        may claim mesh axes first: `length` in [batch, length, heads, head_dim] is what
        attention splits, in [batch, length, embed] what the residual stream splits)."""
        mesh_axes = mesh_axes_of(self.spec(axes, target)[list(axes).index(name)])
        return math.prod(shape[a] for a in mesh_axes), mesh_axes

    def describe(self) -> str:
        """The layout in the string grammar (round-trips through `parse`); `grads` only
        where it differs from params (it follows params unless given)."""
        parts = [f"params={format_rules(self.params)}",
                 f"opt_state={format_rules(self.opt_state)}",
                 f"activations={format_rules(self.activations)}"]
        if self.splits_grads:
            parts.insert(2, f"grads={format_rules(self.grads)}")
        return " | ".join(parts)


def mesh_axes_of(entry) -> tuple[str, ...]:
    """One PartitionSpec entry -> the mesh axes it names: None -> (), "x" -> ("x",)."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def check_names(axes: Sequence[str | None], where: str = "") -> None:
    for name in axes:
        if name is not None and name not in VOCABULARY:
            at = f" on {where}" if where else ""
            raise UserError(
                f"Unknown logical axis name {name!r}{at} (axes {tuple(axes)}). The "
                f"vocabulary is: {', '.join(VOCABULARY)}. Use one of these names in the "
                f"model, or extend meshtrain/parallel/layouts/vocabulary.py deliberately.")


def resolve(axes: Sequence[str | None], rules: Rules, where: str = "") -> P:
    """Maps logical axes to a PartitionSpec under `rules` (see the module docstring)."""
    check_names(axes, where)
    assigned: list[tuple[str, ...] | None] = [None] * len(axes)
    used: set[str] = set()
    for name, mesh_axes in rules:
        for i, ax in enumerate(axes):
            if ax == name and assigned[i] is None and not used.intersection(mesh_axes):
                assigned[i] = mesh_axes
                used.update(mesh_axes)
    return P(*(None if a is None else (a[0] if len(a) == 1 else a) for a in assigned))


def format_rules(rules: Rules) -> str:
    return ";".join(f"{name}:{'+'.join(axes)}" for name, axes in rules)


def parse_rules(text: str, source: str) -> Rules:
    """"batch:data+fsdp;heads:tensor" -> (("batch", ("data", "fsdp")), ("heads", ("tensor",)))."""
    rules = []
    for item in filter(None, (s.strip() for s in text.split(";"))):
        name, sep, mesh_axes = item.partition(":")
        name = name.strip()
        axes = tuple(a.strip() for a in mesh_axes.split("+") if a.strip())
        if not sep or not axes:
            raise UserError(
                f"Layout {source!r}: rule {item!r} is not 'logical:mesh_axis[+mesh_axis]'. "
                f"Example: 'batch:data+fsdp;heads:tensor;embed:fsdp'.")
        check_names((name,), where=f"layout {source!r}")
        for a in axes:
            if a not in AXES:
                raise UserError(
                    f"Layout {source!r}: rule {item!r} names mesh axis {a!r}; the mesh "
                    f"axes are {', '.join(AXES)}.")
        if len(set(axes)) != len(axes):
            raise UserError(f"Layout {source!r}: rule {item!r} repeats a mesh axis.")
        rules.append((name, axes))
    return tuple(rules)


def parse(text: str, name: str | None = None) -> Layout:
    """Parses the layout grammar.

      layout  := section ('|' section)*
      section := [target '='] rule (';' rule)*   target: params | opt_state | grads | activations
      rule    := logical ':' mesh_axis ('+' mesh_axis)*

    An unlabelled section is the table for every target; a labelled one replaces
    it for that target. opt_state and grads follow params unless given.
    Example (ZeRO-1): "batch:data | opt_state=embed:data;mlp:data;head_dim:data".
    Example (ZeRO-2): the same plus "| grads=embed:data;mlp:data;head_dim:data": each
    layer's gradient is reduce-scattered over data inside the backward pass's layer
    scan (meshtrain/parallel/grad_reduce.py), so no device holds the stacked gradients whole.
    """
    base: Rules = ()
    given: dict[str, Rules] = {}
    for section in filter(None, (s.strip() for s in text.split("|"))):
        target, sep, body = section.partition("=")
        target = target.strip() if sep else "all targets"
        if sep and target not in TARGETS:
            raise UserError(
                f"Layout {text!r}: section {section!r} names target {target!r}; "
                f"the targets are {', '.join(TARGETS)} (or no 'target=' for all).")
        if target in given:
            raise UserError(
                f"Layout {text!r}: two sections for {target}; the second would silently replace "
                f"the first. Join their rules with ';' in one section.")
        given[target] = parse_rules(body if sep else section, text)
    base = given.pop("all targets", base)
    params = given.get("params", base)
    return Layout(
        name=name or text,
        params=params,
        opt_state=given.get("opt_state", params),
        activations=given.get("activations", base),
        grads=given.get("grads", params),
    )
