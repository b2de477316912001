"""Layouts map logical axis names to mesh axes; see rules.py for the algorithm."""

from meshtrain.parallel.layouts.presets import PIPELINE_PRESETS, PRESETS, get
from meshtrain.parallel.layouts.rules import Layout, parse, resolve
from meshtrain.parallel.layouts.vocabulary import VOCABULARY

__all__ = ["PIPELINE_PRESETS", "PRESETS", "VOCABULARY", "Layout", "get", "parse", "resolve"]
