"""The XLA flags meshtrain sets for training on NVIDIA GPUs, in one table (docs/xla_flags.md).

XLA reads XLA_FLAGS once, when the JAX backend starts, and aborts the process on a flag
it does not know. So `apply()` runs before anything touches a device, and decides
"GPU?" without starting the backend:

    JAX_PLATFORMS set         its first entry: cuda or gpu -> GPU, anything else -> not
    else                      a CUDA plugin for jax is installed (`jax[cuda12]` or
                              `jax[cuda13]` install jax_cuda1X_plugin)

Precedence: MESHTRAIN_XLA_GPU=0 adds none of ours (XLA_FLAGS, if set, is used as given);
otherwise, on a GPU, our flags are merged with the user's XLA_FLAGS: the user's string is
kept as written, after ours, and a flag of ours that the user sets (`--name=value`, or a
bare `--name`, which XLA reads as true, under either spelling of a renamed flag) is left
out, so the user's value wins. Each flag was checked against the XLA inside jaxlib 0.10.2,
which shares its flag table between the CPU and GPU backends: it parses, and its value
differs from XLA's default (tests/test_xla_flags.py checks both). Flags XLA renamed since
are given in the spelling the installed jaxlib reads, told from its version in the package
metadata (`flags_for`, `RENAMED`). A later jaxlib may drop a flag, so `apply` first parses
the ones it adds in a CPU-only child process and leaves out any it rejects (the user's
flags are the user's: XLA itself says if one is unknown).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import MutableMapping
from typing import NamedTuple

DOCS = "docs/xla_flags.md"
OFF_SWITCH = "MESHTRAIN_XLA_GPU"
GPU_PLATFORMS = ("cuda", "gpu")
CUDA_PLUGINS = ("jax_cuda13_plugin", "jax_cuda12_plugin", "jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12")

# Sources, short names used below:
#   jax-perf   JAX's GPU performance tips, docs/gpu_performance_tips.md (jax-ml/jax)
#   jax-tbx    NVIDIA JAX-Toolbox, docs/GPU_performance.md ("Tips for High-Performance LLMs")
#   maxtext    AI-Hypercomputer/maxtext, src/MaxText/configs/a3/llama_2_7b/1vm.sh (8 x H100)


class Flag(NamedTuple):
    name: str
    value: str
    reason: str   # why it helps training throughput
    source: str


TABLE: tuple[Flag, ...] = (
    Flag("xla_gpu_enable_latency_hiding_scheduler", "true",
         "schedules asynchronous collectives (gradient all-reduce, FSDP all-gather and "
         "reduce-scatter, pipeline sends) to run under compute instead of waiting for them; "
         "XLA's default is off", "jax-perf; jax-tbx; maxtext"),
    Flag("xla_gpu_all_reduce_combine_threshold_bytes", "134217728",
         "merges the per-parameter gradient all-reduces into ones of up to 128 MiB (default "
         "30 MiB): fewer NCCL launches, each nearer full link bandwidth", "jax-perf; maxtext"),
    Flag("xla_gpu_all_gather_combine_threshold_bytes", "134217728",
         "merges FSDP weight all-gathers up to 128 MiB (default 30 MiB), so a layer's weights "
         "arrive in one collective instead of one per matrix", "jax-perf; jax-tbx; maxtext"),
    Flag("xla_gpu_reduce_scatter_combine_threshold_bytes", "67108864",
         "merges FSDP gradient reduce-scatters up to 64 MiB (default 30 MiB), for the same "
         "reason as the all-gathers", "jax-perf; jax-tbx; maxtext"),
    Flag("xla_gpu_enable_pipelined_all_gather", "true",
         "in the scanned layer loop, starts the next layer's weight all-gather during this "
         "layer's compute (FSDP); default off", "jax-tbx; maxtext"),
    Flag("xla_gpu_enable_pipelined_all_reduce", "true",
         "in the scanned layer loop, overlaps a layer's gradient all-reduce with the backward "
         "of the layer before it (data parallel); default off", "jax-tbx; maxtext"),
    Flag("xla_gpu_enable_while_loop_double_buffering", "true",
         "unrolls the layer loop by two, so the pipelined collectives of one layer have the "
         "next layer's compute to hide under; default off", "jax-tbx; maxtext"),
)

# Collective pipelining has two spellings. openxla/xla PR #45836 (XLA commit bdd11ba,
# 2026-07-23) replaced the booleans --xla_gpu_enable_pipelined_{all_gather,all_reduce,
# reduce_scatter} by enums --xla_gpu_pipeline_{...}=default|off|on|explicit, and kept the
# booleans as deprecated aliases (true -> on, false -> default): a jaxlib with that XLA reads
# both, an older one only the booleans. jax's main branch took it on 2026-07-24 (jax commit
# 30a436d), after the 0.11.0 release (XLA 131bf41, 2026-07-15); JAX cuts each release from
# main, so jaxlib 0.11.1 is the first release with the enums (and a 0.11.1 nightly built
# after that day). That boundary is read off the two repositories' histories, not off a 0.11.1
# wheel. Guessing low costs nothing (the booleans still parse); guessing high, `usable` finds
# the enum names unknown and gives the booleans instead.
RENAMED: dict[str, tuple[str, str]] = {  # table name -> (enum name, value) from PIPELINE_ENUMS
    "xla_gpu_enable_pipelined_all_gather": ("xla_gpu_pipeline_all_gather", "on"),
    "xla_gpu_enable_pipelined_all_reduce": ("xla_gpu_pipeline_all_reduce", "on"),
}
PIPELINE_ENUMS = ((0, 11, 1), 20260725)  # first jaxlib release, first nightly (.devYYYYMMDD)
TABLE_NAME = {new: old for old, (new, _) in RENAMED.items()}  # either spelling -> the table's


def jaxlib_version() -> str | None:
    """The installed jaxlib's version, from its package metadata (None: not installed), so
    that nothing of JAX is imported before XLA_FLAGS is set."""
    try:
        return importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        return None


def reads_pipeline_enums(version: str | None) -> bool:
    """Whether jaxlib `version` ("0.11.2", "0.11.1.dev20260801") knows --xla_gpu_pipeline_*.
    An unknown version gets False: every jaxlib so far reads the boolean spelling."""
    m = re.match(r"(\d+)\.(\d+)\.(\d+)(?:\.dev(\d{8}))?", version or "")
    if not m:
        return False
    release, first_nightly = PIPELINE_ENUMS
    base = tuple(int(x) for x in m.groups()[:3])
    if base != release:
        return base > release
    return m.group(4) is None or int(m.group(4)) >= first_nightly


def flags_for(version: str | None) -> dict[str, str]:
    """The table as {name: value}, each flag in the spelling jaxlib `version` reads."""
    enums = reads_pipeline_enums(version)
    return dict(RENAMED[f.name] if enums and f.name in RENAMED else (f.name, f.value) for f in TABLE)


FLAGS: dict[str, str] = flags_for(jaxlib_version())


def flag_string(flags: dict[str, str] | None = None) -> str:
    """`--name=value --name=value ...`, as XLA_FLAGS takes them."""
    return " ".join(f"--{k}={v}" for k, v in (FLAGS if flags is None else flags).items())


def on_gpu(environ: MutableMapping[str, str], platform: str | None = None) -> tuple[bool, str]:
    """Whether JAX will run on an NVIDIA GPU, decided without starting its backend: (yes, why).
    `platform`, when the caller knows it, wins over the environment."""
    if platform:
        return platform.lower() in GPU_PLATFORMS, f"platform {platform!r}"
    chosen = [p.strip().lower() for p in environ.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if chosen:
        return chosen[0] in GPU_PLATFORMS, f"JAX_PLATFORMS={environ['JAX_PLATFORMS']}"
    plugin = next((m for m in CUDA_PLUGINS if _installed(m)), None)
    return plugin is not None, f"CUDA plugin {plugin}" if plugin else "no CUDA plugin for jax installed"


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that is missing or broken
        return False


def _backend_started() -> bool:
    """Whether this process's JAX backend is up (then XLA_FLAGS is read already)."""
    if "jax" not in sys.modules:
        return False
    from jax._src import xla_bridge  # no public query for this; stable since 0.4
    return xla_bridge.backends_are_initialized()


def rejected(flags: dict[str, str], environ: MutableMapping[str, str]) -> tuple[list[str], str]:
    """Parses `flags` in a CPU-only child process, the way the backend will: -> (names this
    jaxlib does not know, another failure's last line or ""). The flag table is shared by
    XLA's backends, so a CPU parse answers for the GPU one, and costs about a second."""
    env = {**environ, "XLA_FLAGS": flag_string(flags), "JAX_PLATFORMS": "cpu"}
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                           capture_output=True, text=True)
    if probe.returncode == 0:
        return [], ""
    unknown = re.findall(r"Unknown flags? in XLA_FLAGS: --([A-Za-z0-9_]+)", probe.stderr)
    if unknown:
        return unknown, ""
    lines = [line for line in probe.stderr.strip().splitlines() if line.strip()]
    return [], lines[-1] if lines else f"exit status {probe.returncode}"


TOKEN = re.compile(r'(?:[^\s"]|"[^"]*")+')  # XLA's tokens: split on blanks, "quoted" kept whole
FLAG = re.compile(r"--([A-Za-z0-9_]+)(?:=(.*))?", re.S)


def user_flags(text: str) -> list[tuple[str | None, str]]:
    """The tokens of an XLA_FLAGS string, in order, each with its flag's name (None for a
    token that is not `--name` or `--name=value`)."""
    return [((m := FLAG.fullmatch(t)) and m.group(1), t) for t in TOKEN.findall(text)]


def merge(user: str, flags: dict[str, str]) -> tuple[str, dict[str, str]]:
    """(XLA_FLAGS with `flags` and the user's string, the ones of `flags` the user's string
    does not set, in either spelling). Ours come first and the user's string follows as
    written: XLA keeps the last value of a flag given twice, and ours that the user sets are
    left out anyway."""
    theirs = {TABLE_NAME.get(name, name) for name, _ in user_flags(user)}
    added = {k: v for k, v in flags.items() if TABLE_NAME.get(k, k) not in theirs}
    return " ".join(s for s in (flag_string(added), user.strip()) if s), added


def usable(flags: dict[str, str], environ: MutableMapping[str, str]) -> tuple[dict[str, str], list[str], str]:
    """(`flags` less those this jaxlib rejects, the names rejected, a failed parse's last line or "").
    A rejected enum spelling of a renamed flag is replaced by the table's boolean one, which
    every jaxlib so far reads: the version rule in `reads_pipeline_enums` is inferred."""
    flags, dropped = dict(flags), []
    while flags:
        unknown, failure = rejected(flags, environ)
        if failure:
            return {}, dropped, failure
        unknown = [u for u in unknown if u in flags]
        if not unknown:
            break
        for name in unknown:
            del flags[name]
            if name in TABLE_NAME:
                old = TABLE_NAME[name]
                flags[old] = next(f.value for f in TABLE if f.name == old)
            else:
                dropped.append(name)
    return flags, dropped, ""


def add_known(flags: dict[str, str], environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Adds to XLA_FLAGS in `environ` the flags of `flags` it does not set already and this
    jaxlib knows (one child-process parse, `usable`; none when that parse fails otherwise):
    for flags of the caller's own, such as the suite's or the planner's, before the backend
    starts. -> the flags added."""
    user = environ.get("XLA_FLAGS", "").strip()
    _, wanted = merge(user, flags)
    if not wanted:
        return {}
    known, _, failure = usable(wanted, environ)
    if failure or not known:
        return {}
    environ["XLA_FLAGS"], added = merge(user, known)
    return added


def describe(added: dict[str, str], user: str, dropped: list[str], why: str) -> str:
    """The start-up line: how many of ours went in, which the user's XLA_FLAGS overrode."""
    tokens = [(TABLE_NAME.get(name, name), token) for name, token in user_flags(user)]
    ours = {TABLE_NAME.get(k, k): v for k, v in FLAGS.items()}
    last = {name: token for name, token in tokens if name in ours}  # XLA reads the last one
    parts = [f"XLA flags: {len(added)} of meshtrain's {len(FLAGS)} GPU flags added to XLA_FLAGS "
             f"({why}; {DOCS})"]
    if last:
        parts.append(f"yours override {len(last)}: "
                     + ", ".join(f"{token} (ours: {ours[name]})" for name, token in last.items()))
    others = sum(name not in ours for name, _ in tokens)
    if others:
        parts.append(f"{others} other flag{'s' * (others != 1)} of yours kept")
    if dropped:
        parts.append(f"left out, unknown to this jaxlib: {', '.join(dropped)}")
    return "; ".join(parts) + f". {OFF_SWITCH}=0 adds none of ours."


def apply(environ: MutableMapping[str, str] = os.environ, platform: str | None = None,
          check: bool = True) -> str:
    """On a GPU, merges our flags into XLA_FLAGS in `environ` (the user's flags win, see
    `merge`), unless MESHTRAIN_XLA_GPU=0. Call before the JAX backend starts. Returns the
    line to log ("" when not on a GPU: nothing to say). `check` parses the flags it adds in
    a child process first and drops the ones this jaxlib rejects."""
    gpu, why = on_gpu(environ, platform)
    if not gpu:
        return ""
    user = environ.get("XLA_FLAGS", "").strip()
    as_given = "XLA_FLAGS is used as given" if user else "XLA's defaults apply"
    if environ.get(OFF_SWITCH, "").strip() == "0":
        return f"XLA flags: {OFF_SWITCH}=0, so none of meshtrain's are added; {as_given} ({DOCS})."
    if _backend_started():
        return (f"XLA flags: none added, the JAX backend had already started in this process; "
                f"{as_given} ({DOCS}).")
    _, wanted = merge(user, FLAGS)
    flags, dropped, failure = usable(wanted, environ) if check else (wanted, [], "")
    if failure:
        return (f"XLA flags: none added: a CPU-only parse of them failed ({failure}); {as_given} "
                f"({DOCS}).")
    if wanted and not flags:
        return (f"XLA flags: this jaxlib rejects all {len(wanted)} of meshtrain's GPU flags; "
                f"{as_given} ({DOCS}).")
    environ["XLA_FLAGS"], _ = merge(user, flags)
    return describe(flags, user, dropped, why)
