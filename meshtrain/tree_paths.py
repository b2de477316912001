"""Pytree paths as "params/blocks/attn/w_qkv" strings: one naming for error messages,
sharding tables, checkpoint metadata and gradient reports."""

from __future__ import annotations

import jax


def key_name(key) -> str:
    """One path entry (DictKey, GetAttrKey, SequenceKey, FlattenedIndexKey) -> its name."""
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def path_str(path) -> str:
    return "/".join(key_name(k) for k in path)


def flat(tree, is_leaf=None) -> dict[str, object]:
    """{path string: leaf} in flattening order."""
    return {path_str(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]}
