"""meshtrain/xla_flags.py: when XLA_FLAGS is set for GPUs, and that every flag is real.

Most tests pass a dict as the environment, so no JAX backend starts; the last two run
this jaxlib's XLA (on CPU: its flag table is the GPU backend's too) in a child process.
"""

import re
import subprocess
import sys

import pytest

from meshtrain.cluster import xla_flags


@pytest.fixture(autouse=True)
def backend_not_started(monkeypatch):
    """Other tests in this process may have started JAX's backend; these behave as before it."""
    monkeypatch.setattr(xla_flags, "_backend_started", lambda: False)


def test_user_xla_flags_are_left_as_given():
    env = {"JAX_PLATFORMS": "cuda", "XLA_FLAGS": "--xla_dump_to=dump"}
    line = xla_flags.apply(env, check=False)
    assert env["XLA_FLAGS"] == "--xla_dump_to=dump"
    assert "used as given" in line and "not added" in line and "\n" not in line


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
        assert f"{len(xla_flags.TABLE)} GPU flags" in line and xla_flags.DOCS in line and "\n" not in line


def test_the_off_switch_runs_with_xla_defaults():
    env = {"JAX_PLATFORMS": "cuda", "MESHTRAIN_XLA_GPU": "0"}
    line = xla_flags.apply(env, check=False)
    assert "XLA_FLAGS" not in env and "MESHTRAIN_XLA_GPU=0" in line


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
    assert env["XLA_FLAGS"] == xla_flags.flag_string({f.name: f.value for f in xla_flags.TABLE})
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
        assert options.get(name) == value, f"{name}: {options.get(name)} (not listed: XLA's default)"


@pytest.mark.parametrize("removed", ["xla_gpu_enable_async_all_gather", "xla_gpu_graph_level"])
def test_the_abort_the_check_guards_against_is_real(removed):
    """Flags older guides still recommend, removed from XLA since: XLA refuses to start."""
    env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--{removed}=true"}
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                           capture_output=True, text=True)
    assert probe.returncode != 0 and f"Unknown flag in XLA_FLAGS: --{removed}" in probe.stderr
