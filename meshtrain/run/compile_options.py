"""How a program compiles when it is only read, or run a few steps: the compiler options,
as this jaxlib takes them (`known_options`), and the thresholds that choose them
(docs/testing.md, "Analysis compiles")."""

from __future__ import annotations

import functools
from typing import Any

import jax

# A step compiled to be read, not run, needs no fast machine code: XLA:CPU's LLVM
# optimisations and fusion emitters go (half of a CPU compile and more), and the partitioned
# HLO, its collectives and FLOPs stay the same; the buffer peak moves by a few hundred bytes
# (measured on GPT-2, Llama and Mixtral tiny; docs/planner.md).
ANALYSIS_OPTIONS = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True,
                    "xla_cpu_use_fusion_emitters": False}
# And a step run this many times at most (`plan --verify`; not `train`, whose resumed runs would
# differ in last bits): -O1 1.5 CPU-s + 0.11 a step, -O0 0.5 + 0.3 (gpt2_tiny_dp8; docs/testing.md).
SHORT_RUN_STEPS = 5


# The init program runs once. On CPU the analysis options compile it about 2x faster (0.3-0.5
# CPU-s less for the tiny configs) and run it 2-4x slower, in proportion to the numbers it
# draws: the parameters times the devices holding each. gpt2_tiny_dp8 (125 K parameters,
# replicated on 8 devices) runs +0.07 s; gpt2_small_dp8 (124 M) 60 -> 108 CPU-s. Decided by
# the parameter count alone, so every layout of a model draws the same numbers (an -O0 init
# differs from an -O1 one in the last bits of a few percent of its normal draws).
QUICK_INIT_PARAMS = 500_000


def known_options(options: dict[str, Any]) -> dict[str, Any]:
    """`options` less those this jaxlib's compiler does not have: XLA renames and retires
    its debug options between releases (JAX 0.11 has no `xla_cpu_use_fusion_emitters`), and
    one unknown option fails the whole compile. Each is tried once per process on a
    one-op program."""
    return {k: v for k, v in options.items() if _known(k, v)}


@functools.cache
def _known(name: str, value: Any) -> bool:
    probe = jax.jit(lambda x: x + 1).lower(jax.ShapeDtypeStruct((), jax.numpy.float32))
    try:
        probe.compile({name: value})
    except jax.errors.JaxRuntimeError as e:
        if "No such compile option" not in str(e):
            raise
        return False
    return True


def analysis_options() -> dict[str, Any]:
    """ANALYSIS_OPTIONS as this jaxlib takes them (`known_options`)."""
    return known_options(ANALYSIS_OPTIONS)
