"""GPT-2: parameter counts against the closed form, and forward-pass invariants.

The forward and backward passes run jitted, one program each rather than one per op, and
compiled with the planner's analysis options (compile_options.ANALYSIS_OPTIONS: the same HLO,
3x faster to compile): they run once on the tiny model, where slower code costs nothing."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from meshtrain import config as config_lib
from meshtrain.models import model_config
from meshtrain.models.gpt2 import GPT2, num_params
from meshtrain.models.sizes import GPT2_SIZES
from meshtrain.run.compile_options import analysis_options
from meshtrain.step.state import abstract_model


def cfg_for(size, **kw):
    cfg = config_lib.base(size=size)
    vocab = GPT2_SIZES[size]["vocab_size"]
    mc = model_config(cfg.model, vocab_size=vocab)
    return dataclasses.replace(mc, **kw)


@pytest.mark.parametrize("size, expected", [
    ("small", 124_439_808),   # Radford et al. / nanoGPT, vocab 50257
    ("medium", 354_823_168),
    ("large", 774_030_080),
    ("xl", 1_557_611_200),
])
def test_param_counts_match_closed_form(size, expected):
    cfg = cfg_for(size)
    assert num_params(cfg) == expected
    # The stored model, built abstractly: unpadded rows equal the closed form exactly.
    model = abstract_model(dataclasses.replace(cfg, padded_vocab_size=cfg.vocab_size))
    stored = sum(math.prod(s.shape) for s in jax.tree.leaves(model.shapes))
    assert stored == expected
    assert cfg.padded_vocab_size == 50304  # 50257 padded to a multiple of 128


def tiny(**kw):
    return dataclasses.replace(cfg_for("tiny"), seq_len=16, **kw)


def loss_and_grads(cfg, tokens):
    model = GPT2(cfg, nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    params = nnx.to_pure_dict(params)

    def loss(p):
        logits = nnx.merge(graphdef, p)(tokens[:, :-1]).astype(jnp.float32)
        return -jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1).mean()
    return jax.jit(jax.value_and_grad(loss), compiler_options=analysis_options())(params)


def forward(model, tokens, key=None):
    """model(tokens, key=key) [B, T, V], as one jitted program."""
    graphdef, state = nnx.split(model)
    return jax.jit(lambda s, t, k: nnx.merge(graphdef, s)(t, key=k), compiler_options=analysis_options())(
        state, tokens, key)


TOKENS = jax.random.randint(jax.random.key(1), (4, 17), 0, 256)


@pytest.fixture(scope="module")
def tiny_reference():
    """(loss, gradients) of the tiny model on TOKENS, the reference of the variants."""
    return loss_and_grads(tiny(), TOKENS)


@pytest.mark.parametrize("variant", [dict(scan_layers=False), dict(remat="full"), dict(remat="save_dots")])
def test_scan_unrolled_and_remat_are_the_same_function(variant, tiny_reference):
    ref_loss, ref_grads = tiny_reference
    loss, grads = loss_and_grads(tiny(**variant), TOKENS)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grads, ref_grads)


def test_backward_keeps_the_inputs_of_gelu_and_layer_norm_only():
    """GELU and LayerNorm are recomputed in backward from their inputs, their outputs too
    (what the next matmul's weight gradient reads): of [B, T, F] arrays the MLP keeps the
    GELU's input alone, of [B, T, D] ones a LayerNorm followed by a matmul keeps its input
    alone. Autodiff of the plain functions keeps more (five and two here)."""
    from meshtrain.models.gpt2 import LayerNorm, MLP, _gelu, _layer_norm
    from support.residuals import saved as kept
    cfg = tiny()
    x = jax.random.normal(jax.random.key(0), (2, 16, cfg.embed_dim))
    mlp, norm = MLP(cfg, nnx.Rngs(0)), LayerNorm(cfg)
    b_t_f, b_t_d = (2, 16, cfg.mlp_dim), x.shape
    assert kept(lambda x: mlp(x, lambda y, axes: y).sum(), x).count(b_t_f) == 1
    assert kept(lambda x: (norm(x) @ mlp.w_fc[...]).sum(), x).count(b_t_d) == 1
    # The plain formulations (what the model ran before) keep more.
    assert kept(lambda h: (_gelu(h) @ mlp.w_proj[...]).sum(), jnp.ones(b_t_f)).count(b_t_f) > 1
    assert kept(lambda x: (_layer_norm(x, norm.scale[...], norm.bias[...]) @ mlp.w_fc[...]).sum(),
                x).count(b_t_d) > 1


def test_vocab_padding_is_inert(tiny_reference):
    """Padded rows start at zero, are masked out of the logits and get no gradient."""
    ref_loss, ref_grads = tiny_reference
    loss, grads = loss_and_grads(tiny(padded_vocab_size=384), TOKENS)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert np.all(grads["wte"][256:] == 0)
    np.testing.assert_allclose(grads["wte"][:256], ref_grads["wte"], rtol=1e-5, atol=1e-7)


def test_bfloat16_compute_keeps_float32_params():
    cfg = tiny(dtype="bfloat16")
    model = GPT2(cfg, nnx.Rngs(0))
    assert model.wte[...].dtype == jnp.float32
    logits = forward(model, TOKENS[:, :-1])
    assert logits.dtype == jnp.bfloat16
    ref = forward(GPT2(tiny(), nnx.Rngs(0)), TOKENS[:, :-1])
    np.testing.assert_allclose(np.asarray(logits, np.float32), ref, atol=0.05)


def test_every_parameter_has_logical_axes():
    model = abstract_model(tiny())
    flat = jax.tree_util.tree_leaves_with_path(model.axes, is_leaf=lambda x: isinstance(x, tuple))
    shapes = jax.tree.leaves(model.shapes)
    assert len(flat) == len(shapes) == 16
    for (_, axes), shape in zip(flat, shapes):
        assert len(axes) == len(shape.shape)


def test_dropout_changes_with_key_only_in_training():
    cfg = tiny(dropout=0.1)
    model = GPT2(cfg, nnx.Rngs(0))
    x = TOKENS[:, :-1]
    a, b = forward(model, x, jax.random.key(0)), forward(model, x, jax.random.key(1))
    assert not np.allclose(a, b)
    np.testing.assert_array_equal(forward(model, x), forward(model, x))
