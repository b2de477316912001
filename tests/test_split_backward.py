"""A layer's backward split into B (the input gradient) and W (the weight gradients) for
zero-bubble pipelines (parallel/pipeline/split_backward.py): the two halves compute what
the fused pullback does, each equation once, on a residual MLP block."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshtrain.parallel.pipeline import split_backward as sb


def block(w, x):  # [T, D] -> [T, D]: x + gelu(x up) down
    return x + jax.nn.gelu(x @ w["up"]) @ w["down"]


@pytest.fixture(scope="module")
def case():
    r = np.random.default_rng(0)
    w = {"up": jnp.asarray(r.standard_normal((16, 64)) / 4, jnp.float32),
         "down": jnp.asarray(r.standard_normal((64, 16)) / 8, jnp.float32)}
    x, g = (jnp.asarray(r.standard_normal((8, 16)), jnp.float32) for _ in range(2))
    return w, x, g


def dots(fn, *args) -> int:
    return str(jax.make_jaxpr(fn)(*args)).count("dot_general")


def test_b_then_w_equal_the_fused_pullback_with_each_matmul_once(case):
    w, x, g = case
    _, pull = jax.vjp(block, w, x)
    dw, dx = pull(g)
    b, w_grads = sb.split_pullback(pull, g)
    dx_b, saved = b(g)
    dw_w = w_grads(saved)
    # Op by op the halves run the fused pullback's own equations: equal to the bit.
    np.testing.assert_array_equal(dx_b, dx)
    jax.tree.map(np.testing.assert_array_equal, dw_w, dw)
    # The backward's 4 matmuls: dx needs 2 (through down, then up); the weights 2 more,
    # reading B's cotangent at the hidden layer instead of computing it again.
    assert (dots(pull, g), dots(lambda g: b(g), g), dots(w_grads, saved)) == (4, 2, 2)
    assert any(np.array_equal(s, g) for s in saved)  # W reads g itself: d down = hidden^T g


def test_two_vjps_repeat_the_cotangent_chain(case):
    """The cheap alternative, a pullback for dx and one for dw, recomputes the hidden
    layer's cotangent in W: 5 matmuls where the split has 4."""
    w, x, g = case
    dx_only = jax.vjp(lambda x: block(w, x), x)[1]
    dw_only = jax.vjp(lambda w: block(w, x), w)[1]
    assert dots(dx_only, g) + dots(dw_only, g) == 5


def test_under_jit_the_split_step_equals_the_fused_one(case):
    w, x, g = case

    def fused(w, x, g):
        return jax.vjp(block, w, x)[1](g)

    def halves(w, x, g):
        b, w_grads = sb.split_pullback(jax.vjp(block, w, x)[1], g)
        dx, saved = b(g)
        return w_grads(saved), dx

    assert dots(halves, w, x, g) == dots(fused, w, x, g) == 6  # the forward's 2, the backward's 4
    want, got = jax.jit(fused)(w, x, g), jax.jit(halves)(w, x, g)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), got, want)


def test_a_scanned_chunk_splits_per_layer(case):
    """Three layers under lax.scan: the forward keeping each layer's residuals but its
    weights, B's reverse scan and W's scan give the chunk's pullback, no matmul twice."""
    w, x, g = case
    ws = jax.tree.map(lambda a: jnp.stack([a, 0.5 * a, -a]), w)

    def chunk(ws, x):
        return jax.lax.scan(lambda h, w_l: (block(w_l, h), None), x, ws)[0]
    want_y, pull = jax.vjp(chunk, ws, x)
    want_dws, want_dx = pull(g)
    layer = lambda w, k, x: block(w, x)  # noqa: E731
    split = sb.LayerSplit(layer, ws, None, x)
    y, res = jax.jit(split.forward)(ws, None, x)
    dx, dws_b, kept = jax.jit(split.input_grads)(ws, res, g)
    dws = split.tree(dws_b, jax.jit(split.weight_grads)(ws, kept))
    assert dws_b == [None, None]  # both weights' gradients are matmuls: W's
    np.testing.assert_allclose(y, want_y, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-6, atol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), dws, want_dws)
    # The stashes hold activations (and constants) a layer, never a weight.
    assert all(leaf.shape[0] == 3 and leaf.shape[1:] not in ((16, 64), (64, 16)) for leaf in [*res, *kept])
    # A scan's body once in the text: a layer's forward 2 matmuls, B 2, W 2.
    assert dots(split.forward, ws, None, x) == 2
    assert dots(split.input_grads, ws, res, g) == 2
    assert dots(split.weight_grads, ws, kept) == 2


def test_a_mask_of_the_wrong_length_is_refused(case):
    w, x, g = case
    with pytest.raises(ValueError, match="marks 2 outputs, the function has 3"):
        sb.split(lambda w, x: [*jax.tree.leaves(block(w, x)), x, x], w, x, first=[True, False])
