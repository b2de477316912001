"""meshtrain/xla_flags.py: when XLA_FLAGS gets meshtrain's GPU flags, how they merge
with the user's, what launch/slurm.sbatch leaves of them, that every flag is real, and
that a renamed flag is spelled as the installed jaxlib reads it.

Most tests pass a dict as the environment, so no JAX backend starts; the ones that probe
run this jaxlib's XLA (on CPU: its flag table is the GPU backend's too) in a child process.
"""

import importlib.metadata
import os
import re
import subprocess
import sys

import pytest

from meshtrain import xla_flags
from support.processes import ROOT

LHS = "xla_gpu_enable_latency_hiding_scheduler"
AR = "xla_gpu_all_reduce_combine_threshold_bytes"


@pytest.fixture(autouse=True)
def backend_not_started(monkeypatch):
    """Other tests in this process may have started JAX's backend; these behave as before it."""
    monkeypatch.setattr(xla_flags, "_backend_started", lambda: False)


def as_dumped(value: str) -> str:
    """How XLA's `.debug_options` dump writes one of our values: the pipelining enums by
    their proto names (xla.proto's CollectivePipeliningMode), the rest as given."""
    return f"COLLECTIVE_PIPELINING_MODE_{value.upper()}" if value in ("on", "off", "default") else value


def effective(text: str) -> dict[str, str]:
    """The flags XLA reads from an XLA_FLAGS string: the last value of each, a bare --name true."""
    out = {}
    for name, token in xla_flags.user_flags(text):
        out[name] = token.partition("=")[2] or "true"
    return out


def merged(user: str, **env) -> tuple[str, str]:
    env = {"JAX_PLATFORMS": "cuda", "XLA_FLAGS": user, **env}
    line = xla_flags.apply(env, check=False)
    assert "\n" not in line
    return env.get("XLA_FLAGS"), line


def test_a_users_flag_overrides_that_one_entry_and_the_rest_of_ours_are_added():
    flags, line = merged(f"--{LHS}=false")
    ours = xla_flags.flag_string({k: v for k, v in xla_flags.FLAGS.items() if k != LHS})
    assert flags == f"{ours} --{LHS}=false"
    assert effective(flags) == {**xla_flags.FLAGS, LHS: "false"}
    assert f"{len(xla_flags.FLAGS) - 1} of meshtrain's {len(xla_flags.FLAGS)} GPU flags added" in line
    assert f"yours override 1: --{LHS}=false (ours: true)" in line and "other flag" not in line


def test_a_users_unrelated_flags_are_kept_in_order_after_all_of_ours():
    user = '--xla_dump_to=/tmp/d  --xla_gpu_enable_command_buffer="+WHILE" --xla_dump_hlo_as_text'
    flags, line = merged(user)
    assert flags == f"{xla_flags.flag_string()} {user}"  # the user's string exactly as written
    assert [name for name, _ in xla_flags.user_flags(user)] == [
        "xla_dump_to", "xla_gpu_enable_command_buffer", "xla_dump_hlo_as_text"]  # "quoted" stays whole
    assert f"{len(xla_flags.FLAGS)} of meshtrain's" in line and "3 other flags of yours kept" in line
    assert "override" not in line


def test_a_flag_given_twice_is_read_as_xla_reads_it_the_last_value():
    flags, line = merged(f"--{AR}=1 --xla_dump_to=d --{AR}=2")
    assert f"--{AR}=134217728" not in flags and flags.endswith(f"--{AR}=1 --xla_dump_to=d --{AR}=2")
    assert effective(flags)[AR] == "2"
    assert f"yours override 1: --{AR}=2 (ours: 134217728)" in line and "1 other flag of yours kept" in line


def test_a_bare_flag_is_the_users_true_and_ours_is_not_added():
    flags, line = merged(f"--{LHS}")
    assert flags.count(LHS) == 1 and flags.endswith(f" --{LHS}")
    assert effective(flags)[LHS] == "true" and f"yours override 1: --{LHS} (ours: true)" in line


def test_a_user_who_sets_every_flag_gets_exactly_their_string():
    user = " ".join(f"--{k}={v}" for k, v in xla_flags.FLAGS.items())
    flags, line = merged(user)
    assert flags == user and f"0 of meshtrain's {len(xla_flags.FLAGS)}" in line


def test_the_off_switch_adds_none_of_ours():
    flags, line = merged("--xla_dump_to=d", MESHTRAIN_XLA_GPU="0")
    assert flags == "--xla_dump_to=d" and "MESHTRAIN_XLA_GPU=0" in line and "used as given" in line
    env = {"JAX_PLATFORMS": "cuda", "MESHTRAIN_XLA_GPU": "0"}
    line = xla_flags.apply(env, check=False)
    assert "XLA_FLAGS" not in env and "XLA's defaults apply" in line


def template_environment(environ: dict) -> dict:
    """The environment launch/slurm.sbatch gives its tasks: its own export and unset lines,
    run by bash on `environ` (the submitter's, which sbatch passes on)."""
    lines = [line for line in (ROOT / "launch" / "slurm.sbatch").read_text().splitlines()
             if re.match(r"\s*(export|unset)\s", line)]
    assert lines, "the template exports nothing: the test no longer follows it"
    out = subprocess.run(["bash", "-c", "set -euo pipefail\n" + "\n".join(lines) + "\nenv -0"],
                         env=environ, capture_output=True, check=True).stdout.decode()
    return dict(entry.split("=", 1) for entry in out.split("\0") if entry)


@pytest.mark.parametrize("user", ["", f"--{LHS}=false --xla_dump_to=DUMP"])
def test_the_slurm_template_leaves_meshtrain_the_gpu_flags(user, tmp_path):
    """A task of the sbatch job on a GPU node: the template's environment, then train's apply()
    with the probe (on CPU). The result is our whole table, with the user's values winning."""
    user = user.replace("DUMP", str(tmp_path))
    submitter = {"PATH": os.environ["PATH"], **({"XLA_FLAGS": user} if user else {})}
    env = template_environment(submitter)
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.90" and env["NCCL_DEBUG"] == "WARN"
    line = xla_flags.apply(env, platform="cuda")
    assert effective(env["XLA_FLAGS"]) == {**xla_flags.FLAGS, **effective(user)}
    assert "left out" not in line and "none added" not in line
    if not user:
        assert env["XLA_FLAGS"] == xla_flags.flag_string()
        return
    # And XLA reads them so: its dump lists the options that differ from its defaults.
    subprocess.run([sys.executable, "-c", "import jax; jax.jit(lambda x: x + 1)(1.0)"],
                   env={**env, "JAX_PLATFORMS": "cpu"}, check=True, capture_output=True)
    (dumped,) = tmp_path.glob("*.debug_options")
    options = dict(line.split(": ", 1) for line in dumped.read_text().splitlines())
    assert LHS not in options  # the user's false, XLA's default
    assert all(options.get(k) == as_dumped(v) for k, v in xla_flags.FLAGS.items() if k != LHS)


def test_nothing_is_set_or_said_off_the_gpu():
    for env in ({"JAX_PLATFORMS": "cpu"}, {"JAX_PLATFORMS": "cpu,cuda"}, {"JAX_PLATFORMS": "tpu"}):
        assert xla_flags.apply(env, check=False) == ""
        assert "XLA_FLAGS" not in env
    env = {"JAX_PLATFORMS": "cuda"}
    assert xla_flags.apply(env, platform="cpu", check=False) == ""  # the caller's word wins
    assert "XLA_FLAGS" not in env


def test_on_a_gpu_the_flags_are_set_and_the_line_says_where_they_are_documented():
    for platforms in ("cuda", "gpu", "cuda,cpu"):
        env = {"JAX_PLATFORMS": platforms, "XLA_FLAGS": "  "}  # blank counts as unset
        line = xla_flags.apply(env, check=False)
        assert env["XLA_FLAGS"] == xla_flags.flag_string()
        assert f"{len(xla_flags.TABLE)} of meshtrain's {len(xla_flags.TABLE)} GPU flags added" in line
        assert xla_flags.DOCS in line and "\n" not in line and "yours" not in line


def test_after_the_backend_started_nothing_is_set(monkeypatch):
    monkeypatch.setattr(xla_flags, "_backend_started", lambda: True)
    env = {"JAX_PLATFORMS": "cuda"}
    assert "already started" in xla_flags.apply(env, check=False) and "XLA_FLAGS" not in env


def test_without_jax_platforms_a_cuda_plugin_decides(monkeypatch):
    monkeypatch.setattr(xla_flags, "_installed", lambda m: m == "jax_cuda12_plugin")
    assert xla_flags.on_gpu({}) == (True, "CUDA plugin jax_cuda12_plugin")
    monkeypatch.setattr(xla_flags, "_installed", lambda m: False)
    assert xla_flags.on_gpu({})[0] is False


def test_every_flag_has_a_reason_and_a_source_and_parses_as_name_value_tokens():
    assert len(xla_flags.FLAGS) == len(xla_flags.TABLE) >= 5  # no name twice
    for f in xla_flags.TABLE:
        assert f.name.startswith("xla_gpu_") and f.value
        assert len(f.reason) > 30 and f.source
    tokens = xla_flags.flag_string().split(" ")
    assert len(tokens) == len(xla_flags.TABLE)
    parsed = dict(re.fullmatch(r"--([a-z0-9_]+)=(\S+)", t).groups() for t in tokens)
    assert parsed == xla_flags.FLAGS


def test_a_flag_this_jaxlib_does_not_know_is_left_out(monkeypatch):
    """The child-process parse finds the unknown flag; the others are still set."""
    monkeypatch.setattr(xla_flags, "FLAGS", {**xla_flags.FLAGS, "xla_gpu_no_such_flag": "true"})
    env = {"JAX_PLATFORMS": "cuda"}
    line = xla_flags.apply(env)
    assert "no_such_flag" not in env["XLA_FLAGS"]
    assert env["XLA_FLAGS"] == xla_flags.flag_string(
        {k: v for k, v in xla_flags.FLAGS.items() if k != "xla_gpu_no_such_flag"})
    assert "left out, unknown to this jaxlib: xla_gpu_no_such_flag" in line


def test_every_flag_exists_in_this_jaxlib_and_changes_an_xla_default(tmp_path):
    """XLA aborts on an unknown flag, and its dump's `.debug_options` lists only the options
    that differ from XLA's defaults: every one of ours must be listed, with our value."""
    env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_dump_to={tmp_path} {xla_flags.flag_string()}"}
    subprocess.run([sys.executable, "-c", "import jax; jax.jit(lambda x: x + 1)(1.0)"], env=env,
                   check=True, capture_output=True)
    (dumped,) = tmp_path.glob("*.debug_options")
    options = dict(line.split(": ", 1) for line in dumped.read_text().splitlines())
    for name, value in xla_flags.FLAGS.items():
        got = options.get(name)
        assert got == as_dumped(value), f"{name}: {got} (not listed: XLA's default)"


@pytest.mark.parametrize("removed", ["xla_gpu_enable_async_all_gather", "xla_gpu_graph_level"])
def test_the_abort_the_check_guards_against_is_real(removed):
    """Flags older guides still recommend, removed from XLA since: XLA refuses to start."""
    env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--{removed}=true"}
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                           capture_output=True, text=True)
    assert probe.returncode != 0 and f"Unknown flag in XLA_FLAGS: --{removed}" in probe.stderr


AG_OLD, AG_NEW = "xla_gpu_enable_pipelined_all_gather", "xla_gpu_pipeline_all_gather"
AR_OLD, AR_NEW = "xla_gpu_enable_pipelined_all_reduce", "xla_gpu_pipeline_all_reduce"


@pytest.mark.parametrize("version, enums", [
    ("0.10.2", False), ("0.11.0", False), ("0.11.1.dev20260720", False), (None, False), ("abc", False),
    ("0.11.1", True), ("0.11.2", True), ("0.11.1.dev20260801", True), ("0.12.0.1", True)])
def test_collective_pipelining_is_spelled_as_the_jaxlib_reads_it(version, enums):
    """XLA's booleans --xla_gpu_enable_pipelined_*=true became --xla_gpu_pipeline_*=on in the
    XLA of jaxlib 0.11.1 (meshtrain/xla_flags.py, RENAMED): older or unknown versions
    get the booleans, which every jaxlib so far reads; newer ones the enums."""
    flags = xla_flags.flags_for(version)
    if enums:
        assert flags[AG_NEW] == flags[AR_NEW] == "on" and AG_OLD not in flags and AR_OLD not in flags
    else:
        assert flags[AG_OLD] == flags[AR_OLD] == "true" and AG_NEW not in flags and AR_NEW not in flags
    assert len(flags) == len(xla_flags.TABLE) and flags[LHS] == "true"  # the others as in the table


def test_the_installed_jaxlib_decides_the_spelling_without_importing_jax():
    assert xla_flags.FLAGS == xla_flags.flags_for(importlib.metadata.version("jaxlib"))
    probe = subprocess.run([sys.executable, "-c",
                            "import sys; from meshtrain import xla_flags; xla_flags.apply("
                            "{'JAX_PLATFORMS': 'cuda'}, check=False); "
                            "assert not {'jax', 'jaxlib'} & set(sys.modules), 'JAX imported'"],
                           cwd=ROOT, capture_output=True, text=True)
    assert probe.returncode == 0, probe.stderr


@pytest.mark.parametrize("ours, users", [("0.11.2", f"--{AG_OLD}=false"), ("0.10.2", f"--{AG_NEW}=off")])
def test_a_users_flag_in_the_other_spelling_still_overrides_ours(monkeypatch, ours, users):
    """Both spellings set one XLA option, so the user's, in either, leaves ours out."""
    monkeypatch.setattr(xla_flags, "FLAGS", xla_flags.flags_for(ours))
    flags, line = merged(users)
    assert AG_OLD not in flags.replace(users, "") and AG_NEW not in flags.replace(users, "")
    assert flags.endswith(users) and (AR_NEW in flags) == (ours == "0.11.2")
    assert f"yours override 1: {users} (ours: {'on' if ours == '0.11.2' else 'true'})" in line


def test_an_enum_spelling_this_jaxlib_rejects_falls_back_to_the_boolean(monkeypatch):
    """Should the 0.11.1 boundary be wrong, the probe finds the enum names unknown and the
    table's booleans go in instead. Run against this jaxlib as if it were 0.11.2."""
    if xla_flags.reads_pipeline_enums(importlib.metadata.version("jaxlib")):
        pytest.skip("this jaxlib reads the enum spelling")
    monkeypatch.setattr(xla_flags, "FLAGS", xla_flags.flags_for("0.11.2"))
    env = {"JAX_PLATFORMS": "cuda"}
    line = xla_flags.apply(env)
    assert effective(env["XLA_FLAGS"]) == xla_flags.flags_for("0.10.2")
    assert f"{len(xla_flags.TABLE)} of meshtrain's" in line and "left out" not in line


def test_a_compile_option_this_jaxlib_lacks_is_left_out_of_the_analysis_compile():
    """JAX 0.11 retired xla_cpu_use_fusion_emitters, and one unknown option fails a whole
    compile ("No such compile option"): known_options keeps the rest, and the analysis
    compile takes only what this jaxlib has."""
    from meshtrain.run.compile_options import ANALYSIS_OPTIONS, analysis_options, known_options
    import jax
    asked = {"xla_cpu_no_such_option": False, "xla_backend_optimization_level": 0}
    assert known_options(asked) == {"xla_backend_optimization_level": 0}
    with pytest.raises(jax.errors.JaxRuntimeError, match="No such compile option"):
        jax.jit(lambda x: x * 2).lower(1.0).compile(asked)
    assert set(analysis_options()) <= set(ANALYSIS_OPTIONS)
    assert jax.jit(lambda x: x * 2, compiler_options=analysis_options())(3.0) == 6.0


def test_the_planners_fast_compile_flags_leave_out_what_this_jaxlib_lacks(monkeypatch):
    """`meshtrain plan` puts the analysis options into XLA_FLAGS before JAX starts; an option
    this jaxlib lacks would abort the process there, so it is parsed first and left out."""
    from meshtrain import planner
    from meshtrain.run import compile_options
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.setitem(compile_options.ANALYSIS_OPTIONS, "xla_cpu_no_such_option", False)
    added = planner.fast_compile()
    assert added == {k: str(v).lower() for k, v in compile_options.ANALYSIS_OPTIONS.items() if k != "xla_cpu_no_such_option"}
    flags = os.environ["XLA_FLAGS"]
    assert "--xla_backend_optimization_level=0" in flags and "no_such_option" not in flags
    assert planner.fast_compile() == {}  # set already: nothing parsed or added again
