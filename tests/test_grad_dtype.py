"""train.grad_dtype and optim.mu_dtype: what they send and store, and that they change
nothing else.

Bytes come from the compiled HLO (hlo.collective_table, which counts the CPU's widened
bfloat16 collectives at 16 bits, as a GPU sends them). The steps, read and then run for a
few steps of a tiny model, compile with the planner's analysis options
(compile_options.ANALYSIS_OPTIONS: the same HLO, 3x faster to compile, slower code).
"""

import jax
import numpy as np
import pytest

from meshtrain.errors import UserError
from meshtrain.planner import hlo
from meshtrain.run.experiment import Experiment
from support.configs import configured
from support.training import TOKENS, stepped

STEPS = 3


def train(make_config, name, **overrides):
    """(count and bytes each device sends of the step's all-reduces over `data`; losses and
    grad norms of STEPS steps; final params), compiling the step once."""
    exp = Experiment.build(make_config(name, **{**TOKENS, **overrides}))
    step = exp.compile(analysis=True)
    rows = [r for r in hlo.collective_table(step, exp.mesh, lambda d: 0)
            if r["kind"] == "all-reduce" and r["mesh_axes"] == ("data",)]
    history = []
    for state, metrics in stepped(exp, STEPS, step=step):
        history.append((float(metrics["loss"]), float(metrics["grad_norm"])))
    return (sum(r["count"] for r in rows), sum(r["bytes"] for r in rows), np.array(history),
            jax.device_get(state.params))


@pytest.fixture(scope="module")
def fp32_dp8(request):
    return {gd: train(configured, "gpt2_tiny_dp8", **{"train.grad_dtype": gd})
            for gd in ("", "float32", "bfloat16")}


def test_bf16_reduction_halves_the_data_all_reduce_bytes(fp32_dp8):
    _, default_bytes, _, _ = fp32_dp8[""]
    count, bf16_bytes, _, _ = fp32_dp8["bfloat16"]
    assert count == 1
    assert bf16_bytes == pytest.approx(default_bytes / 2, rel=1e-6)


def test_float32_reduction_by_hand_equals_xla_reduction(fp32_dp8):
    _, default_bytes, ref, ref_params = fp32_dp8[""]
    _, nbytes, hist, params = fp32_dp8["float32"]
    assert nbytes == pytest.approx(default_bytes, rel=1e-6)
    np.testing.assert_allclose(hist, ref, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), params, ref_params)


def test_bf16_reduction_costs_only_gradient_rounding(fp32_dp8):
    """The loss of the first step is the same forward; later steps and gradient norms move
    by about bfloat16's relative precision (2^-8), not more."""
    ref, hist = fp32_dp8[""][2], fp32_dp8["bfloat16"][2]
    assert hist[0, 0] == ref[0, 0]
    np.testing.assert_allclose(hist, ref, rtol=2 ** -8)


@pytest.mark.parametrize("name, overrides", [
    ("gpt2_tiny_dp8", {"model.dtype": "bfloat16", "train.grad_dtype": "float32"}),
    ("gpt2_tiny_dp2_fsdp2_tp2", {"train.grad_dtype": "float32"}),
    ("gpt2_tiny_pp2_dp4", {"train.grad_dtype": "float32"}),
])
def test_reduction_by_hand_trains_like_the_default(name, overrides, make_config):
    """Across layouts (data x fsdp x tensor, pipeline), a float32 reduction by hand gives
    the default's losses; in bf16 compute it doubles the default's bfloat16 bytes."""
    base = {k: v for k, v in overrides.items() if k != "train.grad_dtype"}
    count, nbytes, hist, _ = train(make_config, name, **overrides)
    ref_count, ref_bytes, ref, _ = train(make_config, name, **base)
    np.testing.assert_allclose(hist[:, 0], ref[:, 0], rtol=1e-4 if base else 1e-5)
    if base:  # bf16 compute: the default reduces matrices in bf16
        assert nbytes == pytest.approx(2 * ref_bytes, rel=0.01)


def test_microbatches_reduce_once_per_step(make_config):
    """XLA all-reduces each microbatch's gradient when left to itself; the step reduces the
    accumulated per-replica gradients once, so 4 microbatches send what 1 does (32 rows:
    a row a replica a microbatch)."""
    rows = {"train.batch_size": "32"}
    one = train(make_config, "gpt2_tiny_dp8", **rows)
    four = train(make_config, "gpt2_tiny_dp8", **rows, **{"train.grad_accum_steps": 4})
    assert four[0] == 1 and four[1] == pytest.approx(one[1], rel=1e-6)
    np.testing.assert_allclose(four[2], one[2], rtol=1e-5)


def test_bf16_first_moment_halves_its_bytes(make_config):
    def mu_bytes(**overrides):
        exp = Experiment.build(make_config("gpt2_tiny_dp8", **overrides))
        adam = exp.abstract_state().opt_state
        mu = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(adam)
              if any(getattr(k, "name", None) == "mu" for k in path)]
        return sum(x.size * x.dtype.itemsize for x in mu), {x.dtype.name for x in mu}
    full, full_types = mu_bytes()
    half, half_types = mu_bytes(**{"optim.mu_dtype": "bfloat16"})
    assert full_types == {"float32"} and half_types == {"bfloat16"}
    assert half * 2 == full


@pytest.mark.parametrize("key, value, words", [
    ("train.grad_dtype", "float16", ["train.grad_dtype='float16'", "bfloat16, float32"]),
    ("optim.mu_dtype", "int8", ["optim.mu_dtype='int8'", "bfloat16, float32"]),
])
def test_bad_dtypes_say_what_to_use(key, value, words, make_config):
    with pytest.raises(UserError) as err:
        Experiment.build(make_config("gpt2_tiny_dp8", **{key: value}))
    for w in words:
        assert w in str(err.value)


@pytest.mark.parametrize("layout", ["zero2", "zero2_pp"])
def test_grad_dtype_is_refused_where_gradients_split_in_the_backward_pass(layout, make_config):
    """ZeRO-2 reduces each layer's gradient at its matmul, in the matmul's dtype; a
    grad_dtype would only round it, so it is an error that names the ways out."""
    name = "gpt2_tiny_pp2_dp4" if layout.endswith("_pp") else "gpt2_tiny_dp8"
    with pytest.raises(UserError) as err:
        Experiment.build(make_config(name, **{"layout": layout, "train.grad_dtype": "bfloat16"}))
    for w in [f"layout {layout!r}", "train.grad_dtype=\"\"", "model.dtype=bfloat16", "zero1"]:
        assert w in str(err.value)
