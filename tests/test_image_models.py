"""The image families (models/vgg.py, models/resnet.py, their layers in models/conv.py):
published parameter counts and multiply-adds, shapes, BatchNorm's two modes, logical axes
from the vocabulary, and layouts (data, channel tensor parallelism, spatial) on 8
simulated devices against one device."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from meshtrain import config as config_lib, mesh as mesh_lib, models
from meshtrain.errors import UserError
from meshtrain.models import family, model_config, resnet, vgg
from meshtrain.models.conv import BN_EPSILON, BatchNorm
from meshtrain.models.hook import UNSHARDED
from meshtrain.parallel import layouts
from meshtrain.parallel.hook import Constrain
from meshtrain.parallel.layouts import VOCABULARY
from meshtrain.run.compile_options import analysis_options

FAMILIES = {"vgg": vgg, "resnet": resnet}


def cfg_for(name, size, *, vocab_size=None, vocab_multiple=1, **keys):
    """The family's config from config keys, as a run builds it (model.* keys in `keys`)."""
    c = config_lib.base()
    c.model.name, c.model.size, c.model.vocab_multiple = name, size, vocab_multiple
    for k, v in keys.items():
        c.model[k] = v
    vocab = vocab_size or family.get(name).sizes[size]["vocab_size"]
    return model_config(c.model, vocab_size=vocab)


def build(cfg, seed=0):
    return models.family_of(cfg).module(cfg, nnx.Rngs(seed))


@functools.partial(jax.jit, static_argnums=(0, 1), compiler_options=analysis_options())
def _init_state(cfg, seed):
    return nnx.state(build(cfg, seed))


def init(cfg, seed=0):
    """build(cfg, seed) with its params drawn in one compiled program: built eagerly, each
    initialiser compiles on its own (dozens of small programs per model)."""
    return nnx.merge(nnx.graphdef(nnx.eval_shape(lambda: build(cfg, seed))), _init_state(cfg, seed))


def count_params(cfg) -> int:
    model = nnx.eval_shape(lambda: build(cfg))
    return sum(math.prod(v.shape) for v in jax.tree.leaves(nnx.state(model, nnx.Param)))


# torchvision's published counts at 224 x 224, 1000 classes (its model documentation).
PUBLISHED = [("vgg", "vgg11", 132_863_336), ("vgg", "vgg13", 133_047_848), ("vgg", "vgg16", 138_357_544),
             ("vgg", "vgg19", 143_667_240), ("vgg", "vgg16_bn", 138_365_992),
             ("resnet", "resnet18", 11_689_512), ("resnet", "resnet50", 25_557_032)]


@pytest.mark.parametrize("name, size, expected", PUBLISHED)
def test_param_counts_match_published(name, size, expected):
    cfg = cfg_for(name, size)
    assert cfg.padded_vocab_size == cfg.vocab_size == 1000
    assert FAMILIES[name].num_params(cfg) == expected
    assert count_params(cfg) == expected


@pytest.mark.parametrize("name, size, keys", [("vgg", "tiny", {}), ("vgg", "tiny", dict(batch_norm=False)),
                                              ("vgg", "vgg11", dict(image_size=32)),
                                              ("resnet", "tiny", {}), ("resnet", "resnet18", dict(image_size=40))])
def test_closed_form_counts_the_built_model(name, size, keys):
    """Off the published sizes too: no BatchNorm, VGG's classifier at 32 px (1x1 features),
    and a ResNet whose strides do not divide the image evenly."""
    cfg = cfg_for(name, size, **keys)
    assert FAMILIES[name].num_params(cfg) == count_params(cfg)


def traced_macs(cfg) -> int:
    """Multiply-adds of the forward pass counted from its jaxpr: every conv and dot_general,
    from the shapes they were traced with (not from the closed form's arithmetic)."""
    model = nnx.eval_shape(lambda: build(cfg))
    graphdef, state = nnx.split(model)
    images = jax.ShapeDtypeStruct((1, cfg.image_size, cfg.image_size, cfg.image_channels), jnp.float32)
    jaxpr = jax.make_jaxpr(lambda s, x: nnx.merge(graphdef, s)(x, train=False))(state, images)

    def walk(jx) -> int:
        total = 0
        for eqn in jx.eqns:
            out = math.prod(eqn.outvars[0].aval.shape)
            if eqn.primitive.name == "conv_general_dilated":
                kh, kw, c_in, _ = eqn.invars[1].aval.shape  # HWIO
                total += out * kh * kw * c_in
            elif eqn.primitive.name == "dot_general":
                (lhs_contract, _), _ = eqn.params["dimension_numbers"]
                total += out * math.prod(eqn.invars[0].aval.shape[d] for d in lhs_contract)
            for p in eqn.params.values():
                for sub in p if isinstance(p, (tuple, list)) else (p,):
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        total += walk(sub.jaxpr)
                    elif isinstance(sub, jax.extend.core.Jaxpr):
                        total += walk(sub)
        return total
    return walk(jaxpr.jaxpr)


@pytest.mark.parametrize("name, size, published_gmacs", [
    # torchvision's documentation (its "GFLOPS" column counts multiply-adds).
    ("vgg", "vgg16", 15.47), ("vgg", "vgg16_bn", 15.47), ("resnet", "resnet50", 4.09), ("resnet", "resnet18", 1.81),
    ("vgg", "tiny", None), ("resnet", "tiny", None)])
def test_flops_per_example_counts_the_traced_forward(name, size, published_gmacs):
    cfg = cfg_for(name, size)
    fam = family.get(name)
    macs = traced_macs(cfg)
    assert fam.flops_per_example(cfg) == 6 * macs  # 3 x forward, forward = 2 x multiply-adds
    if published_gmacs is not None:
        assert round(macs / 1e9, 2) == published_gmacs


# --- tiny models: shapes, masking, BatchNorm ---

IMAGES = jax.random.normal(jax.random.key(1), (8, 16, 16, 3))
LABELS = np.arange(8) % 10


@functools.partial(jax.jit, static_argnums=(0, 3), compiler_options=analysis_options())
def _apply(graphdef, state, x, train):
    module = nnx.merge(graphdef, state)
    return module(x, train=train), nnx.state(module)


def apply(module, x, train):
    """module(x, train=train) as one compiled program: called eagerly, every primitive of a
    forward pass compiles on its own (dozens of programs per model and dtype). The batch
    statistics a train-mode call updates are written back to `module`, as the eager call
    writes them."""
    graphdef, state = nnx.split(module)
    out, state = _apply(graphdef, state, x, train)
    nnx.update(module, state)
    return out


@pytest.mark.parametrize("name", FAMILIES)
def test_forward_shape_dtype_and_masked_padding(name):
    cfg = cfg_for(name, "tiny", vocab_multiple=16)  # 10 classes padded to 16
    model = init(cfg)
    for dtype in ("float32", "bfloat16"):
        m = model if dtype == "float32" else init(dataclasses.replace(cfg, dtype=dtype))
        logits = apply(m, IMAGES, train=False)
        assert logits.shape == (8, 16) and logits.dtype == jnp.dtype(dtype)
        logits = np.asarray(logits)  # checked on the host: no eager op to compile
        assert np.all(logits[:, 10:] == jnp.finfo(logits.dtype).min)
        assert np.all(np.isfinite(logits[:, :10]))
    # no gradient reaches the padding columns of the classifier
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p, r):
        logits = nnx.merge(graphdef, p, r)(IMAGES, train=True)
        return -jnp.take_along_axis(jax.nn.log_softmax(logits), LABELS[:, None], 1).mean()
    grad = jax.jit(jax.grad(loss), compiler_options=analysis_options())
    grads = jax.device_get(nnx.to_pure_dict(grad(params, nnx.to_pure_dict(rest))))
    head = grads["fc3"] if name == "vgg" else grads["fc"]
    assert np.all(head["w"][:, 10:] == 0) and np.all(head["b"][10:] == 0)
    assert np.any(head["w"][:, :10] != 0)


def test_batch_norm_train_and_eval():
    bn = BatchNorm(4, "channels")
    x = 3.0 + 2.0 * np.asarray(jax.random.normal(jax.random.key(2), (2, 5, 3, 4)))
    x = x * np.arange(1.0, 5.0, dtype=np.float32)  # a different spread per channel
    xs = np.asarray(x, np.float64).reshape(-1, 4)

    y = np.asarray(apply(bn, x, train=True)).reshape(-1, 4)
    np.testing.assert_allclose(y.mean(0), 0, atol=1e-5)
    np.testing.assert_allclose(y.var(0), 1, rtol=1e-4)  # normalised with the biased variance
    mean1 = 0.1 * xs.mean(0)
    var1 = 0.9 + 0.1 * xs.var(0, ddof=1)  # updated with the unbiased one
    np.testing.assert_allclose(bn.mean[...], mean1, rtol=1e-5)
    np.testing.assert_allclose(bn.var[...], var1, rtol=1e-5)

    y = apply(bn, x, train=False)  # the running statistics, and no update
    np.testing.assert_allclose(np.asarray(y).reshape(-1, 4), (xs - mean1) / np.sqrt(var1 + BN_EPSILON),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(bn.mean[...], mean1, rtol=1e-5)

    apply(bn, x, train=True)  # a second step: 0.9 of the running value, 0.1 of the batch's
    np.testing.assert_allclose(bn.mean[...], 0.9 * mean1 + 0.1 * xs.mean(0), rtol=1e-5)
    np.testing.assert_allclose(bn.var[...], 0.9 * var1 + 0.1 * xs.var(0, ddof=1), rtol=1e-5)


@pytest.mark.parametrize("name", FAMILIES)
def test_train_mode_updates_the_running_statistics_and_eval_reads_them(name):
    # The forward test's config: its params and its eval-mode forward are compiled once.
    cfg = cfg_for(name, "tiny", vocab_multiple=16)
    model = init(cfg)
    stats0 = nnx.to_pure_dict(nnx.clone(nnx.state(model, nnx.BatchStat)))
    eval0 = apply(model, IMAGES, train=False)
    assert jax.tree.all(jax.tree.map(np.array_equal, stats0, nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))))
    train = apply(model, IMAGES, train=True)
    stats1 = nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))
    assert all(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(stats0), jax.tree.leaves(stats1)))
    assert not np.allclose(train, eval0)
    assert not np.allclose(apply(model, IMAGES, train=False), eval0)  # eval now reads the new statistics


@pytest.mark.parametrize("name, size", [("vgg", "tiny"), ("vgg", "vgg16_bn"), ("resnet", "tiny"), ("resnet", "resnet50")])
def test_every_variable_has_logical_axes_from_the_vocabulary(name, size):
    cfg = cfg_for(name, size)
    model = nnx.eval_shape(lambda: build(cfg))
    kinds = set()
    for path, var in nnx.to_flat_state(nnx.state(model)):
        axes = var.get_metadata()["out_sharding"]
        assert len(axes) == len(var.shape), path
        assert all(a in VOCABULARY for a in axes), (path, axes)
        kinds.add(type(var))
    assert kinds == {nnx.Param, nnx.BatchStat}
    # the activations the forward pass pins are named from the vocabulary too
    for what, shape, axes in family.get(name).activations(cfg, 2):
        assert len(shape) == len(axes) and all(a in VOCABULARY for a in axes), what


@pytest.mark.parametrize("name, size", [("vgg", "tiny"), ("vgg", "vgg16"), ("resnet", "tiny"), ("resnet", "resnet50")])
def test_activations_list_what_the_forward_pins(name, size):
    """activations(cfg, b) is what layout validation checks: the same (shape, axes) pairs
    the forward pass hands to `constrain`, no more and no fewer."""
    cfg = cfg_for(name, size)
    pinned = set()

    def record(x, axes):
        pinned.add((tuple(x.shape), tuple(axes)))
        return x
    model = nnx.eval_shape(lambda: build(cfg))
    graphdef, state = nnx.split(model)
    images = jax.ShapeDtypeStruct((2, cfg.image_size, cfg.image_size, cfg.image_channels), jnp.float32)
    jax.eval_shape(lambda s, x: nnx.merge(graphdef, s)(x, record, None, True), state, images)
    assert pinned == {(shape, axes) for _, shape, axes in family.get(name).activations(cfg, 2)}


def test_channel_pairs_alternate():
    """Each conv reads what the previous one wrote; the last conv before VGG's classifier
    and every ResNet block output are `channels`, kept whole under channel TP."""
    for size in ("vgg11", "vgg16", "tiny"):
        axes = cfg_for("vgg", size).conv_axes()
        assert axes[0][0] == "image_channels" and axes[-1][1] == "channels"
        assert all(a[1] == b[0] and a[1] != b[1] for a, b in zip(axes, axes[1:]))
    convs = resnet.convs(cfg_for("resnet", "resnet50"))
    assert {c.axes for c in convs if c.name.endswith("conv3")} == {("filters", "channels")}
    assert {c.axes for c in convs if c.name.endswith("conv2")} == {("channels", "filters")}


@pytest.mark.parametrize("name, keys, words", [
    ("vgg", dict(size="vgg16", image_size=16), "model.image_size=16 is too small"),
    ("vgg", dict(size="tiny", num_layers=5), "model.num_layers=5"),
    ("vgg", dict(size="tiny", remat="full"), "model.remat"),
    ("resnet", dict(size="tiny", batch_norm=False), "model.batch_norm=False"),
    ("resnet", dict(size="resnet18", num_layers=34), "model.num_layers=34"),
])
def test_checks_refuse_impossible_models(name, keys, words):
    size = keys.pop("size")
    with pytest.raises(UserError, match=words):
        cfg_for(name, size, **keys)


def test_describe_and_the_seam():
    for name in FAMILIES:
        fam = family.get(name)
        assert fam.task == "classify" and fam.stacked is None and fam.flops_per_token is None
        cfg = cfg_for(name, "tiny")
        assert cfg.seq_len == 0 and name in fam.describe(cfg)


# --- layouts on 8 simulated devices against one device ---

def split(cfg):
    """(graphdef, params, batch statistics, logical axes of both) as pure dicts."""
    graphdef, params, stats = nnx.split(init(cfg), nnx.Param, nnx.BatchStat)
    axes = {kind: {path: var.get_metadata()["out_sharding"] for path, var in nnx.to_flat_state(state)}
            for kind, state in (("params", params), ("stats", stats))}
    return graphdef, nnx.to_pure_dict(params), nnx.to_pure_dict(stats), axes


def shardings(pure, axes, layout, mesh):
    """NamedSharding of each leaf of `pure` under the layout's params rules."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: NamedSharding(mesh, layout.spec(axes[tuple(k.key for k in path)], "params")), pure)


def train_forward(graphdef, constrain):
    """(params, stats, images, labels) -> (logits, the updated stats, the loss's gradient),
    BatchNorm in train mode: the whole batch's statistics whatever the layout."""
    def run(params, stats, images, labels):
        def loss(p):
            model = nnx.merge(graphdef, p, stats)
            logits = model(images, constrain, None, train=True)
            ce = -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1).mean()
            return ce, (logits, nnx.to_pure_dict(nnx.state(model, nnx.BatchStat)))
        (_, (logits, new_stats)), grads = jax.value_and_grad(loss, has_aux=True)(params)
        return logits, new_stats, grads
    return run


@pytest.fixture(scope="module", params=list(FAMILIES))
def reference(request):
    cfg = cfg_for(request.param, "tiny", vocab_multiple=8)
    graphdef, params, stats, axes = split(cfg)
    one = jax.jit(train_forward(graphdef, UNSHARDED), compiler_options=analysis_options())(params, stats, IMAGES, LABELS)
    return cfg, graphdef, params, stats, axes, one


@pytest.mark.parametrize("mesh_text, layout_text", [
    ("data:8", "batch:data"),                                   # data parallel, synchronised BatchNorm
    ("data:2,tensor:4", "batch:data;filters:tensor"),          # channel tensor parallelism
    ("data:2,tensor:4", "batch:data;filters:tensor;vocab:tensor"),  # ... and the classes split
    ("data:2,tensor:4", "batch:data;height:tensor"),           # spatial: rows split, halos exchanged
    ("data:2,fsdp:4", "batch:data+fsdp | params=embed:fsdp;mlp:fsdp;channels:fsdp;filters:fsdp"),
])
def test_layout_equals_one_device(reference, mesh_text, layout_text):
    cfg, graphdef, params, stats, axes, one = reference
    mesh = mesh_lib.make_mesh(mesh_lib.resolve_shape(mesh_lib.parse_shape(mesh_text), 8), jax.devices()[:8])
    layout = layouts.parse(layout_text)
    p_sh = shardings(params, axes["params"], layout, mesh)
    s_sh = shardings(stats, axes["stats"], layout, mesh)
    batch = NamedSharding(mesh, layout.spec(("batch",), "activations"))
    run = jax.jit(train_forward(graphdef, Constrain(layout, mesh)),
                  in_shardings=(p_sh, s_sh, batch, batch)).lower(params, stats, IMAGES, LABELS).compile(analysis_options())
    got = run(jax.device_put(params, p_sh), jax.device_put(stats, s_sh), IMAGES, LABELS)
    if "height:tensor" in layout_text:  # convs over split rows exchange halos, not whole images
        assert "collective-permute" in run.as_text()
    if "filters:tensor" in layout_text:  # the pair's first kernel split by its outputs, the second by its inputs
        pair = p_sh if isinstance(cfg, vgg.VGGConfig) else p_sh["stage1_block1"]
        assert pair["conv1"]["conv"]["kernel"].spec[3] == "tensor"
        assert pair["conv2"]["conv"]["kernel"].spec[2] == "tensor"
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(one)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
