"""Every test process gets 8 fake CPU devices, set before JAX starts its backend, one
persistent compilation cache for the whole run, and W&B in its offline mode."""

import gc
import os
import shutil
import tempfile

# One persistent compilation cache for every process of a run: the xdist workers and every
# process a test starts inherit this environment, so a program compiled once (say the tiny
# GPT-2's step that a dozen files and subprocesses train) is read back everywhere else.
# The directory belongs to the run: the first process (the xdist controller, or the only
# one) makes it and removes it at the end, so no entry outlives the code that wrote it.
# MESHTRAIN_TEST_JAX_CACHE=DIR keeps one across runs instead; JAX's key for an entry is
# the program itself with the jax and jaxlib versions, the backend and the XLA flags, so
# a kept entry is only ever read for the program that wrote it.
# MESHTRAIN_TEST_JAX_CACHE=off runs without one (to measure what it saves).
_OWNED_CACHE = None
if "MESHTRAIN_TEST_JAX_CACHE" not in os.environ:
    _OWNED_CACHE = os.environ["MESHTRAIN_TEST_JAX_CACHE"] = tempfile.mkdtemp(prefix="meshtrain-jax-cache-")
if os.environ["MESHTRAIN_TEST_JAX_CACHE"] != "off":
    os.environ.update({
        "JAX_COMPILATION_CACHE_DIR": os.environ["MESHTRAIN_TEST_JAX_CACHE"],
        # Programs that took 0.2 s or more to compile: the steps, inits and evals that files
        # and subprocesses share. Not the thousands of eager ops and small kernels below it,
        # whose entries cost more to write than they save: under the file lock below a put
        # took about 26 ms beside a 34 ms compile (450 eager ops: 15.5 s uncached, 27.3 s
        # cached), and five unit-test files ran 85-90 s with every program cached, 77-78 s
        # from 0.2 s (428 entries against 90); three CLI-process files 90-94 s, 80-83 s.
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.2",
        # A size limit turns on the cache's file lock, so no process reads an entry another
        # is still writing (the limit itself is far above what the suite writes).
        "JAX_COMPILATION_CACHE_MAX_SIZE": str(16 * 2**30),
    })

# How XLA:CPU compiles the suite's programs (processes the tests start inherit it; an
# XLA_FLAGS that sets one of these itself wins):
# - LLVM at -O1: XLA:CPU spends about half of each compile in LLVM, and the suite compiles
#   over a thousand distinct programs that then run a few tiny steps each;
# - XLA's classic loop emitters instead of its MLIR fusion emitters, with LLVM's expensive
#   passes off: the compile-bound files a fifth faster again (docs/testing.md);
# - LLVM's code generation in one piece, not split over a thread pool: with both cores
#   busy with the two xdist workers, the split only adds work (a compile's CPU time -10%).
# None touches the partitioned HLO (every sharding and collective the tests check). The
# emitters change how a few ops become loops (a scatter-add becomes a `while`), so the
# tests that read a step's loops or buffers compile it with users' emitters
# (support.training.USERS_EMITTERS).
# A flag this jaxlib does not know aborts every process at its backend's start (JAX 0.11
# retired xla_cpu_use_fusion_emitters), so the ones not yet set are parsed first in one
# child process (about a second, in the first process only: the others inherit them set).
SUITE_XLA_FLAGS = {"xla_backend_optimization_level": "1", "xla_cpu_use_fusion_emitters": "false",
                   "xla_llvm_disable_expensive_passes": "true", "xla_cpu_parallel_codegen_split_count": "1"}
from meshtrain.xla_flags import add_known  # noqa: E402 - imports no JAX

add_known(SUITE_XLA_FLAGS)

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

# The commands' collector thresholds (cli.GC_THRESHOLDS) in the test processes too: at
# Python's default the collector's full passes over the heap took 5-6% of a compile-bound
# file's time (test_equivalence + test_pipeline in one process: 18 full passes, 4.1 s of
# 66 s; at 10,000: 1 pass, 0.7 s, the same peak memory).
from meshtrain.cli import GC_THRESHOLDS  # noqa: E402

gc.set_threshold(*GC_THRESHOLDS)

# train.trackers=wandb runs in W&B's offline mode in every test and every process a test
# starts (they inherit this environment): no test reaches the network.
os.environ["WANDB_MODE"] = "offline"


import pytest  # noqa: E402

from support.configs import configured  # noqa: E402

pytest_plugins = ["support.suite_clock"]


def pytest_unconfigure(config):
    if _OWNED_CACHE and not hasattr(config, "workerinput"):
        shutil.rmtree(_OWNED_CACHE, ignore_errors=True)


@pytest.fixture
def make_config():
    """make_config("gpt2_tiny_dp8", **{"train.steps": "3"}) -> locked ConfigDict."""
    return configured


@pytest.fixture(scope="session")
def gpt2_tiny_one_device():
    """gpt2_tiny_dp8 trained support.training.STEPS steps of its COMPARED runs on one device:
    (losses [STEPS], first-step gradients), the reference of the GPT-2 layout tests in
    several files (built once per xdist worker); its
    gradients from a plain jax.grad program, not read off the step as the layouts' are."""
    from support.training import COMPARED, devices_for, losses_and_grads
    return losses_and_grads(configured("gpt2_tiny_dp8", **COMPARED, **{"mesh.shape": "data:1"}),
                            devices=devices_for("data:1"))
