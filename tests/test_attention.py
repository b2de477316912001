"""model.attention: which kernel runs, why, and that every kernel computes the same thing.

cuDNN cannot run on CPU, so its selection is checked against simulated platforms; the
Pallas flash kernel runs here in interpret mode and is compared with XLA's attention in
loss and gradients, on one device and under shard_map on a data x tensor mesh. Those
programs run once, so they compile with the planner's analysis options
(experiment.ANALYSIS_OPTIONS: the same HLO, 3x faster to compile, slower code).
"""

import jax
import numpy as np
import pytest

from meshtrain.errors import UserError
from meshtrain.experiment import ANALYSIS_OPTIONS, Experiment
from meshtrain.models.attention import Platform, choose

from support.residuals import saved
from support.training import loss_and_grads

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
    impl, reason = choose("auto", platform=platform, dtype=dtype, head_dim=head_dim, seq_len=1024)
    assert impl == expected
    assert why in reason and reason.startswith("auto:")


def test_explicit_choices():
    assert choose("xla", platform=H100, dtype="bfloat16", head_dim=64, seq_len=1024)[0] == "xla"
    assert choose("cudnn", platform=H100, dtype="bfloat16", head_dim=64, seq_len=1024)[0] == "cudnn"
    impl, why = choose("pallas", platform=CPU, dtype="float32", head_dim=16, seq_len=128)
    assert impl == "pallas" and "interpret mode" in why


@pytest.mark.parametrize("requested, platform, dtype, seq_len, words", [
    ("cudnn", CPU, "bfloat16", 1024, ["model.attention=cudnn cannot run", "this backend is cpu",
                                      "model.attention=auto"]),
    ("cudnn", H100, "float32", 1024, ["model.dtype=float32", "model.attention=xla"]),
    ("pallas", H100, "bfloat16", 100, ["seq_len=100", "blocks of 128 and 32", "divisible by 128"]),
    ("flash", H100, "bfloat16", 1024, ["'flash' is not an attention implementation",
                                       "auto, xla, cudnn, pallas"]),
])
def test_impossible_choices_say_why_and_what_to_do(requested, platform, dtype, seq_len, words):
    with pytest.raises(UserError) as err:
        choose(requested, platform=platform, dtype=dtype, head_dim=64, seq_len=seq_len)
    for w in words:
        assert w in str(err.value)


def test_cudnn_on_cpu_is_refused_when_the_run_is_built(make_config):
    with pytest.raises(UserError, match="model.attention=cudnn cannot run"):
        Experiment.build(make_config("gpt2_tiny_dp8", **{"model.attention": "cudnn"}))


@pytest.mark.parametrize("name, mesh", [("gpt2_tiny_dp2_tp4", None), ("gpt2_tiny_dp2_tp4", "data:1"),
                                        ("llama_tiny_dp2_tp4", None), ("gpt2_tiny_pp2_dp4", None)])
def test_pallas_flash_attention_equals_xla(name, mesh, make_config):
    """Same loss and gradients (float32, float tolerance) from XLA's attention and the
    Pallas kernel; on 8 devices the kernel runs per (data, tensor) shard under shard_map,
    and inside the pipeline's stage and batch-shard vmaps."""
    devices = jax.devices()[:1] if mesh else None
    short = {"train.batch_size": 16, "model.attention": "xla"}
    (loss_x, grads_x) = loss_and_grads(make_config(name, **short), devices, mesh)
    pallas = make_config(name, **{**short, "model.attention": "pallas"})
    assert Experiment.build(pallas, devices=devices, mesh_shape=mesh).model.cfg.attention == "pallas"
    (loss_p, grads_p) = loss_and_grads(pallas, devices, mesh)
    np.testing.assert_allclose(loss_p, loss_x, rtol=1e-6)
    jax.tree.map(lambda p, x: np.testing.assert_allclose(p, x, rtol=2e-4, atol=2e-6), grads_p, grads_x)


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
        jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)), compiler_options=ANALYSIS_OPTIONS)(q, k, v)
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
