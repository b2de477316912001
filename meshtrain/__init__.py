"""meshtrain: train Flax models on an n-dimensional device mesh.

The commands are `meshtrain COMMAND` (or `python -m meshtrain.COMMAND`); `python -m
meshtrain` lists them. docs/architecture.md says which files to read first.
"""

__version__ = "0.1.0"
