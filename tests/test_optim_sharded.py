"""The optimizers (meshtrain/step/optim.py) under fsdp and zero1 on 8 simulated devices: the
sharded update equals the same transformation jitted on one device, and LARS/LAMB equal
optax's own lars/lamb applied to each layer of a stacked weight."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from meshtrain import config as config_lib, mesh as mesh_lib
from meshtrain.parallel import layouts
from meshtrain.run.compile_options import analysis_options
from meshtrain.step import optim, state as state_lib

# A params tree with logical axes: an embedding, a stacked block (matrix, bias, norm scale),
# a 4-D kernel standing for a conv's [kh, kw, in, out] (spatial dims unnamed), and a norm
# scale outside the stack. Dims divide by 8, so fsdp and zero1 split every leaf.
AXES = {
    "embed": ("vocab", "embed"),
    "blocks": {"w": ("layers", "embed", "mlp"), "b": ("layers", "mlp"), "scale": ("layers", "embed")},
    "conv": (None, None, "embed", "mlp"),
    "norm": ("embed",),
}
SHAPES = {"embed": (16, 16), "blocks": {"w": (2, 16, 32), "b": (2, 32), "scale": (2, 16)},
          "conv": (3, 3, 16, 32), "norm": (16,)}
STEPS = 3
# Relative tolerance of the comparisons: the sharded program sums the squares of the global
# clipping norm and of the trust-ratio norms in another order (partial sums per shard, then
# an all-reduce), so a norm differs by a few float32 ulps (2^-23 = 1.2e-7 relative each) and
# so does an update it scales. Measured here after 3 steps: at most 1 ulp of the largest
# param (7.4e-8 relative, LARS and LAMB under fsdp). 1e-6 is 8 ulps: room for another
# reduction order, and far below a real error (a missing decay term or a trust ratio over
# the wrong axes changes params by 1e-3 or more).
RTOL = 1e-6


def optim_cfg(**overrides):
    o = config_lib.base().optim
    with o.unlocked():
        o.update({"warmup_steps": 1, "weight_decay": 0.1, **overrides})
    return o


def arrays(seed):
    """Random params or gradients of SHAPES, float32 numpy."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: rng.standard_normal(s).astype(np.float32), SHAPES,
                        is_leaf=lambda x: isinstance(x, tuple))


def run(tx, params, grads, shard=None, opt_shard=None):
    """STEPS updates of `params` by `grads` (a list), jitted with the given shardings (None:
    on one device); -> the params after each step. Both programs run a few times on a few
    KB, so they compile with the planner's analysis options (compile_options.ANALYSIS_OPTIONS:
    the same HLO, 3x faster to compile, slower code)."""
    if shard is None:
        dev = jax.devices()[0]
        params = jax.device_put(params, dev)
        init = jax.jit(tx.init, compiler_options=analysis_options())
        step = jax.jit(lambda g, s, p: _apply(tx, g, s, p), compiler_options=analysis_options())
    else:
        params = jax.device_put(params, shard["params"])
        init = jax.jit(tx.init, out_shardings=opt_shard, compiler_options=analysis_options())
        step = jax.jit(lambda g, s, p: _apply(tx, g, s, p),
                       in_shardings=(shard["opt_state"], opt_shard, shard["params"]),
                       out_shardings=(shard["params"], opt_shard), compiler_options=analysis_options())
    state = init(params)
    out = []
    for g in grads:
        params, state = step(g, state, params)
        out.append(jax.device_get(params))
    return out


def _apply(tx, grads, state, params):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state


def shardings(layout_name, mesh, tx):
    """Params-shaped NamedShardings under the layout's params and opt_state rules, and the
    optimizer state's as the trainer builds them (state.state_shardings)."""
    layout = layouts.get(layout_name)
    is_axes = lambda x: isinstance(x, tuple)  # noqa: E731
    shard = {t: jax.tree.map(lambda a: NamedSharding(mesh, layout.spec(a, t)), AXES, is_leaf=is_axes)
             for t in ("params", "opt_state")}
    shapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.float32), SHAPES, is_leaf=is_axes)
    model = types.SimpleNamespace(shapes=shapes)
    opt = state_lib.state_shardings(model, tx, shard["params"], shard["opt_state"], mesh).opt_state
    return shard, opt


CASES = {
    "adamw": {},
    "sgd": {"lr": 0.1, "momentum": 0.9},
    "sgd_nesterov": {"name": "sgd", "lr": 0.1, "momentum": 0.9, "nesterov": True},
    "lars": {"lr": 2.0, "momentum": 0.9},
    "lamb": {"lr": 1e-2, "b2": 0.999, "eps": 1e-6},
}


@pytest.fixture(scope="module")
def unsharded():
    """{case: params after each step on one device}, with the inputs."""
    params, grads = arrays(0), [arrays(1 + i) for i in range(STEPS)]
    out = {}
    for case, kw in CASES.items():
        o = optim_cfg(**{"name": case, **kw})
        tx = optim.make(o, optim.schedule(o, 10), AXES)
        out[case] = run(tx, params, grads)
    return params, grads, out


@pytest.mark.parametrize("layout_name,mesh_spec", [("fsdp", "fsdp:8"), ("zero1", "data:8")])
@pytest.mark.parametrize("case", list(CASES))
def test_sharded_update_equals_one_device(unsharded, case, layout_name, mesh_spec):
    params, grads, ref = unsharded
    o = optim_cfg(**{"name": case, **CASES[case]})
    tx = optim.make(o, optim.schedule(o, 10), AXES)
    mesh = mesh_lib.make_mesh(mesh_lib.parse_shape(mesh_spec), jax.devices()[:8])
    shard, opt_shard = shardings(layout_name, mesh, tx)
    assert shard["opt_state"]["blocks"]["w"].spec != P()  # the moments really are split
    assert any(s.spec != P() for s in jax.tree.leaves(opt_shard)), opt_shard
    got = run(tx, params, grads, shard, opt_shard)
    for step, (a, b) in enumerate(zip(got, ref[case])):
        for path, x, y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(a), jax.tree.leaves(b)):
            np.testing.assert_allclose(x, y, rtol=RTOL, atol=RTOL * np.abs(y).max(),
                                       err_msg=f"{case} {layout_name} step {step + 1} {path[0]}")


def unstack(tree):
    """The tree with each stacked leaf cut into its layers: blocks/w -> w0, w1."""
    flat = {"embed": tree["embed"], "conv": tree["conv"], "norm": tree["norm"]}
    for k, v in tree["blocks"].items():
        flat.update({f"{k}{i}": v[i] for i in range(v.shape[0])})
    return flat


@pytest.mark.parametrize("name", ["lars", "lamb"])
def test_layerwise_trust_ratio_equals_optax_per_layer(unsharded, name):
    """Our LARS/LAMB on the stacked tree == optax.lars/optax.lamb on the tree cut into
    layers, with norms and biases neither decayed nor trust-scaled (LAMB: optax.adam on
    them, which is LAMB without decay and ratio)."""
    params, grads, _ = unsharded
    kw = {"lr": 2.0, "momentum": 0.9, "nesterov": True} if name == "lars" else {"lr": 1e-2, "b2": 0.999}
    o = optim_cfg(name=name, schedule="constant", warmup_steps=0, grad_clip=0.0, **kw)
    ours = run(optim.make(o, o.lr, AXES), params, grads)
    flat_p, flat_g = unstack(params), [unstack(g) for g in grads]
    mask = {k: v.ndim >= 2 for k, v in flat_p.items()}
    if name == "lars":
        ref_tx = optax.lars(o.lr, weight_decay=o.weight_decay, weight_decay_mask=mask,
                            trust_coefficient=o.trust_coefficient, eps=o.eps, trust_ratio_mask=mask,
                            momentum=o.momentum, nesterov=True)
    else:
        label = {k: "matrix" if m else "vector" for k, m in mask.items()}
        ref_tx = optax.multi_transform(
            {"matrix": optax.lamb(o.lr, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay),
             "vector": optax.adam(o.lr, b1=o.b1, b2=o.b2, eps=o.eps)}, label)
    ref = run(ref_tx, flat_p, flat_g)
    for a, b in zip(ours, ref):
        a = unstack(a)
        for k in b:
            np.testing.assert_allclose(a[k], b[k], rtol=RTOL, atol=RTOL * np.abs(b[k]).max(), err_msg=k)


def test_sgd_is_pytorch_sgd_with_coupled_decay():
    """PyTorch's SGD (the survey's VGG recipe): g += wd p (matrices only here), buf = mu buf
    + g, step = g + mu buf (Nesterov) or buf, p -= lr step; written out in numpy."""
    o = optim_cfg(name="sgd", lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-2,
                  schedule="constant", warmup_steps=0, grad_clip=0.0)
    params, grads = arrays(0), [arrays(1 + i) for i in range(STEPS)]
    got = run(optim.make(o, o.lr, AXES), params, grads)
    mask = optim.decay_mask(AXES)
    p = jax.tree.map(np.copy, params)
    buf = jax.tree.map(np.zeros_like, params)
    for step, g in enumerate(grads):
        g = jax.tree.map(lambda g, p, m: g + o.weight_decay * p if m else g, g, p, mask)
        buf = jax.tree.map(lambda b, g: o.momentum * b + g, buf, g)
        p = jax.tree.map(lambda p, g, b: p - o.lr * (g + o.momentum * b), p, g, buf)
        jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=RTOL, atol=RTOL), got[step], p)


def test_the_clip_takes_the_norm_it_is_given_and_is_optaxs_without_one():
    """The step passes the norm it logs, so a streamed update (one layer at a time) clips by
    the whole step's norm; without one the clip is optax's, bit for bit, state and all."""
    grads = arrays(1)
    ours, theirs = optim.clip_by_global_norm(0.5), optax.clip_by_global_norm(0.5)
    state = ours.init(grads)
    assert jax.tree.structure(state) == jax.tree.structure(theirs.init(grads))  # checkpoints unchanged
    want, _ = theirs.update(grads, theirs.init(grads))
    got, _ = ours.update(grads, state)
    jax.tree.map(np.testing.assert_array_equal, got, want)
    one_layer = {"w": grads["blocks"]["w"]}  # its own norm is not the step's
    got, _ = ours.update(one_layer, state, global_norm=jnp.float32(2.0))
    np.testing.assert_array_equal(got["w"], grads["blocks"]["w"] / np.float32(2.0) * np.float32(0.5))
    got, _ = ours.update(one_layer, state, global_norm=jnp.float32(0.25))  # under the clip: untouched
    np.testing.assert_array_equal(got["w"], grads["blocks"]["w"])


def test_decay_mask_by_logical_role():
    """Matrices, embeddings and conv kernels are decayed; biases and norm scales are not,
    stacked or not (the layers/stage axes do not count)."""
    assert optim.decay_mask(AXES) == {"embed": True, "blocks": {"w": True, "b": False, "scale": False},
                                      "conv": True, "norm": False}
    assert optim.decay_mask({"s": ("stage", "layers", "embed")}) == {"s": False}


@pytest.mark.parametrize("name", ["sgd", "lars", "lamb", "adamw"])
def test_norms_and_biases_are_not_decayed(name):
    """Zero gradients, weight decay 0.5: vectors stay put, matrices shrink."""
    o = optim_cfg(name=name, lr=0.1, weight_decay=0.5, schedule="constant", warmup_steps=0, grad_clip=0.0)
    params = arrays(0)
    zeros = jax.tree.map(np.zeros_like, params)
    (after,) = run(optim.make(o, o.lr, AXES), params, [zeros])
    for k in ("norm",):
        np.testing.assert_array_equal(after[k], params[k])
    for k in ("b", "scale"):
        np.testing.assert_array_equal(after["blocks"][k], params["blocks"][k])
    for w, w0 in ((after["embed"], params["embed"]), (after["conv"], params["conv"]),
                  (after["blocks"]["w"], params["blocks"]["w"])):
        assert np.linalg.norm(w) < np.linalg.norm(w0) * (1 - 1e-5)  # LARS: by lr x 0.001


def test_lars_does_not_trust_scale_vectors():
    """LARS's first step on a vector is -lr g (momentum starts at 0), not the 1e-3-scaled one."""
    o = optim_cfg(name="lars", lr=0.5, schedule="constant", warmup_steps=0, grad_clip=0.0)
    params, grads = arrays(0), arrays(1)
    (after,) = run(optim.make(o, o.lr, AXES), params, [grads])
    np.testing.assert_allclose(after["norm"], params["norm"] - 0.5 * grads["norm"], rtol=RTOL)
    w, g = params["blocks"]["w"][1], grads["blocks"]["w"][1] + o.weight_decay * params["blocks"]["w"][1]
    ratio = o.trust_coefficient * np.linalg.norm(w) / (np.linalg.norm(g) + o.eps)
    np.testing.assert_allclose(after["blocks"]["w"][1], w - 0.5 * ratio * g, rtol=RTOL)


def test_linear_scaling_rule():
    o = optim_cfg(lr=0.1, min_lr=0.01, lr_batch_size=256, warmup_steps=5, schedule="cosine")
    s = optim.schedule(o, 100, batch_size=1024)
    assert float(s(5)) == pytest.approx(0.4, rel=1e-6) and float(s(100)) == pytest.approx(0.04, rel=1e-6)
    line, _ = optim.describe(o, 100, batch_size=1024)
    assert line == ("lr: warm-up 0 -> 0.4 (optim.lr 0.1 x train.batch_size 1024 / optim.lr_batch_size 256, "
                    "linear scaling) over 5 steps, cosine to 0.04 at step 100 (optim.schedule=cosine)")
    with o.unlocked():
        o.lr_batch_size = 0
    assert float(optim.schedule(o, 100, batch_size=1024)(5)) == pytest.approx(0.1, rel=1e-6)


def test_mu_dtype_sets_the_first_moment():
    for name in ("sgd", "lars", "lamb"):
        o = optim_cfg(name=name, mu_dtype="bfloat16")
        state = jax.eval_shape(optim.make(o, 0.1, AXES).init, arrays(0))
        dtypes = {x.dtype for x in jax.tree.leaves(state) if x.shape == (2, 16, 32)}
        assert jnp.dtype("bfloat16") in dtypes, (name, dtypes)
        assert [jnp.dtype(d) for d in optim.moment_dtypes(o, "float32")][0] == jnp.bfloat16


def test_keys_round_trip_through_overrides():
    cfg = config_lib.base()
    for key, text in [("optim.name", "lars"), ("optim.momentum", "0.8"), ("optim.nesterov", "true"),
                      ("optim.trust_coefficient", "0.002"), ("optim.lr_batch_size", "256")]:
        config_lib.override(cfg, key, text)
    o = cfg.optim
    assert (o.name, o.momentum, o.nesterov, o.trust_coefficient, o.lr_batch_size) == ("lars", 0.8, True, 0.002, 256)
    assert isinstance(o.momentum, float) and isinstance(o.lr_batch_size, int)
    config_lib.override(cfg, "optim.momentum", "0")
    assert o.momentum == 0.0 and isinstance(o.momentum, float)


@pytest.mark.parametrize("overrides,message", [
    ({"name": "adam"}, "the optimizers are adamw, sgd, lars, lamb"),
    ({"name": "sgd", "momentum": -0.1}, "need 0 <= momentum < 1"),
    ({"name": "sgd", "momentum": 0.0, "nesterov": True}, "Nesterov's look-ahead needs momentum"),
    ({"name": "sgd", "momentum": 0.0, "mu_dtype": "bfloat16"}, "no momentum buffer"),
    ({"name": "lamb", "nesterov": True}, "applies to sgd and lars, not lamb"),
    ({"name": "lamb", "b2": 1.0}, "need 0 <= b2 < 1"),
    ({"name": "lars", "trust_coefficient": 0.0}, "LARS needs > 0"),
    ({"lr_batch_size": -1}, "optim.lr_batch_size=-1"),
    ({"weight_decay": -1e-4}, "optim.weight_decay=-0.0001"),
])
def test_bad_values_are_user_errors(overrides, message):
    from meshtrain.errors import UserError
    with pytest.raises(UserError, match=message):
        optim.schedule(optim_cfg(**overrides), 10)
