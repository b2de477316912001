"""Compressed gradient reduction (train.grad_compression, parallel/compression.py): the
bytes over the compressed axis against a float32 reduction, the feedback buffers' exact
bookkeeping, training close to the float32 reduction, an exact resume with the buffers
in the checkpoint, and what cannot compress refused with the fix."""

import re
import types

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from meshtrain.errors import UserError
from meshtrain.parallel import compression
from meshtrain.planner import analytic, bounds, hlo, roofline
from meshtrain.run.experiment import Experiment
from support.configs import configured
from support.training import TOKENS, assert_refused, stepped

STEPS = 4
DCN = {"mesh.dcn": "data:2"}


def build(kind="none", name="gpt2_tiny_dp8", **overrides):
    return Experiment.build(configured(name, **{"train.steps": str(STEPS), **TOKENS, **DCN,
                                                "train.grad_compression": kind, **overrides}))


def data_bytes(exp) -> tuple[dict, object]:
    """({"all": bytes each device sends over `data` per step, "across": those of groups that
    cross the two nodes, "phases": those of their all-to-alls and all-gathers (the
    compressed phases, without the loss's 4-byte all-reduce)}, the compiled step)."""
    compiled = exp.compile(analysis=True)
    rows = [r for r in hlo.collective_table(compiled, exp.mesh, roofline.node_of_position(exp.mesh, 8, exp.dcn))
            if r["mesh_axes"] == ("data",)]
    across = [r for r in rows if r["nodes"] > 1]
    return {"all": sum(r["bytes"] for r in rows), "across": sum(r["bytes"] for r in across),
            "phases": sum(r["bytes"] for r in across if r["kind"] != "all-reduce")}, compiled


@pytest.fixture(scope="module")
def runs():
    """kind -> (bytes over data, losses of STEPS steps, final state, experiment)."""
    out = {}
    for kind in ("none", "int8", "onebit"):
        exp = build(kind)
        nbytes, compiled = data_bytes(exp)
        history = list(stepped(exp, STEPS, step=compiled))
        out[kind] = nbytes, [float(m["loss"]) for _, m in history], history[-1][0], exp
    return out


def test_compressed_bytes_across_the_nodes_are_a_quarter_and_a_thirtysecond(runs):
    """data:8 on 2 nodes of 4: float32 inside a node, compressed across (scales, padding
    and every small leaf included: one bucket a device). Against XLA's reduction as it
    compiles here (one flat ring over 8, every group crossing) and against the two-level
    float32 reduction a cluster's library runs (reduce-scatter in the node, 1/m of the
    bytes across: 2 (k-1)/k x S / m for the float32 gradient's S bytes)."""
    d, k, m = 8, 2, 4
    flat = runs["none"][0]["across"]
    two_level = 2 * (k - 1) / k * (flat * d / (2 * (d - 1))) / m
    for kind, most, share in (("int8", 0.27, 0.25), ("onebit", 0.05, 1 / 32)):
        across = runs[kind][0]["across"]
        assert across <= most * two_level < most * flat
        assert across / two_level == pytest.approx(share + 1 / compression.BLOCK[kind], rel=0.03)  # module docstring
    # Inside the node the bucket goes in float32: the data axis as a whole sends about as much.
    assert runs["int8"][0]["all"] > 0.8 * runs["none"][0]["all"]


def test_the_start_up_line_gives_the_compiled_bytes_between_nodes(runs):
    """`meshtrain train` says how the gradients meet (Experiment.gradients_line): the kind, the
    axis, the nodes and the bytes a device sends between them a step, which are what
    compiles, and their share of float32's."""
    for kind in ("int8", "onebit"):
        line = runs[kind][3].gradients_line()
        said = re.fullmatch(rf"gradients: {kind} over data across 2 nodes, error feedback on: ([\d,]+) bytes a "
                            rf"device a step between nodes, ([\d.]+) of float32's", line)
        assert said, line
        assert int(said[1].replace(",", "")) == runs[kind][0]["phases"]
        assert float(said[2]) == pytest.approx(0.25 + 1 / 2048 if kind == "int8" else 1 / 32 + 1 / 64, abs=1e-3)
    assert runs["none"][3].gradients_line() is None  # XLA's reduction: nothing to say


@pytest.mark.parametrize("kind", ["int8", "onebit"])
def test_the_planner_counts_what_compiles(runs, kind):
    """The bound over data is the compiled bytes (compression.wire) and the memory formula
    counts the feedback buffers."""
    nbytes, _, state, exp = runs[kind]
    bound = sum(b["bytes"] for b in bounds.collective_bounds(exp) if list(b["mesh_axes"]) == ["data"])
    assert bound == pytest.approx(nbytes["all"], rel=0.01)
    plain = analytic.state_bytes(runs["none"][3])["gradients"]
    assert analytic.state_bytes(exp)["gradients"] - plain == sum(x.shape[1] * 4 for x in jax.tree.leaves(state.comm))


def test_compressed_runs_train_close_to_the_float32_reduction(runs):
    base = np.array(runs["none"][1])
    assert np.abs(np.array(runs["int8"][1]) - base).max() < 1e-3 * base[0]
    assert np.abs(np.array(runs["onebit"][1]) - base).max() < 2e-2 * base[0]
    worker, server = (runs["onebit"][2].comm[k] for k in ("worker", "server"))
    assert worker.shape[0] == server.shape[0] == 8 and worker.shape[1] == 2 * server.shape[1]  # a row a device; 2 nodes


def test_mixed_precision_buckets_a_dtype_and_trains_like_xlas_reduction():
    """bfloat16 compute: matrices' gradients arrive in bfloat16, the rest in float32, a bucket
    each (the in-node phases in its dtype); int8 across the nodes trains as XLA's reduction."""
    plain, int8 = (build(kind, **{"model.dtype": "bfloat16"}) for kind in ("none", "int8"))
    assert int8.reduction.compression.cut.dtypes == ("float32", "bfloat16")
    losses = [np.array([float(m["loss"]) for _, m in stepped(e, 3, step=e.compile(analysis=True))])
              for e in (plain, int8)]  # the third loss is the first after a step of lr > 0
    assert np.abs(losses[1] - losses[0]).max() < 1e-3 * losses[0][0]


@pytest.mark.parametrize("kind", ["int8", "onebit"])
def test_error_feedback_loses_nothing_for_good(kind):
    """Summed over steps, what the two phases deliver plus what the buffers hold is the
    true sum, to float32 rounding: the worker buffers keep what phase 1 lost, the server
    buffers what phase 2 lost (module docstring), and nothing else goes missing."""
    mesh = jax.make_mesh((8,), ("data",))
    c, m = 8, compression.chunk(5000, 8)
    rng = np.random.default_rng(0)

    def body(v, worker, server):
        total, errs = compression.compressed_sum(kind, v[0], ("data",), c, {"worker": worker[0], "server": server[0]})
        return total[None], errs["worker"][None], errs["server"][None]
    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=False))
    rows = NamedSharding(mesh, P("data"))
    worker, server = np.zeros((8, c * m), np.float32), np.zeros((8, m), np.float32)
    delivered, true = np.zeros(c * m), np.zeros(c * m)
    for _ in range(10):
        v = rng.standard_normal((8, c * m)).astype(np.float32) * rng.uniform(0.1, 10)
        total, worker, server = (np.asarray(x) for x in step(*jax.device_put((v, worker, server), rows)))
        assert (total == total[0]).all()  # every device holds the same sum
        delivered += total[0]
        true += v.astype(np.float64).sum(0)
    held = worker.astype(np.float64).sum(0) + server.reshape(-1)  # device j's server buffer: chunk j
    np.testing.assert_allclose(delivered + held, true, rtol=0, atol=2e-4 * np.abs(true).max())
    assert np.abs(held).max() > (1e-5 if kind == "int8" else 1e-1) * np.abs(true).max()  # it did hold something


def test_a_resume_takes_the_buffers_exactly_and_a_run_without_them_starts_them_at_zero(runs, tmp_path, capsys):
    from meshtrain.checkpoints import store
    exp = build("onebit")
    compiled = exp.compile(analysis=True)  # as `runs` compiled it
    half = list(stepped(exp, STEPS // 2, step=compiled))[-1][0]
    ck = store.Checkpointer(tmp_path / "ck", every=0, keep=2, use_async=False)
    ck.save(STEPS // 2, half, {})
    ck.wait()
    resumed, _ = ck.restore(STEPS // 2, exp)
    batches = exp.train_batches(STEPS // 2)
    for _ in range(STEPS - STEPS // 2):
        resumed, _ = compiled(resumed, exp.put_batch(next(batches)))
    final = resumed
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(final), jax.device_get(runs["onebit"][2]))
    plain = build("none")
    ck.save(STEPS // 2 + 1, plain.init_state(), {})
    ck.wait()
    zeroed, _ = ck.restore(STEPS // 2 + 1, exp)
    ck.close()
    assert all(float(abs(x).max()) == 0 for x in jax.tree.leaves(zeroed.comm))
    assert "error feedback starts from zero at step 3" in capsys.readouterr().err


@pytest.mark.parametrize("name,overrides,words", [
    ("gpt2_tiny_dp8", {"train.grad_compression": "fp8"}, ["'fp8'", "none, int8", "onebit"]),
    ("gpt2_tiny_dp8", {"train.grad_compression": "int8", "train.grad_dtype": "bfloat16"}, ["its own dtype"]),
    ("gpt2_tiny_dp8_zero2", {"train.grad_compression": "int8"}, ["inside the backward pass", "Use zero1"]),
    ("gpt2_tiny_fsdp8", {"train.grad_compression": "int8", "mesh.dcn": ""}, ["over data", "no axis"]),
    ("gpt2_tiny_dp2_tp4", {"train.grad_compression": "int8", "train.compress_axes": "tensor"}, ["over tensor"]),
    ("vgg_tiny_digits_dp2", {"train.grad_compression": "onebit", "mesh.dcn": ""}, ["BatchNorm", "batch_norm=false"]),
])
def test_what_cannot_compress_is_refused_with_the_fix(name, overrides, words):
    assert_refused(name, overrides, words)


def test_error_feedback_must_be_a_bool():
    """A config file may give a string where the command line's parser would keep the type."""
    keys = dict(grad_compression="onebit", grad_dtype="", error_feedback=True)
    compression.check(types.SimpleNamespace(**keys))
    with pytest.raises(UserError, match="train.error_feedback='yes': must be true or false"):
        compression.check(types.SimpleNamespace(**{**keys, "error_feedback": "yes"}))
