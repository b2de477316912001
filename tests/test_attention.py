"""model.attention: which kernel runs, why, and that every kernel computes the same thing.

cuDNN cannot run on CPU, so its selection is checked against simulated platforms; XLA's
attention is compared with jax.nn.dot_product_attention. Those programs run once, so they
compile with the planner's analysis options (compile_options.ANALYSIS_OPTIONS: the same HLO, 3x
faster to compile, slower code).
"""

import jax
import numpy as np
import pytest

from meshtrain.errors import UserError
from meshtrain.models.attention import Platform, choose
from meshtrain.run.compile_options import analysis_options
from meshtrain.run.experiment import Experiment

from support.residuals import saved

H100 = Platform("gpu", "9.0", cudnn=True)
A100 = Platform("gpu", "8.0", cudnn=True)
V100 = Platform("gpu", "7.0", cudnn=True)
CPU = Platform("cpu")


@pytest.mark.parametrize("platform, dtype, head_dim, expected, why", [
    (H100, "bfloat16", 64, "cudnn", "cuDNN flash attention applies"),
    (H100, "float16", 256, "cudnn", "cuDNN flash attention applies"),
    (A100, "bfloat16", 256, "xla", "multiple of 8 up to 128"),
    (H100, "bfloat16", 60, "xla", "head width 60"),
    (H100, "float32", 64, "xla", "bfloat16 or float16"),
    (V100, "bfloat16", 64, "xla", "below 8.0"),
    (Platform("gpu", "9.0", cudnn=False), "bfloat16", 64, "xla", "cuDNN is not loaded"),
    (CPU, "bfloat16", 64, "xla", "needs an NVIDIA GPU; this backend is cpu"),
])
def test_auto_takes_cudnn_only_where_it_applies(platform, dtype, head_dim, expected, why):
    impl, reason = choose("auto", platform=platform, dtype=dtype, head_dim=head_dim)
    assert impl == expected
    assert why in reason and reason.startswith("auto:")


def test_explicit_choices():
    assert choose("xla", platform=H100, dtype="bfloat16", head_dim=64)[0] == "xla"
    assert choose("cudnn", platform=H100, dtype="bfloat16", head_dim=64)[0] == "cudnn"


@pytest.mark.parametrize("requested, platform, dtype, words", [
    ("cudnn", CPU, "bfloat16", ["model.attention=cudnn cannot run", "this backend is cpu",
                                "model.attention=auto"]),
    ("cudnn", H100, "float32", ["model.dtype=float32", "model.attention=xla"]),
    ("flash", H100, "bfloat16", ["'flash' is not an attention implementation",
                                 "auto, xla, cudnn (docs"]),
    ("pallas", H100, "bfloat16", ["model.attention=pallas", "Pallas (Triton)", "removed",
                                  "JAX 0.11 deprecates", "model.attention=cudnn on GPUs",
                                  "model.attention=auto", "model.attention=xla"]),
])
def test_impossible_choices_say_why_and_what_to_do(requested, platform, dtype, words):
    with pytest.raises(UserError) as err:
        choose(requested, platform=platform, dtype=dtype, head_dim=64)
    for w in words:
        assert w in str(err.value)


@pytest.mark.parametrize("requested, words", [("cudnn", "model.attention=cudnn cannot run"),
                                              ("pallas", "model.attention=pallas: the Pallas")])
def test_refusals_stop_the_run_when_it_is_built(make_config, requested, words):
    with pytest.raises(UserError, match=words):
        Experiment.build(make_config("gpt2_tiny_dp8", **{"model.attention": requested}))


@pytest.mark.parametrize("dtype, heads, kv_heads", [("float32", 4, 4), ("float32", 4, 2),
                                                    ("bfloat16", 4, 2)])
def test_xla_attention_is_jax_dot_product_attention(dtype, heads, kv_heads):
    """meshtrain's XLA attention computes what jax.nn.dot_product_attention(is_causal=True)
    does, value and gradients, and its backward keeps the probabilities alone of the
    [.., T, S] arrays (in float32 for the softmax, and in bfloat16 for v's gradient when
    v is bfloat16), where JAX's keeps the mask, the masked scores and the exponentials too."""
    from meshtrain.models.attention import causal_attention
    kq, kk, kv, kw = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(kq, (2, 16, heads, 8), dtype)
    k, v = (jax.random.normal(key, (2, 16, kv_heads, 8), dtype) for key in (kk, kv))
    w = jax.random.normal(kw, (2, 16, heads, 8))

    def loss(attn):
        return lambda q, k, v: (attn(q, k, v).astype(np.float32) * w).sum()
    ours = loss(causal_attention)
    jax_s = loss(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla"))
    (value, grads), (ref_value, ref_grads) = (
        jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)), compiler_options=analysis_options())(q, k, v)
        for f in (ours, jax_s))
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == "float32" else dict(rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(value, ref_value, **tol)
    for g, ref in zip(grads, ref_grads):
        assert g.dtype == ref.dtype
        np.testing.assert_allclose(np.float32(g), np.float32(ref), **tol)
    square = lambda shapes: sum(s[-2:] == (16, 16) for s in shapes)
    kept = square(saved(ours, q, k, v))
    assert kept == (1 if dtype == "float32" else 2)
    assert square(saved(jax_s, q, k, v)) >= kept + 2
