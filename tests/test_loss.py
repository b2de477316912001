"""The loss over chunks of positions (meshtrain/step/loss.py) against the loss over whole logits:
the same loss and gradients on sharded layouts, the same data-parallel reduction of the
table's gradient and the same matmuls, less temp memory, and the config check.

Models are the tiny ones at T = 64 in chunks of 16 (4 chunks), 8 rows on 8 fake devices.
The programs the tests build are run once or only read, so they compile with the planner's
analysis options (compile_options.ANALYSIS_OPTIONS: the same HLO, 3x faster to compile)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from meshtrain.errors import UserError
from meshtrain.planner import hlo, hlo_flops
from meshtrain.run.compile_options import analysis_options
from meshtrain.run.experiment import Experiment
from meshtrain.step import loss as loss_lib, train_step as step_lib

T, CHUNK = 64, 16
# bf16 rounding: the table's gradient is rounded to bf16 once over whole logits, but each
# chunk's piece of it is rounded (then summed in float32) with chunks. Each rounding moves
# an entry by at most half a bf16 step, 2^-9 of the largest entry, so the two differ by at
# most (chunks + 1) x 2^-9 of it, plus a rounding of the data-parallel sum on each side.
BF16_TABLE_ATOL = (T // CHUNK + 3) * 2.0**-9


def build(make_config, name, dtype="float32", rows=8, **overrides):
    return Experiment.build(make_config(name, **{"model.seq_len": T, "model.dtype": dtype,
                                                 "train.batch_size": rows, **overrides}))


def loss_and_grads(exp, chunk, params):
    rows = exp.cfg.train.batch_size
    tokens = np.random.default_rng(0).integers(0, exp.model.cfg.vocab_size, (rows, T + 1), dtype=np.int32)
    tokens = jax.device_put(tokens, exp.batch_sharding)
    objective = step_lib.make_objective(exp.model, exp.layout, exp.mesh, loss_chunk=chunk)
    grad_fn = jax.jit(jax.value_and_grad(lambda p, b, k: objective(p, {}, b, k)[0]),
                      compiler_options=analysis_options())
    return jax.device_get(grad_fn(params, tokens, None))


CASES = [  # name, compute dtype, rows (a pipeline needs microbatches x batch shards)
    ("gpt2_tiny_dp2_tp4", "float32", 8),    # tied table, vocabulary split over tensor
    ("llama_tiny_dp2_tp4", "float32", 8),   # untied head, vocabulary split over tensor
    ("gpt2_tiny_pp2_dp4", "float32", 16),   # hidden through the pipeline's run_layers
    ("gpt2_tiny_dp2_tp4", "bfloat16", 8),
    ("llama_tiny_fsdp8", "bfloat16", 8),    # the head gathered over fsdp
]


@pytest.mark.parametrize("name, dtype, rows", CASES)
def test_chunks_give_the_whole_loss_and_gradients(name, dtype, rows, make_config):
    """Tight in float32. In bf16 only the output projection's gradient is summed in another
    order (see BF16_TABLE_ATOL); every other leaf gets the same input gradient."""
    exp = build(make_config, name, dtype, rows)
    params = exp.init_state().params
    (whole, g_whole), (chunked, g_chunked) = loss_and_grads(exp, 0, params), loss_and_grads(exp, CHUNK, params)
    assert float(chunked) == pytest.approx(float(whole), rel=1e-6)
    projection = {"wte", "lm_head"}
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_whole), jax.tree.leaves(g_chunked)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        scale = np.abs(a).max()
        loose = dtype == "bfloat16" and path[0].key in projection
        np.testing.assert_allclose(b, a, rtol=0, atol=(BF16_TABLE_ATOL if loose else 1e-5) * scale,
                                   err_msg=jax.tree_util.keystr(path))


def float32_autodiff_loss(logits_nv, targets_n, weights_n=None):
    """The loss before the hand-written gradient: logits upcast to float32, autodiff."""
    each = optax.softmax_cross_entropy_with_integer_labels(logits_nv.astype(jnp.float32), targets_n)
    return each.sum() if weights_n is None else (weights_n * each).sum()


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_logits_gradient_is_softmax_minus_onehot_in_the_logits_dtype(dtype, weighted):
    """On logits alone: the loss to float32 rounding, and each entry of the gradient, which
    comes out in the logits' dtype, equal to the float32 autodiff gradient (softmax -
    onehot, times the cotangent) rounded to that dtype: one bf16 step (2^-7 of the entry)
    apart at most; in float32, exp of an argument near 10 in size moves by 10 of its
    roundings, so 1e-5 of the entry."""
    k1, k2 = jax.random.split(jax.random.key(0))
    logits = (3 * jax.random.normal(k1, (4, 16, 1000))).astype(dtype)
    targets = jax.random.randint(k2, (4, 16), 0, 1000)
    # weighted: a packed window's targets, some weighing 0 (models/documents.py)
    weights = (jax.random.uniform(k1, (4, 16)) > 0.2).astype(jnp.float32) if weighted else None
    new, g_new = jax.value_and_grad(lambda x: 0.5 * loss_lib.summed_cross_entropy(x, targets, weights))(logits)
    old, g_old = jax.value_and_grad(lambda x: 0.5 * float32_autodiff_loss(x, targets, weights))(logits)
    assert g_new.dtype == logits.dtype
    assert float(new) == pytest.approx(float(old), rel=1e-6)
    rtol = {"float32": 1e-5, "bfloat16": 2.0**-7}[dtype]
    np.testing.assert_allclose(np.asarray(g_new, np.float64), np.asarray(g_old, np.float64), rtol=rtol, atol=1e-12)


def relative_error(grads, reference) -> float:
    """|grads - reference| / |reference| over all leaves together."""
    pairs = [(np.asarray(a, np.float64), np.asarray(b, np.float64))
             for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(reference))]
    return float(np.sqrt(sum(((a - b) ** 2).sum() for a, b in pairs) / sum((b ** 2).sum() for _, b in pairs)))


@pytest.mark.parametrize("name, dtype", [("gpt2_tiny_dp2_tp4", "float32"), ("gpt2_tiny_dp2_tp4", "bfloat16"),
                                         ("llama_tiny_fsdp8", "bfloat16")])
@pytest.mark.parametrize("chunk", [0, CHUNK])
def test_the_hand_written_gradient_equals_float32_autodiff(name, dtype, chunk, make_config, monkeypatch):
    """summed_cross_entropy (logits in the compute dtype, float32 only inside the fusions,
    the gradient by hand) against the loss it replaced, on whole logits and in chunks.
    In float32 the two are one formula: every gradient equal to 1e-5 of its largest entry.
    In bf16 both round the logits' gradient to bf16, from float32 softmaxes formed in
    different orders, so an entry can land one bf16 step apart and the step's bf16
    backward carries that on: the new gradient is held to be as close to the
    float32-compute gradient of the same parameters as the old one was (within 5%)."""
    exp = build(make_config, name, dtype)
    params = exp.init_state().params
    new_loss, new_grads = loss_and_grads(exp, chunk, params)
    if dtype == "bfloat16":
        _, reference = loss_and_grads(build(make_config, name, "float32"), chunk, params)
    monkeypatch.setattr(loss_lib, "summed_cross_entropy", float32_autodiff_loss)
    old_loss, old_grads = loss_and_grads(exp, chunk, params)
    assert float(new_loss) == pytest.approx(float(old_loss), rel=1e-6)
    if dtype == "bfloat16":
        assert relative_error(new_grads, reference) <= 1.05 * relative_error(old_grads, reference)
        return
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(old_grads), jax.tree.leaves(new_grads)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-5 * np.abs(a).max(), err_msg=jax.tree_util.keystr(path))


def test_eval_step_takes_the_same_chunks(make_config):
    exp = build(make_config, "gpt2_tiny_dp2_tp4", **{"train.loss_chunk": CHUNK})
    params = exp.init_state().params
    tokens = np.random.default_rng(0).integers(0, 256, (8, T + 1), dtype=np.int32)
    tokens = jax.device_put(tokens, exp.batch_sharding)
    whole = step_lib.make_eval_step(exp.model, exp.layout, exp.mesh, exp.shardings.params, loss_chunk=0)
    chunked, whole = (step.lower(params, {}, tokens).compile(analysis_options())(params, {}, tokens)["loss"]
                      for step in (exp.eval_step, whole))
    assert float(chunked) == pytest.approx(float(whole), rel=1e-6)


def test_chunks_keep_the_bf16_data_reduction_and_the_flops(make_config):
    """Each chunk's table gradient is summed on its device and reduced over data once, in
    bf16: the same all-reduces and bytes as over whole logits. (Summed in the scan, the
    reduction would run once per chunk; from a float32 accumulator, at twice the bytes.)
    The gradient comes with the loss, so no matmul is run twice."""
    data, flops = {}, {}
    for c in (0, CHUNK):
        exp = build(make_config, "gpt2_tiny_dp2_tp4", "bfloat16", **{"train.loss_chunk": c})
        program = exp.compile(analysis=True)
        data[c] = next(r for r in hlo.collective_table(program, exp.mesh)
                       if r["kind"] == "all-reduce" and r["mesh_axes"] == ("data",))
        flops[c] = hlo_flops.dot_flops(program)
    assert (data[CHUNK]["count"], data[CHUNK]["result_bytes"]) == (data[0]["count"], data[0]["result_bytes"])
    assert flops[CHUNK] == flops[0]


def test_chunks_save_at_least_one_float32_logits_array(make_config):
    """gpt2 tiny with an 8K vocabulary at 16 x 256 on dp8 (2 rows a device): whole logits
    keep [2, 256, 8192] float32 (16 MiB) and more; chunks of 64 positions a quarter of it."""
    temps = {}
    for chunk in (0, 64):
        exp = Experiment.build(make_config("gpt2_tiny_dp8", **{
            "model.seq_len": 256, "model.vocab_size": 8192, "train.batch_size": 16, "train.loss_chunk": chunk}))
        temps[chunk] = exp.compile(analysis=True).memory_analysis().temp_size_in_bytes
    logits = 2 * 256 * exp.model.cfg.padded_vocab_size * 4
    assert temps[0] - temps[64] >= logits


def test_a_chunk_that_does_not_divide_the_length_is_refused(make_config):
    with pytest.raises(UserError) as e:
        build(make_config, "gpt2_tiny_dp8", **{"train.loss_chunk": 48})
    msg = str(e.value)
    assert f"train.loss_chunk=48 does not divide model.seq_len={T}" in msg
    assert f"a divisor of {T}, e.g. 32, or 0 for the whole sequence" in msg
    with pytest.raises(UserError, match="train.loss_chunk=-16: must be >= 0"):
        build(make_config, "gpt2_tiny_dp8", **{"train.loss_chunk": -16})


def test_one_chunk_is_the_plain_loss(make_config):
    """loss_chunk 0 or >= T: the program of the whole-logits loss, no scan added."""
    exp = build(make_config, "gpt2_tiny_dp8")
    args = (exp.abstract_state().params, jax.ShapeDtypeStruct((8, T + 1), np.int32), None)

    def program(chunk):
        objective = step_lib.make_objective(exp.model, exp.layout, exp.mesh, loss_chunk=chunk)
        return str(jax.make_jaxpr(lambda p, b, k: objective(p, {}, b, k)[0])(*args))
    assert program(T) == program(2 * T) == program(0) != program(CHUNK)
