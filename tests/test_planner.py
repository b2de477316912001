"""The layout planner: compiled memory, collectives and FLOPs against their formulas, the
roofline's arithmetic, and the CLI. Each config is compiled once per module."""

import dataclasses
import json
import math
import os
import shlex
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from meshtrain import config as config_lib, mesh as mesh_lib
from meshtrain.errors import UserError
from meshtrain.planner import hlo
from meshtrain.planner import hardware, report as report_lib, roofline, split_cost
from meshtrain.run.experiment import Experiment
from support.processes import metric_rows, own_devices_env

CONFIGS = ["gpt2_tiny_dp8", "gpt2_tiny_fsdp8", "gpt2_tiny_dp8_zero1", "gpt2_tiny_dp8_zero2", "gpt2_tiny_dp2_tp4",
           "gpt2_tiny_pp2_dp4", "llama_tiny_dp2_tp4", "llama_tiny_fsdp8"]
KEYS = ("memory_per_device_bytes", "analytic_memory_per_device_bytes", "collectives",
        "collective_bytes_per_step", "collective_lower_bound_bytes", "flops_per_step",
        "model_flops_per_step", "predicted_step_time_s", "predicted_mfu")
H100 = hardware.get("h100")


@pytest.fixture(scope="module")
def planned():
    out = {}
    for name in CONFIGS:
        exp = Experiment.build(config_lib.load(name))
        compiled = exp.compile(analysis=True)  # as `meshtrain plan` compiles it
        out[name] = (exp, compiled, report_lib.plan(exp, H100, compiled, 0.0))
    return out


@pytest.mark.parametrize("name", CONFIGS)
def test_report_has_the_documented_keys(name, planned):
    r = planned[name][2]
    assert all(k in r for k in KEYS)
    for key in ("memory_per_device_bytes", "analytic_memory_per_device_bytes"):
        assert {"params", "optimizer", "gradients", "activations"} <= set(r[key])
    for row in r["collectives"]:
        assert {"kind", "mesh_axes", "count", "bytes"} <= set(row)
    assert 0 < r["predicted_mfu"] < 1 and r["predicted_step_time_s"] > 0


def test_every_split_cost_has_a_report_section(planned):
    """bounds.SPLIT_COSTS: each entry is a split_cost.SplitCost whose traffic takes the
    experiment, and whose figures, where it has them, the experiment, its traffic and the
    compiled step; its key is a section of the plan report."""
    import inspect

    from meshtrain.planner.bounds import SPLIT_COSTS
    for name, cost in SPLIT_COSTS.items():
        assert all(name in r for _, _, r in planned.values()), f"{name}: no such section in the plan report"
        assert isinstance(cost, split_cost.SplitCost) and list(inspect.signature(cost.traffic).parameters) == ["exp"]
        if cost.figures is not None:
            assert list(inspect.signature(cost.figures).parameters) == ["exp", "traffic", "compiled"], name


@pytest.mark.parametrize("name", CONFIGS)
def test_state_memory_equals_the_formula_and_xla_totals(name, planned):
    """Params and Adam moments from the compiled shardings equal the ZeRO-style sums, and
    with the batch and the scalars they make up XLA's argument bytes exactly."""
    exp, compiled, r = planned[name]
    mem, formula = r["memory_per_device_bytes"], r["analytic_memory_per_device_bytes"]
    assert mem["params"] == pytest.approx(formula["params"], rel=1e-9)
    assert mem["optimizer"] == pytest.approx(formula["optimizer"], rel=1e-9)
    state = exp.abstract_state()
    scalars = sum(4 for leaf in jax.tree.leaves(state) if leaf.shape == ()) + state.rng.size * 4
    batch = math.prod(exp.batch_shape) * 4 / split_cost.split_over(exp.layout, exp.mesh.shape, "batch")[0]
    assert mem["params"] + mem["optimizer"] + scalars + batch == compiled.memory_analysis().argument_size_in_bytes


def test_zero_formulas_on_a_data_mesh(planned):
    """Params, fp32 gradients and Adam moments: dp 4+4+8 Psi, zero1 4 + 4 + 8/n Psi,
    zero2 4 + 4/n + 8/n Psi, fsdp (4 + 4 + 8)/n Psi: ZeRO's stages 0 to 3."""
    psi = planned["gpt2_tiny_dp8"][0].num_stored_params()
    dp, zero1, zero2, fsdp = (planned[n][2]["analytic_memory_per_device_bytes"] for n in
                              ("gpt2_tiny_dp8", "gpt2_tiny_dp8_zero1", "gpt2_tiny_dp8_zero2", "gpt2_tiny_fsdp8"))
    assert (dp["params"], dp["gradients"], dp["optimizer"]) == (4 * psi, 4 * psi, 8 * psi)
    assert (zero1["params"], zero1["gradients"], zero1["optimizer"]) == (4 * psi, 4 * psi, 8 * psi / 8)
    assert (zero2["params"], zero2["gradients"], zero2["optimizer"]) == (4 * psi, 4 * psi / 8, 8 * psi / 8)
    assert (fsdp["params"], fsdp["gradients"], fsdp["optimizer"]) == (4 * psi / 8, 4 * psi / 8, 8 * psi / 8)


def test_zero2_sends_what_zero1_sends(planned):
    """ZeRO-2 moves zero1's reduce-scatter into the backward pass, not its bytes: the same
    bound, and the compiled step sends the same over data."""
    z1, z2 = (planned[n][2] for n in ("gpt2_tiny_dp8_zero1", "gpt2_tiny_dp8_zero2"))
    bound = {(b["kind"], tuple(b["mesh_axes"])): b["bytes"] for b in z1["collective_bounds"]}
    assert {(b["kind"], tuple(b["mesh_axes"])): b["bytes"] for b in z2["collective_bounds"]} == bound
    assert _axis(z2, ("data",))["bytes"] == pytest.approx(_axis(z1, ("data",))["bytes"], rel=0.01)


def _axis(r, axes):
    return next(a for a in r["collectives_by_axes"] if tuple(a["mesh_axes"]) == axes)


def test_tensor_parallel_sends_megatrons_all_reduces(planned):
    """dp2 x tp4: over tensor, 4 all-reduces of [b, T, D] per layer plus the vocab-parallel
    embedding's 2, and a few scalars per row for the loss; bytes equal the bound."""
    exp, _, r = planned["gpt2_tiny_dp2_tp4"]
    cfg = exp.model.cfg
    tensor = _axis(r, ("tensor",))
    assert tensor["lower_bound_count"] == 4 * cfg.num_layers + 2
    assert tensor["bytes"] == pytest.approx(tensor["lower_bound_bytes"], rel=0.02)
    assert not tensor["excess"]


@pytest.mark.parametrize("name", ["gpt2_tiny_dp8", "gpt2_tiny_dp2_tp4", "llama_tiny_dp2_tp4"])
def test_data_parallel_reduction_equals_the_bound(name, planned):
    """Each gradient reduced once over data: the tied table's two pieces (lookup and output
    projection) count once, as XLA's GPU pipeline reassociates them."""
    data = _axis(planned[name][2], ("data",))
    assert data["bytes"] == pytest.approx(data["lower_bound_bytes"], rel=0.01)
    assert not data["excess"]


def test_every_excess_over_the_bound_has_a_reason(planned):
    for name in CONFIGS:
        for a in planned[name][2]["collectives_by_axes"]:
            if a["lower_bound_bytes"] and a["bytes"] > 1.02 * a["lower_bound_bytes"]:
                assert a["excess"], (name, a)


def test_pipeline_bound_counts_each_microbatch_over_the_boundary(planned):
    exp, _, r = planned["gpt2_tiny_pp2_dp4"]
    pipe = exp.model.pipeline
    bound = next(b for b in r["collective_bounds"] if b["kind"] == "collective-permute")
    assert bound["count"] == 2 * pipe.microbatches
    sent = sum(c["bytes"] for c in r["collectives"] if c["kind"] == "collective-permute")
    assert sent >= bound["bytes"]


def test_pipeline_bound_gathers_the_stage_split_tables_once_per_step(planned):
    """wte and wpe, stored split over stage, are gathered once per step (not once per
    pipeline microbatch): (S-1)/S of each, in the compute dtype; the program sends at least that."""
    exp, _, r = planned["gpt2_tiny_pp2_dp4"]
    s, c = exp.mesh.shape["stage"], exp.model.cfg
    tables = (c.padded_vocab_size + c.seq_len) * c.embed_dim * np.dtype(c.dtype).itemsize
    bound = [b for b in r["collective_bounds"] if b["kind"] == "all-gather" and tuple(b["mesh_axes"]) == ("stage",)]
    assert sum(b["bytes"] for b in bound) == pytest.approx((s - 1) / s * tables)
    sent = sum(x["bytes"] for x in r["collectives"] if x["kind"] == "all-gather" and tuple(x["mesh_axes"]) == ("stage",))
    assert sent >= sum(b["bytes"] for b in bound)


def test_compiled_matmul_flops_match_the_formula(planned):
    """GPT-2's matmuls: 6 x (block matrices + the tied output table) per token, plus the
    attention scores and values over the full T x T square, 12 L D T per token."""
    exp, _, r = planned["gpt2_tiny_dp8"]
    c = exp.model.cfg
    tokens = exp.cfg.train.batch_size * c.seq_len
    matmul_params = c.num_layers * (4 * c.embed_dim**2 + 2 * c.embed_dim * c.mlp_dim) + c.padded_vocab_size * c.embed_dim
    expected = (6 * matmul_params + 12 * c.num_layers * c.embed_dim * c.seq_len) * tokens
    assert r["flops_per_step"] == pytest.approx(expected, rel=1e-6)


def test_roofline_terms_add_up(planned):
    p = planned["gpt2_tiny_dp2_tp4"][2]["prediction"]
    busy = p["matmul_s"] + p["attention_s"] + p["memory_s"]
    assert p["idle_s"] == pytest.approx(busy * hardware.get("h100").idle_share)
    assert p["step_time_s"] == pytest.approx(
        max(busy, p["overlapped_collectives_s"]) + p["idle_s"] + p["exposed_collectives_s"])
    assert p["exposed_collectives_s"] > 0  # tensor all-reduces


def test_predict_with_the_step_work_by_hand():
    """The calibrated terms (planner/work.py): a flash kernel's attention leaves the matmul
    term and runs its causal half at attention_efficiency; the memory term reads the
    optimizer state, the loss's and the layers' bytes at elementwise_efficiency; idle is a
    share of the busy time."""
    hw = hardware.Hardware("toy", {"bfloat16": 100e12}, 10e9, 1e12, 4, 100e9, 10e9, matmul_efficiency=0.5,
                           attention_efficiency={64: 0.25, 128: 0.5}, elementwise_efficiency=0.5, idle_share=0.1)
    memory = {"params": 1e9, "optimizer": 2e9, "gradients": 1e9, "activations": 1e9}
    work = {"attention_flops": 20e12, "attention_kernel": "cudnn", "head_dim": 96, "loss_bytes": 1e9,
            "layer_bytes": 3e9}
    p = roofline.predict(hw, "bfloat16", 100e12, memory, [], 200e12, 4, work)
    assert p["matmul_s"] == pytest.approx(80e12 / 50e12)          # 100 - 20 TF at half the peak
    assert p["attention_s"] == pytest.approx(10e12 / 25e12)       # half of 20 TF at width 64's 0.25
    assert p["memory_s"] == pytest.approx((2 + 4 + 1 + 1 + 3) / 0.5e3)  # 11 GB at half of 1 TB/s
    assert p["idle_s"] == pytest.approx(0.1 * (1.6 + 0.4 + 0.022))
    assert p["step_time_s"] == pytest.approx(1.1 * (1.6 + 0.4 + 0.022))
    xla = roofline.predict(hw, "bfloat16", 100e12, memory, [], 200e12, 4, {**work, "attention_kernel": "xla"})
    assert (xla["matmul_s"], xla["attention_s"]) == (pytest.approx(2.0), 0.0)  # XLA's attention is matmuls


def test_predict_by_hand():
    hw = hardware.Hardware("toy", {"bfloat16": 100e12}, 10e9, 1e12, 4, 100e9, 10e9, link_latency_s=0.0,
                           network_latency_s=0.0, matmul_efficiency=0.5, link_efficiency=1.0)
    memory = {"params": 1e9, "optimizer": 2e9, "gradients": 1e9, "activations": 1e9}
    rows = [{"kind": "all-reduce", "mesh_axes": ("tensor",), "count": 1, "bytes": 1e9, "crosses_nodes": False},
            {"kind": "all-reduce", "mesh_axes": ("data",), "count": 1, "bytes": 1e9, "crosses_nodes": True}]
    p = roofline.predict(hw, "bfloat16", 100e12, memory, rows, 200e12, 4)
    assert p["matmul_s"] == pytest.approx(2.0)                 # 100 TF / (100 TF/s x 0.5)
    assert p["memory_s"] == pytest.approx((2 + 4 + 1 + 3) / 1e3)  # 10 GB / 1 TB/s
    assert p["exposed_collectives_s"] == pytest.approx(0.01)   # 1 GB over 100 GB/s links
    assert p["overlapped_collectives_s"] == pytest.approx(0.1)  # 1 GB over 10 GB/s network
    assert p["step_time_s"] == pytest.approx(2.01 + 0.01)
    assert p["mfu"] == pytest.approx(200e12 / (4 * 100e12 * 2.02))


def test_nodes_follow_dcn_or_the_device_order():
    devices = np.array(jax.devices()[:8]).reshape(2, 1, 1, 4)
    mesh = jax.sharding.Mesh(devices, ("data", "stage", "fsdp", "tensor"))
    in_order = roofline.node_of_position(mesh, 4, None)
    assert not roofline.placement(mesh, ("tensor",), in_order)["crosses_nodes"]
    assert roofline.placement(mesh, ("data",), in_order)["crosses_nodes"]
    dcn = {"data": 1, "stage": 1, "fsdp": 1, "context": 1, "expert": 1, "tensor": 2}  # as make_mesh lays it out for mesh.dcn
    hybrid = mesh_lib.make_mesh({"data": 2, "stage": 1, "fsdp": 1, "context": 1, "expert": 1, "tensor": 4}, jax.devices()[:8], dcn=dcn)
    across = roofline.node_of_position(hybrid, 4, dcn)
    assert roofline.placement(hybrid, ("tensor",), across)["crosses_nodes"]
    assert not roofline.placement(hybrid, ("data",), across)["crosses_nodes"]


def test_cpu_widened_bf16_reductions_count_at_16_bits():
    """The CPU compiler all-reduces bf16 in float32; the table counts what an accelerator sends."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))
    x = jax.ShapeDtypeStruct((4, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P("data")))
    f = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, "data"), mesh=mesh, in_specs=P("data"),
                              out_specs=P(), check_vma=False))
    compiled = f.lower(x).compile()
    assert "_promoted" in compiled.as_text()  # what the CPU compiler does today
    [row] = hlo.collective_table(compiled, mesh)
    assert (row["kind"], row["mesh_axes"], row["result_bytes"]) == ("all-reduce", ("data",), 1024 * 2)
    assert row["bytes"] == pytest.approx(2 * 3 / 4 * 1024 * 2)  # ring: 2 (n-1)/n x S


def _one_op_table(fn, *dtypes):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))
    args = [jax.ShapeDtypeStruct((4, 1024), dt, sharding=NamedSharding(mesh, P("data"))) for dt in dtypes]
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P("data"),) * len(args), out_specs=P(), check_vma=False))
    return hlo.collective_table(f.lower(*args).compile(), mesh)


def test_cpu_widened_bf16_gathers_count_at_16_bits():
    [bf16] = _one_op_table(lambda a: jax.lax.all_gather(a, "data", tiled=True), jnp.bfloat16)
    [f32] = _one_op_table(lambda a: jax.lax.all_gather(a, "data", tiled=True), jnp.float32)
    assert (bf16["kind"], bf16["result_bytes"], f32["result_bytes"]) == ("all-gather", 4 * 1024 * 2, 4 * 1024 * 4)


def test_pieces_only_added_together_reduce_once():
    """psum(a) + psum(b) is one all-reduce of a + b on a GPU (XLA's AllReduceReassociate)."""
    [summed] = _one_op_table(lambda a, b: jax.lax.psum(a, "data") + jax.lax.psum(b, "data"),
                             jnp.float32, jnp.float32)
    assert summed["result_bytes"] == 1024 * 4
    [apart] = _one_op_table(lambda a, b: (jax.lax.psum(a, "data"), 2 * jax.lax.psum(b, "data")),
                            jnp.float32, jnp.float32)
    assert apart["result_bytes"] == 2 * 1024 * 4


def test_hardware_table_and_files(tmp_path):
    assert hardware.get("h100").peak("bfloat16") == 989e12
    spec = tmp_path / "mine.json"
    spec.write_text(json.dumps({"peak_flops": {"bfloat16": 1e15}, "hbm_bytes": 1e11, "hbm_bandwidth": 5e12,
                                "devices_per_node": 4, "link_bandwidth": 9e11, "network_bandwidth": 1e11}))
    assert hardware.get(str(spec)).name == "mine"
    with pytest.raises(UserError, match="h100"):
        hardware.get("h1000")
    spec.write_text(json.dumps({"peak_flops": 1}))
    with pytest.raises(UserError, match="fields"):
        hardware.get(str(spec))


def _plan_cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "meshtrain.plan", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_cli_json_for_a_llama_config():
    out = _plan_cli("--config=llama_tiny_dp2_tp4", "--hardware=a100", "--json")
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert all(k in r for k in KEYS) and r["devices"] == 8 and "a100" in r["hardware"]


@pytest.mark.parametrize("args, says", [
    (["--config=gpt2_tiny_dp8", "--hardware=tpu9"], "--hardware='tpu9' is not known"),
    (["--config=gpt2_tiny_dp8", "--config.train.batch_size=12"], "batch_size"),
    (["--config=gpt2_tiny_dp8", "--devices=8"], "go with --search"),
    (["--config=gpt2_tiny_dp8", "--search"], "--search needs --devices"),
    (["--config=gpt2_tiny_dp8", "--search", "--devices=8", "--layouts=dp,zero9"], "zero9"),
    (["--config=gpt2_tiny_dp8", "--search", "--devices=0"], "Argument --devices: give a whole number >= 1, not '0'"),
])
def test_cli_refuses_bad_input_in_one_paragraph(args, says, capsys, monkeypatch):
    """In-process: each is refused before any device is simulated. The planner's compile
    flags go into XLA_FLAGS, which later tests' subprocesses would inherit: restored after."""
    from meshtrain import plan
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    assert plan.main(args) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err
    assert err.startswith("meshtrain plan: error:") and err.count("\n") == 1


def test_the_report_says_which_memory_figure_decides_and_lints_once():
    """fsdp on one device: the linter's zero-saves-nothing once (the plan lints before and after
    building; the second run repeats the first's checks). The fit is the formula total's, on
    the named hardware, and the CPU compile's figure is set apart with the formulas' account
    (float32 here, on a kernel the CPU runs too: no step of the account changes the figure)."""
    run = _plan_cli("--config=gpt2_tiny_fsdp8", "--config.mesh.shape=fsdp:1", "--hardware=a100_40gb")
    assert run.returncode == 0, run.stderr
    out = run.stdout + run.stderr
    assert out.count("shards weights, gradients or optimizer moments over fsdp") == 1
    assert "fits on a100_40gb: decided by the formula total" in out
    assert "the CPU compile's total" in out and "does not decide" in out
    assert "activations, " in out and "MiB with the attention kernel a100_40gb takes" in out
    assert "the rest is the CPU backend's buffer assignment" in out


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    """One search on 4 devices, run twice (the second from the cache): dp on data:4, fsdp on
    fsdp:4 and on data:2,fsdp:2, dp_tp on data:2,tensor:2, each with two remat policies;
    --margin=0 compiles the formulas' best, the config's own layout's (dp) best, and the
    formula rows that reach the best three. On h100 without per-op latencies: at this size
    latency is all, and the formulas' bounds count no gradient-reduction ops."""
    cache = tmp_path_factory.mktemp("plan_cache")
    hw = cache / "h100_no_latency.json"
    hw.write_text(json.dumps({**dataclasses.asdict(H100), "name": "h100_no_latency", "link_latency_s": 0.0,
                              "network_latency_s": 0.0}))
    args = ["--config=gpt2_tiny_dp8", "--search", "--devices=4", "--layouts=dp,fsdp,dp_tp",
            "--remat=none,full", "--margin=0", f"--hardware={hw}", f"--cache_dir={cache}", "--json"]
    first = _plan_cli(*args)
    assert first.returncode == 0, first.stderr
    again = _plan_cli(*args)
    assert again.returncode == 0, again.stderr
    return json.loads(first.stdout), json.loads(again.stdout)


def test_search_compiles_only_what_can_win_and_caches_it(searched):
    r, again = searched
    assert (r["candidates"], r["feasible"]) == (8, 8)
    assert 3 <= r["compiled"] <= 4 < r["feasible"]
    rows = r["ranked"]
    times = [row["predicted_step_time_s"] for row in rows]
    assert times == sorted(times) and all(row["why"] for row in rows) and len(rows) == 8
    assert sum(row["by"] == "compiled" for row in rows) == r["compiled"]
    assert [row["by"] for row in rows[:3]] == ["compiled"] * 3 and r["winner"]["by"] == "compiled"
    assert {row["by"] for row in rows} == {"compiled", "formulas"}
    assert not any(row["cached"] for row in rows)
    assert all(row["cached"] for row in again["ranked"] if row["by"] == "compiled")
    assert [row["candidate"] for row in again["ranked"]] == [row["candidate"] for row in rows]
    own = r["own_layout"]
    assert own["layout"] == "dp" and own["exact"] is None  # its mesh, data:8, is not a 4-device one
    assert own["best"]["candidate"].split()[1] == "dp" and own["best"]["by"] == "compiled"


def test_the_winners_command_parses_builds_and_trains(searched, tmp_path):
    """The printed overrides are config overrides that build; run as printed, they train."""
    winner = searched[0]["winner"]
    argv = shlex.split(winner["command"])
    assert argv[:3] == ["meshtrain", "train", "--config=gpt2_tiny_dp8"]
    pairs = [a.removeprefix("--config.").split("=", 1) for a in argv[3:]]
    assert pairs == winner["overrides"] and {k for k, _ in pairs} >= {"mesh.shape"}
    cfg = config_lib.load("gpt2_tiny_dp8")
    for key, value in pairs:
        config_lib.override(cfg, key, value)
    shape = mesh_lib.parse_shape(cfg.mesh.shape)
    exp = Experiment.build(cfg, devices=jax.devices()[:math.prod(shape.values())])
    assert dict(exp.mesh.shape) == dict(searched[0]["ranked"][0]["mesh"])
    assert exp.layout.name == searched[0]["ranked"][0]["layout"]
    run = subprocess.run([sys.executable, "-m", "meshtrain", *argv[1:], "--config.train.steps=2",
                          "--config.train.log_every=1", f"--workdir={tmp_path}"],
                         capture_output=True, text=True, env=own_devices_env(), timeout=600)
    assert run.returncode == 0, run.stderr
    rows = metric_rows(tmp_path)
    assert [row["step"] for row in rows if "loss" in row] == [1, 2]


def test_search_enumerates_expert_only_for_a_model_with_experts(monkeypatch):
    """expert > 1 only when model.num_experts > 1; a preset on data+expert (set here as
    parallel/layouts/presets.py's MoE presets would have it) is tried on every such mesh."""
    from meshtrain.parallel.layouts import presets
    from meshtrain.planner import search
    monkeypatch.setitem(presets.PRESET_AXES, "dp_ep", ({"expert"}, {"data", "expert"}))
    dense, _ = search.enumerate_candidates(8, 4, None, ("dp", "dp_ep"), remats=("none",))
    moe, _ = search.enumerate_candidates(8, 4, None, ("dp", "dp_ep"), remats=("none",), num_experts=8)
    one, _ = search.enumerate_candidates(8, 4, None, ("dp", "dp_ep"), remats=("none",), num_experts=1)
    meshes = lambda cands, layout: {tuple((a, n) for a, n in c.mesh if n > 1) for c in cands  # noqa: E731
                                    if c.layout == layout}
    assert meshes(dense, "dp_ep") == meshes(one, "dp_ep") == set()
    assert meshes(moe, "dp_ep") == {(("expert", 8),), (("data", 2), ("expert", 4)), (("data", 4), ("expert", 2))}
    assert meshes(moe, "dp") == meshes(dense, "dp") == {(("data", 8),)}


def test_search_enumerates_zero2_beside_zero1():
    """The search takes its presets from PRESET_AXES: zero2 wherever zero1 goes."""
    from meshtrain.planner import search
    cands, _ = search.enumerate_candidates(8, 4, None, remats=("none",))
    got = {(c.layout, tuple((a, n) for a, n in c.mesh if n > 1)) for c in cands}
    for mesh in ((("data", 8),), (("data", 4), ("stage", 2))):
        zero1 = {lay for lay, m in got if m == mesh and lay.startswith("zero1")}
        assert zero1 and {lay.replace("zero1", "zero2") for lay in zero1} <= {lay for lay, m in got if m == mesh}
