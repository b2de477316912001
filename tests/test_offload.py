"""Host offload (train.offload, model.remat=offload_*): the state lives in host memory and
the run is the run without offload, bit for bit (on CPU a transfer is a copy); the
compiled step takes and returns exactly the offloaded leaves in host memory; a lowering
for CUDA shows each layer's parameters and each offloaded activation crossing the host
link, the CPU's shows none; checkpoints move between runs with and without; and what
cannot take it says so in one line."""

import collections
import dataclasses
import re
import types

import jax
import numpy as np
import pytest

from meshtrain.checkpoints.store import Checkpointer
from meshtrain.errors import UserError
from meshtrain.parallel import offload
from meshtrain.pictures import text
from meshtrain.planner import analytic, capacity, hardware, hlo, host_offload
from meshtrain.run import memory_check
from meshtrain.run import memory_budget
from meshtrain import mesh as mesh_lib
from meshtrain.run import experiment
from meshtrain.run.experiment import Experiment
from meshtrain.runlog import metrics as metrics_lib
from support.configs import configured
from support.training import ROWS

STEPS = 5
MIB = 2**20
HOST = "pinned_host"
# (config, train.offload) pairs, each trained beside the same config without offload.
CASES = [("gpt2_tiny_dp8", "opt_state"), ("gpt2_tiny_dp8", "params"), ("gpt2_tiny_fsdp8:clip", "opt_state,params"),
         ("llama_tiny_fsdp8", "opt_state,params"), ("gpt2_tiny_pp2_dp4", "opt_state"),
         ("gpt2_tiny_dp8:accum", "opt_state,params"), ("gpt2_tiny_dp8:lamb", "opt_state,params")]
# A case's name: a config, and after ":" a variant of it: two microbatches a step, LAMB
# (whose per-layer trust ratio the streamed update sees one layer at a time), or a gradient
# clip that acts on every step (the norms are 0.8-1.1; the streamed update clips each layer
# by the whole step's norm).
VARIANTS = {"accum": {"train.grad_accum_steps": "2"}, "lamb": {"optim.name": "lamb"}, "clip": {"optim.grad_clip": "0.5"}}


def build(name, offload="", **overrides):
    name, _, variant = name.partition(":")
    return Experiment.build(configured(name, **{"train.steps": str(STEPS), "train.offload": offload, **ROWS,
                                                **VARIANTS.get(variant, {}), **overrides}))


def train(exp, steps=STEPS):
    """-> (metrics rows, final state, the memory kinds after init and after each step,
    the compiled step's HLO text and memory report): the step compiled once, ahead of time,
    with the planner's analysis options (3-4x faster to compile; both sides of a comparison
    alike)."""
    compiled, state = exp.compile(analysis=True), exp.init_state()
    kinds, rows, batches = [memory_kinds(state)], [], exp.train_batches()
    for _ in range(steps):
        state, metrics = compiled(state, exp.put_batch(next(batches)))
        rows.append({k: float(metrics[k]) for k in ("loss", "grad_norm")})
        kinds.append(memory_kinds(state))
    return rows, state, kinds, compiled.as_text(), metrics_lib.memory_report(compiled)


def memory_kinds(state) -> dict:
    """{"params": {kinds}, "opt_state": {kinds}} of a TrainState's leaves."""
    return {part: {leaf.sharding.memory_kind for leaf in jax.tree.leaves(getattr(state, part))}
            for part in ("params", "opt_state")}


@pytest.fixture(scope="module")
def baselines():
    runs = {}

    def get(name):
        if name not in runs:
            runs[name] = train(build(name))
        return runs[name]
    return get


@pytest.mark.parametrize("name,offload", CASES, ids=[f"{n}-{o}" for n, o in CASES])
def test_offload_trains_bit_for_bit_like_the_run_without_and_keeps_its_state_on_the_host(baselines, name, offload):
    rows, state, kinds, text, memory = train(build(name, offload))
    want_rows, want_state, want_kinds, _, want_memory = baselines(name)
    assert rows == want_rows  # losses and gradient norms, exactly
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(want_state)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    offloaded = offload.split(",")
    for step_kinds in kinds:  # after init and after every step
        for part in ("params", "opt_state"):
            assert step_kinds[part] == ({HOST} if part in offloaded else {"device"}), (part, step_kinds)
    assert all(k == {"params": {"device"}, "opt_state": {"device"}} for k in want_kinds)
    # The compiled step's entry layout: memory space S(5) on exactly the offloaded leaves,
    # as arguments and as results.
    n_host = sum(len(jax.tree.leaves(getattr(state, part))) for part in offloaded)
    layout = next(line for line in text.splitlines() if "entry_computation_layout" in line)
    assert layout.count("S(5)") == 2 * n_host
    # The memory report: what moved to the host is each offloaded part's bytes per device,
    # and the state the device holds between steps (the step's arguments and results) is
    # lower by as much. (The CPU's temporaries are one memory: the peak while the step runs
    # is the GPU stage's to measure, docs/performance.md.)
    moved = sum(shard_bytes(getattr(state, part)) for part in offloaded)
    assert memory["host"] == moved and want_memory["host"] == 0
    for key in ("argument", "output"):
        assert want_memory[key] - memory[key] == moved, key


def shard_bytes(tree) -> int:
    return sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(tree))


def placements(exp, platform: str) -> collections.Counter:
    """{(memory kind, tensor type): count} of the transfers in the step lowered for `platform`."""
    text = exp.train_step.trace(exp.abstract_state(), exp.abstract_batch()).lower(
        lowering_platforms=(platform,)).as_text()
    return collections.Counter(re.findall(
        r'annotate_device_placement\(%[^)]*\) \{[^}]*_xla_buffer_placement = "(\w+)"\}\} : \(tensor<([^>]*)>', text))


def tensor_type(shape, dtype) -> str:
    return "x".join(map(str, shape)) + "x" + {"float32": "f32"}[str(dtype)]


@pytest.mark.parametrize("spec", [(), ("data",), (None, "data"), (None, None, "data")],
                         ids=["replicated", "layers", "dim1", "dim2"])
def test_the_gradient_norm_adds_in_one_order_streamed_or_not(spec):
    """Stacked leaves' sums of squares, streamed one layer at a time (offload) or not, are
    the same float32 numbers for any gradients, not only for the ones a run happens to
    draw; beside `w` (split as `spec` says), `v` is split over another mesh axis. Unstreamed,
    the devices' partial sums meet in at most one all-reduce a leaf, none a layer (the
    layers split over devices, as a pipeline's stages: summed across them)."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    mesh = jax.make_mesh((4, 2), ("data", "tensor"))
    rng = np.random.default_rng(0)
    layers = spec[0] if spec else None
    on_device = {"blocks": {"w": NamedSharding(mesh, P(*spec)), "v": NamedSharding(mesh, P(layers, None, "tensor"))},
                 "wte": NamedSharding(mesh, P())}
    on_host = {**on_device, "blocks": offload.to_host(on_device["blocks"])}  # as params offload leaves them
    sums = [jax.jit(lambda g, w=w, s=s: offload.leaf_squares(g, "blocks", w, streamed=s))
            for w, s in ((on_device, False), (on_host, True))]
    for _ in range(20):
        scale = 10 ** rng.uniform(-4, 0)
        g = {"blocks": {"w": rng.standard_normal((8, 64, 256), np.float32) * scale,
                        "v": rng.standard_normal((8, 32, 64), np.float32) * scale},
             "wte": rng.standard_normal((64, 64), np.float32)}
        np.testing.assert_array_equal(*(np.asarray(f(jax.device_put(g, w))) for f, w in zip(sums, (on_device, on_host))))
    assert hlo.collectives(sums[0].lower(jax.device_put(g, on_device)).compile())["all-reduce"].count <= 2


def test_cuda_lowering_moves_each_layers_params_and_each_offloaded_activation_and_the_cpus_moves_none():
    exp = build("gpt2_tiny_dp8", "opt_state,params", **{"model.remat": "offload:qkv,mlp_up"})
    cfg, b = exp.model.cfg, exp.cfg.train.batch_size
    cuda, cpu = placements(exp, "cuda"), placements(exp, "cpu")
    # Each layer's matrices come to the device inside the layer body: one layer's shape,
    # which no other array of the step has.
    others = {tensor_type(a.shape, a.dtype) for k, v in exp.model.shapes.items() if k != exp.model.stacked
              for a in jax.tree.leaves(v)}
    checked = 0
    for leaf in jax.tree.leaves(exp.model.shapes[exp.model.stacked]):
        one_layer = tensor_type(leaf.shape[1:], leaf.dtype)
        if len(leaf.shape) > 2 and one_layer not in others:
            checked += 1
            assert cuda[("device", one_layer)] >= 1 and cpu[("device", one_layer)] == 0, one_layer
            # ...and the update streams them: each layer's slice, updated, goes back to the host
            assert cuda[(HOST, one_layer)] >= 1, one_layer
    assert checked >= 3
    # The two tagged activations go to host memory once per layer body, on CUDA only.
    t, h, e, f = cfg.seq_len, cfg.num_heads, cfg.embed_dim // cfg.num_heads, cfg.mlp_dim
    for shape in ((b, t, 3, h, e), (b, t, f)):
        assert cuda[(HOST, tensor_type(shape, "float32"))] == 1 and cpu[(HOST, tensor_type(shape, "float32"))] == 0
    # The planner's host bytes for them: those two tensors of every layer, each device's
    # share of the batch (8-way data parallelism).
    lowered = sum(np.prod(shape) * 4 / 8 for shape in ((b, t, 3, h, e), (b, t, f)))
    assert analytic.offloaded_activations(exp) == pytest.approx(cfg.num_layers * lowered, rel=1e-12)


def test_a_checkpoint_moves_between_runs_with_and_without_offload(tmp_path):
    plain, offloaded = build("gpt2_tiny_dp8"), build("gpt2_tiny_dp8", "opt_state,params")
    state = offloaded.init_state()
    for saved, into, kind in ((offloaded, plain, "device"), (plain, offloaded, HOST)):
        ckpt = Checkpointer(tmp_path / kind, every=1, keep=0, use_async=False)
        ckpt.save(2, state, {"run": {}})
        ckpt.wait()
        restored, _ = ckpt.restore(2, into)
        ckpt.close()
        assert memory_kinds(restored) == {"params": {kind}, "opt_state": {kind}}
        for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        state = restored


@pytest.mark.parametrize("name,overrides,words", [
    ("gpt2_tiny_dp8", {"train.offload": "optimizer"}, ["unknown 'optimizer'", "opt_state, params"]),
    ("gpt2_tiny_dp8", {"train.offload": "params,params"}, ["a name given twice"]),
    ("gpt2_tiny_pp2_dp4", {"train.offload": "params"}, ["with a pipeline", "train.offload=opt_state"]),
    ("vgg_tiny_digits_dp2", {"train.offload": "params"}, ["no stack of identical layers", "opt_state only"]),
    ("gpt2_tiny_fsdp8", {"train.offload": "params", "train.grad_accum_steps": "2", "train.accum_gather": "once"},
     ["accum_gather=once", "accum_gather=each"]),
    ("gpt2_tiny_dp8", {"model.remat": "offload:qkv,attn"}, ["unknown 'attn'", "qkv, attn_out, mlp_up, mlp_down"]),
    ("gpt2_tiny_dp8", {"model.remat": "offload:"}, ["no name", "offload:qkv,mlp_up"]),
], ids=["unknown", "twice", "pipeline", "no-stack", "gather-once", "unknown-tag", "no-tag"])
def test_what_cannot_offload_is_refused_with_the_fix(name, overrides, words):
    cfg = configured(name, **overrides)
    with pytest.raises(UserError) as e:  # the checks that need no devices (what `meshtrain train` runs first)
        experiment.check_config(cfg, experiment.abstract_mesh(mesh_lib.parse_shape(cfg.mesh.shape)))
    assert all(w in str(e.value) for w in words), str(e.value)


def test_a_backend_without_host_memory_is_refused_naming_what_asked_for_it():
    device = types.SimpleNamespace(platform="tpu", addressable_memories=lambda: [types.SimpleNamespace(kind="device")])
    with pytest.raises(UserError) as e:
        offload.check_devices(offload.Offload(opt_state=True), "offload:qkv", [device])
    assert str(e.value).startswith("train.offload=opt_state and model.remat=offload:qkv need 'pinned_host' memory, "
                                   "and the tpu devices have only device.")
    offload.check_devices(offload.Offload(), "save_dots", [device])  # nothing asked: nothing to check


def test_the_start_up_line_says_what_lives_on_the_host_and_how_it_comes_back():
    both = offload.Offload.of(types.SimpleNamespace(offload="opt_state,params"))
    assert both.describe(True) == (
        "offload: opt_state, params in host memory (pinned_host) between steps; each stacked layer's parameters "
        "come to the device inside the layer scan; the update takes one layer at a time")
    assert offload.Offload(opt_state=True).describe(False) == (
        "offload: opt_state in host memory (pinned_host) between steps; the update fetches the state whole")


def test_the_memory_check_counts_the_offloaded_state_against_the_hosts_ram(capsys):
    """Simulated devices: the step and the offloaded state share the host's RAM; the device
    peak alone fits, with the host share it does not, and no compute lever is offered."""
    memory = {"peak_estimate": 100 * MIB, "host": 60 * MIB}
    budget = memory_budget.Budget(8 * 150 * MIB / 0.9, 8, 0.9, "a test's budget")
    with pytest.raises(UserError) as e:
        memory_check.check(None, memory, print, budget=budget)
    assert str(e.value).startswith("train.offload keeps 60.0 MiB per device in host memory beside the step's "
                                   "100.0 MiB and cannot fit: 8 simulated CPU devices share this host's RAM: 8 x "
                                   "160.0 MiB = 1.25 GiB against 1.30 GiB available (a test's budget)")
    assert memory_check.check(None, {**memory, "host": 40 * MIB}, print, budget=budget)


def test_the_planners_offload_formulas_are_the_compiled_shardings_bytes():
    """What the formulas say moves to the host is what the compiled step takes in host
    memory, and the device's share of the params is the rest plus two layers of the stack,
    each read off the compiled shardings."""
    exp = build("llama_tiny_fsdp8", "opt_state,params")
    compiled = exp.compile(analysis=True)
    state, memory = analytic.state_bytes(exp), metrics_lib.memory_report(compiled)
    # (the optimizer's step counts go to the host too: scalars the formulas leave out)
    counts = sum(a.dtype.itemsize for a in jax.tree.leaves(exp.abstract_state().opt_state) if not a.shape)
    assert state["params"] + state["optimizer"] + counts == pytest.approx(memory["host"], rel=1e-9)
    shardings = compiled.input_shardings[0][0].params
    per_leaf = {k: sum(np.prod(sh.shard_shape(a.shape)) * a.dtype.itemsize
                       for a, sh in zip(jax.tree.leaves(exp.model.shapes[k]), jax.tree.leaves(shardings[k])))
                for k in exp.model.shapes}
    stack = per_leaf.pop(exp.model.stacked)
    shares = analytic.memory(exp)
    assert shares["params"] == pytest.approx(sum(per_leaf.values()) + 2 * stack / exp.model.cfg.num_layers, rel=1e-9)
    account = host_offload.account(exp, state, hardware.get("h100"))
    assert account["host_bytes"] == pytest.approx(state["params"] + state["optimizer"] + state["gradients"]
                                                  * state["stacked"]["gradients"], rel=1e-9)
    assert account["link_s"] == pytest.approx(
        max(account["to_device_bytes"], account["to_host_bytes"]) / (64e9 * 0.8), rel=1e-9)


def test_largest_is_the_deepest_model_that_fits_and_offload_makes_it_deeper():
    """On a made-up device of 8 MiB (8 usable): the answer fits and one more layer does not."""
    hw = dataclasses.replace(hardware.get("h100"), hbm_bytes=8 * MIB / 0.9, usable_memory=0.9)
    cfg = configured("gpt2_tiny_dp8", **{"train.batch_size": "8"})
    fits = {f.offload: f for f in capacity.largest(cfg, hw)}
    assert 0 < fits["none"].layers < fits["opt_state"].layers < fits["opt_state,params"].layers
    for f in fits.values():
        assert capacity.evaluate(cfg, hw, f.layers, f.offload)[0]
        assert not capacity.evaluate(cfg, hw, f.layers + 1, f.offload)[0]
    shown = text.largest("gpt2_tiny_dp8", cfg, hw, list(fits.values()))
    assert f"train.offload=none              {fits['none'].layers} layers" in shown
