"""Mixtures of experts: the router, the capacity dispatch's slots and drops, the auxiliary
losses, dropless and capacity dispatch agreeing, and the refusals (models/moe.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from meshtrain import mesh as mesh_lib
from meshtrain.errors import UserError
from meshtrain.models import mixtral, moe, sizes
from meshtrain.run.experiment import check_config
from support.configs import configured


def tiny(**run) -> mixtral.MixtralConfig:
    dims = sizes.MIXTRAL_SIZES["tiny"]
    return mixtral.MixtralConfig(**dims, padded_vocab_size=dims["vocab_size"], moe=moe.MoERun(**run))


def test_capacity_slots_fill_first_choices_first_and_count_drops():
    """Expert 0 is every token's first choice: its 2 slots go to tokens 0 and 1 (first
    choices beat second choices), the rest of its copies drop and are counted."""
    top_i = jnp.array([[[0, 1], [0, 2], [0, 1], [1, 0]]])          # [B=1, T=4, k=2]
    weights = jnp.array([[[0.6, 0.4], [0.7, 0.3], [0.5, 0.5], [0.9, 0.1]]])
    dispatch, combine, dropped = moe.capacity_masks(top_i, weights, num_experts=3, slots=2)
    # Expert 0: tokens 0, 1 (first choices); token 2's first choice and token 3's second drop.
    np.testing.assert_array_equal(dispatch[0, :, 0], [[1, 0], [0, 1], [0, 0], [0, 0]])
    # Expert 1: token 3's first choice, then token 0's second; token 2's second drops.
    np.testing.assert_array_equal(dispatch[0, :, 1], [[0, 1], [0, 0], [0, 0], [1, 0]])
    np.testing.assert_array_equal(dispatch[0, :, 2], [[0, 0], [1, 0], [0, 0], [0, 0]])
    assert float(dropped) == 3.0
    np.testing.assert_allclose(combine[0, 0, 1, 1], 0.4)
    np.testing.assert_allclose(combine[0, 3, 1, 0], 0.9)


def test_capacity_formula():
    assert moe.capacity(128, 4, 2, 1.25) == 80     # ceil(2 128 1.25 / 4)
    assert moe.capacity(7, 8, 1, 1.0) == 1


def test_load_balance_is_k_when_balanced_and_matches_its_formula():
    x, k = 4, 2
    logits = jnp.zeros((1, 8, x))
    top_i = jnp.array([[[i % x, (i + 1) % x] for i in range(8)]])  # each expert 4 copies of 16
    balance, z = moe.aux_stats(top_i, logits, jax.nn.softmax(logits, -1))
    np.testing.assert_allclose(balance, k, rtol=1e-6)
    np.testing.assert_allclose(z, np.log(x) ** 2, rtol=1e-6)
    logits = jax.random.normal(jax.random.key(0), (2, 8, x))
    probs = jax.nn.softmax(logits, -1)
    top_i = jax.lax.top_k(probs, k)[1]
    balance, z = moe.aux_stats(top_i, logits, probs)
    f = np.array([(np.asarray(top_i) == e).sum() for e in range(x)]) / 16
    np.testing.assert_allclose(balance, x * np.sum(f * np.asarray(probs).mean((0, 1))), rtol=1e-6)
    lse = np.log(np.exp(np.asarray(logits, np.float64)).sum(-1))
    np.testing.assert_allclose(z, (lse ** 2).mean(), rtol=1e-5)


def test_router_renormalises_the_top_k():
    x_btd = jax.random.normal(jax.random.key(1), (2, 5, 16))
    router = jax.random.normal(jax.random.key(2), (16, 6))
    top_i, weights, logits, probs = moe.route(x_btd, router, 2)
    np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-6)
    best = np.sort(np.asarray(probs), -1)[..., -2:][..., ::-1]
    np.testing.assert_allclose(weights, best / best.sum(-1, keepdims=True), rtol=1e-6)


@pytest.fixture(scope="module")
def tokens():
    return jax.random.randint(jax.random.key(3), (2, 128), 0, 256)


def logits_and_stats(cfg, tokens):
    model = mixtral.Mixtral(cfg, nnx.Rngs(0))
    h, w, aux, stats = model.hidden_aux(tokens)
    return model.project(h, w), aux, stats


def test_dropless_equals_capacity_that_drops_nothing(tokens):
    dropless, aux_d, stats_d = logits_and_stats(tiny(dispatch="dropless"), tokens)
    capacity, aux_c, stats_c = logits_and_stats(tiny(dispatch="capacity", capacity_factor=2.0), tokens)
    assert float(stats_c["moe_dropped"]) == 0.0
    np.testing.assert_allclose(capacity, dropless, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(aux_c, aux_d, rtol=1e-6)


def test_a_small_capacity_drops_and_changes_the_output(tokens):
    dropless, _, _ = logits_and_stats(tiny(dispatch="dropless"), tokens)
    capacity, _, stats = logits_and_stats(tiny(dispatch="capacity", capacity_factor=0.5), tokens)
    # Half the even share of slots: at least half the copies find no slot.
    assert float(stats["moe_dropped"]) >= 0.5
    assert np.abs(np.asarray(capacity) - np.asarray(dropless)).max() > 1e-3


def test_aux_loss_is_weighted_by_its_coefficients(tokens):
    _, aux, stats = logits_and_stats(tiny(aux_loss_coef=0.1, z_loss_coef=0.01), tokens)
    np.testing.assert_allclose(aux, 0.1 * stats["moe_load_balance"] + 0.01 * stats["moe_z_loss"], rtol=1e-6)
    assert 2.0 <= float(stats["moe_load_balance"]) < 2.2  # near k at initialisation


def test_parameter_counts_match_the_module():
    for shared in (0, 2):
        cfg = tiny() if not shared else mixtral.MixtralConfig(
            **{**sizes.MIXTRAL_SIZES["tiny"], "num_shared_experts": shared}, padded_vocab_size=256)
        model = mixtral.Mixtral(cfg, nnx.Rngs(0))
        total = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
        assert mixtral.num_params(cfg) == total
        d, f, x, k, layers = 64, 128, 4, 2, 2
        assert mixtral.num_params(cfg) - mixtral.active_params(cfg) == layers * (x - k) * 3 * d * f


def test_flops_count_active_parameters():
    cfg = tiny()
    dense = 6.0 * (mixtral.active_params(cfg) - 256 * 64) + 6.0 * 2 * 64 * 128
    assert mixtral.flops_per_token(cfg) == dense
    assert mixtral.flops_per_token(cfg) < 6.0 * mixtral.num_params(cfg)


@pytest.mark.parametrize("overrides, needle", [
    ({"moe.dispatch": "sparse"}, "moe.dispatch='sparse' is not a dispatch mode"),
    ({"moe.grouped_matmul": "cutlass"}, "moe.grouped_matmul='cutlass' is not a way to compute dropless's grouped"),
    ({"moe.capacity_factor": 0.0}, "moe.capacity_factor=0.0: must be > 0"),
    ({"model.experts_per_token": 5}, "model.experts_per_token=5 with model.num_experts=4"),
    ({"layout": "dp_pp", "mesh.shape": "stage:2", "pipeline.microbatches": 2}, "cannot be pipelined yet"),
    ({"moe.aux_loss_coef": -0.1}, "moe.aux_loss_coef=-0.1: must be >= 0 (0 turns the loss off)"),
    ({"model.num_shared_experts": -1}, "model.num_shared_experts=-1: must be a non-negative integer"),
])
def test_refusals(overrides, needle):
    cfg = configured("mixtral_tiny_dp8", **{"mesh.shape": "data:1", **overrides})
    shape = mesh_lib.parse_shape(cfg.mesh.shape)
    mesh = jax.sharding.AbstractMesh(tuple(shape.values()), tuple(shape))
    with pytest.raises(UserError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        check_config(cfg, mesh)


@pytest.mark.parametrize("layout, needle", [
    ("batch:data;experts:expert;embed:tensor", "the layout splits `embed` in the experts' compute"),
    ("batch:data+tensor;experts:expert;mlp:tensor", "the layout splits the experts' `mlp` over mesh axes ('tensor',)"),
])
def test_dropless_refuses_a_split_it_cannot_run(layout, needle):
    """Dropless runs per device under shard_map, with embed whole and the experts' mlp on
    axes of its own: other splits are refused with the fix, before anything is traced."""
    from meshtrain.models import moe_dropless
    from meshtrain.parallel.hook import Constrain
    from meshtrain.parallel.layouts import get
    mesh = jax.make_mesh((2, 2, 2), ("data", "expert", "tensor"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 3)
    ws = (jnp.zeros((4, 64, 128)), jnp.zeros((4, 64, 128)), jnp.zeros((4, 128, 64)))
    x, e, w = jnp.zeros((4, 8, 64)), jnp.zeros((4, 8, 2), jnp.int32), jnp.zeros((4, 8, 2))
    with pytest.raises(UserError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        moe_dropless.experts(x, e, w, ws, Constrain(get(layout), mesh))


@pytest.mark.parametrize("rows,groups", [(256, 4), (37, 3), (5, 4)])
def test_windowed_grouped_matmul_equals_each_row_through_its_expert(rows, groups):
    """moe_dropless's windows against every row through its own expert's SwiGLU, one at a
    time (in numpy): random sizes, one expert taking every row, rows of no expert (id =
    groups, output 0); gradients against jax.lax.ragged_dot's; and the same under vmap, as
    accumulation runs it. xs [rows, 8], the experts' weights [groups, 8, 12] twice and
    [groups, 12, 8].

    Everything jax computes here is one jitted program per shape, called once per choice
    of ids: compiled once, where op-by-op dispatch compiled every op on its own."""
    from meshtrain.models import moe_dropless
    rng = np.random.default_rng(rows)
    d, f = 8, 12
    ws = tuple(jnp.asarray(rng.standard_normal(s), jnp.float32) for s in
               ((groups, d, f), (groups, d, f), (groups, f, d)))
    xs = jnp.asarray(rng.standard_normal((rows, d)), jnp.float32)

    @jax.jit
    def windowed_and_ragged(x, ids, ws):
        """-> (windowed y [rows, D], y of the rows reversed, the gradients of sum(y^2) by x
        and the 3 weights: windowed's and ragged_dot's, y of (x, reversed x) under vmap)."""
        order = jnp.argsort(ids, stable=True)
        sizes_g = (ids[:, None] == jnp.arange(groups)).sum(0).astype(jnp.int32)

        def ragged(x, a, b, c):
            x = x[order]
            y = jax.lax.ragged_dot(jax.nn.silu(jax.lax.ragged_dot(x, a, sizes_g))
                                   * jax.lax.ragged_dot(x, b, sizes_g), c, sizes_g)
            return (y ** 2).sum()

        def windowed(x, a, b, c):
            return (moe_dropless._grouped(x, ids, groups, (a, b, c)) ** 2).sum()

        pair = jax.vmap(lambda x, i: moe_dropless._grouped(x, i, groups, ws))(
            jnp.stack([x, x[::-1]]), jnp.stack([ids, ids[::-1]]))
        return (moe_dropless._grouped(x, ids, groups, ws), moe_dropless._grouped(x[::-1], ids[::-1], groups, ws),
                jax.grad(windowed, (0, 1, 2, 3))(x, *ws), jax.grad(ragged, (0, 1, 2, 3))(x, *ws), pair)

    x_np, w_np = np.asarray(xs), [np.asarray(w) for w in ws]
    for ids in (rng.integers(0, groups + 1, rows), np.full(rows, groups - 1)):
        got, got_reversed, mine, theirs, pair = windowed_and_ragged(xs, jnp.asarray(ids, jnp.int32), ws)
        want = np.zeros((rows, d), np.float32)
        for r, e in enumerate(ids):
            if e < groups:
                gate = x_np[r] @ w_np[0][e]
                want[r] = (gate / (1 + np.exp(-gate)) * (x_np[r] @ w_np[1][e])) @ w_np[2][e]  # silu(gate) * up
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        for g_mine, g_theirs in zip(mine, theirs):
            np.testing.assert_allclose(g_mine, g_theirs, rtol=1e-4, atol=1e-5 * float(jnp.abs(g_theirs).max()))
        np.testing.assert_array_equal(pair[0], got)
        np.testing.assert_array_equal(pair[1], got_reversed)


def test_ragged_dot_grouped_matmul_equals_the_windows_also_under_vmap():
    """moe.grouped_matmul=ragged_dot (models/moe_ragged.py) against the windows: outputs
    and the gradients of sum(y^2) by the rows and the 3 weights, rows of no expert
    included; and under vmap with the weights unbatched, as gradient accumulation runs it
    (JAX's own ragged_dot refuses that batching). Rows [2, 40, 8], 3 experts [3, 8, 12],
    [3, 8, 12], [3, 12, 8]; one jitted program."""
    from meshtrain.models import moe_dropless
    rng = np.random.default_rng(7)
    groups, rows, d, f = 3, 40, 8, 12
    ws = tuple(jnp.asarray(rng.standard_normal(s), jnp.float32) for s in
               ((groups, d, f), (groups, d, f), (groups, f, d)))
    xs = jnp.asarray(rng.standard_normal((2, rows, d)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, groups + 1, (2, rows)), jnp.int32)    # id = groups: no expert

    @jax.jit
    def both(xs, ids, ws):
        def loss(mode):
            return lambda x, i, ws: (moe_dropless._grouped(x, i, groups, ws, mode) ** 2).sum()
        one = {m: jax.value_and_grad(loss(m), (0, 2))(xs[0], ids[0], ws) for m in ("windowed", "ragged_dot")}
        batched = jax.vmap(jax.value_and_grad(loss("ragged_dot"), (0, 2)), (0, 0, None))(xs, ids, ws)
        return one, batched, jax.vmap(lambda x, i: moe_dropless._grouped(x, i, groups, ws, "ragged_dot"))(xs, ids)

    one, batched, y = both(xs, ids, ws)
    (win_loss, win_grads), (rag_loss, rag_grads) = one["windowed"], one["ragged_dot"]
    np.testing.assert_allclose(rag_loss, win_loss, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(rag_grads), jax.tree.leaves(win_grads)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(jnp.abs(b).max()))
    np.testing.assert_array_equal(np.asarray(y)[np.asarray(ids) == groups], 0)
    np.testing.assert_allclose(batched[0][0], rag_loss, rtol=1e-6)
    for a, b in zip(jax.tree.leaves((batched[1][0][0], jax.tree.map(lambda g: g[0], batched[1][1]))),
                    jax.tree.leaves(rag_grads)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * float(jnp.abs(b).max()))


def test_grouped_matmul_auto_is_the_windows_until_measured():
    """auto resolves per backend (moe_dropless.AUTO): the windows everywhere today, the CPU
    by measurement, the GPU and TPU until a measurement there says otherwise."""
    from meshtrain.models import moe_dropless
    assert [moe_dropless.grouped_matmul("auto", p) for p in ("cpu", "gpu", "tpu")] == ["windowed"] * 3
    assert moe_dropless.grouped_matmul("ragged_dot", "cpu") == "ragged_dot"


def test_windows_cover_any_sizes_with_a_static_count():
    """Every row of every group lies in exactly one window of that group, whatever the
    sizes; the count is static: rows // w + g rounded up to a multiple of g, with w =
    rows / (4 g), so the windows hold 1.25 x the rows and g windows more at most."""
    from meshtrain.models import moe_dropless
    rows = 1000
    rng = np.random.default_rng(0)
    for sizes_g in ([125] * 8, [1000] + [0] * 7, [0] * 7 + [999], list(np.diff(np.sort(rng.integers(0, 901, 9))))):
        w, group, first, owned = moe_dropless.windows(jnp.asarray(sizes_g, jnp.int32), rows)
        group, first, owned = (np.asarray(a) for a in (group, first, owned))
        assert w == 32 and len(group) == 40  # 1000 // 32 + 8 = 39, up to a multiple of 8
        starts = np.cumsum(sizes_g) - sizes_g
        for e, (start, size) in enumerate(zip(starts, sizes_g)):
            covered = [r for i in np.flatnonzero(group == e) for r in range(first[i], first[i] + owned[i])]
            assert sorted(covered) == list(range(start, start + size)), (sizes_g, e)
        assert owned.sum() == sum(sizes_g)
