"""How a process finds its place: flags, variables and SLURM shapes (multi-node shapes come
as environment dicts, since one machine runs one slurmd), and the hybrid DCN x ICI mesh."""

import dataclasses
import re

import jax
import numpy as np
import pytest

from meshtrain import mesh
from meshtrain.planner import hlo
from meshtrain.cluster import launch
from meshtrain.errors import UserError


def slurm_env(tasks, nodes, per_node, rank, local, node_id, **extra):
    return {"SLURM_JOB_ID": "4099", "SLURM_STEP_ID": "0", "SLURM_NTASKS": str(tasks),
            "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_STEP_NUM_NODES": str(nodes),
            "SLURM_STEP_NODELIST": f"gpu[01-{nodes:02d}]", "SLURM_STEP_TASKS_PER_NODE": per_node,
            "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(local), "SLURM_NODEID": str(node_id),
            "SLURMD_NODENAME": f"gpu{node_id + 1:02d}", **extra}


def test_tasks_per_node_expand():
    assert launch.expand_tasks_per_node("4(x2),3") == [4, 4, 3]


def test_one_process_without_any_launcher():
    got = launch.detect({}, {})
    assert got.method == "single" and not got.multiprocess


def test_flags_win_over_variables():
    env = {"JAX_COORDINATOR_ADDRESS": "x:1", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}
    got = launch.detect({"coordinator": "node7:6000", "num_processes": "2", "process_id": "1"}, env)
    assert (got.method, got.num_processes, got.process_id, got.coordinator) == ("flags", 2, 1, "node7:6000")
    got = launch.detect({}, env)
    assert (got.method, got.num_processes, got.process_id) == ("environment", 4, 3)


@pytest.mark.parametrize("flags, message", [
    ({"num_processes": "2"}, "the flags lack --coordinator, --process_id"),
    ({"coordinator": "h:1", "num_processes": "2", "process_id": "2"}, "--process_id=2 with --num_processes=2: the id must be in 0..1"),
    ({"coordinator": "h", "num_processes": "2", "process_id": "0"}, "'h' is not HOST:PORT"),
    ({"coordinator": "h:1", "num_processes": "two", "process_id": "0"}, "--num_processes must be an integer, got 'two'"),
])
def test_bad_flags(flags, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(")):
        launch.detect(flags, {})


@pytest.mark.parametrize("key, value, message", [
    ("SLURM_PROCID", "one", "SLURM_PROCID must be an integer, got 'one'"),
    ("SLURM_LOCALID", "9" * 5000, "SLURM_LOCALID must be an integer, got '" + "9" * 39 + "..."),
    ("JAX_LOCAL_DEVICE_IDS", "0,x", "JAX_LOCAL_DEVICE_IDS must be an integer, got 'x'"),
    ("SLURM_STEP_TASKS_PER_NODE", "2(x", "Cannot read SLURM_STEP_TASKS_PER_NODE='2(x'"),
])
def test_slurm_variables_are_read_defensively(key, value, message):
    with pytest.raises(UserError, match=re.escape(message)):
        launch.detect({}, {**slurm_env(4, 2, "2(x2)", 1, 1, 0, CUDA_VISIBLE_DEVICES="0,1"), key: value})


def test_python_in_the_batch_shell_of_a_multi_task_job_is_told_to_use_srun():
    batch_shell = {"SLURM_JOB_ID": "77", "SLURM_NTASKS": "8", "SLURM_JOB_NUM_NODES": "2",
                   "SLURM_JOB_NODELIST": "gpu[1-2]", "SLURM_PROCID": "0"}
    with pytest.raises(UserError, match=r"job 77 with 8 task\(s\) on 2 node\(s\).*outside srun.*srun python -m meshtrain.train"):
        launch.detect({}, batch_shell)
    # One task on one node (an interactive salloc, say) is a plain one-process run.
    one = {**batch_shell, "SLURM_NTASKS": "1", "SLURM_JOB_NUM_NODES": "1"}
    assert launch.detect({}, one).method == "single"


def test_slurm_one_process_per_node_drives_every_gpu():
    env = slurm_env(2, 2, "1(x2)", 1, 0, 1, CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7")
    got = launch.detect({}, env)
    assert (got.method, got.num_processes, got.process_id) == ("slurm", 2, 1)
    assert got.local_device_ids == tuple(range(8))  # all it sees (JAX's own detection would give [0])
    assert got.coordinator is None  # JAX's Slurm detection finds it: gpu01, port 61440 + 4099 % 4096
    assert "task 1 of 2 on 2 node(s), 1 on this node (gpu02)" in got.where


def test_slurm_one_process_per_gpu_takes_its_own_gpu():
    env = slurm_env(16, 2, "8(x2)", 13, 5, 1, CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7")
    assert launch.detect({}, env).local_device_ids == (5,)


def test_slurm_two_tasks_split_a_nodes_gpus_in_halves():
    env = slurm_env(4, 2, "2(x2)", 3, 1, 1, CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7")
    assert launch.detect({}, env).local_device_ids == (4, 5, 6, 7)


def test_slurm_gpus_bound_per_task_are_used_as_they_are():
    bound = slurm_env(16, 2, "8(x2)", 3, 3, 0, CUDA_VISIBLE_DEVICES="0")
    assert launch.detect({}, bound).local_device_ids == (0,)
    per_task = slurm_env(4, 2, "2(x2)", 1, 1, 0, CUDA_VISIBLE_DEVICES="0,1,2,3",
                         SLURM_GPUS_PER_TASK="4")
    assert launch.detect({}, per_task).local_device_ids == (0, 1, 2, 3)


def test_slurm_gpus_that_do_not_split_are_an_error_with_the_fix():
    env = slurm_env(6, 2, "3(x2)", 0, 0, 0, CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7")
    with pytest.raises(UserError, match=r"3 SLURM tasks on this node share 8 visible GPUs.*--ntasks-per-node=1"):
        launch.detect({}, env)


def test_slurm_on_cpu_nodes_and_a_bad_port_override():
    env = slurm_env(2, 1, "2", 1, 1, 0, JAX_COORDINATOR_PORT="7000")
    got = launch.detect({}, env)
    assert got.local_device_ids is None and got.coordinator is None
    with pytest.raises(UserError, match=r"JAX_COORDINATOR_PORT='70x0' is not a port number \(1-65535\)"):
        launch.detect({}, {**env, "JAX_COORDINATOR_PORT": "70x0"})


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    id: int
    process_index: int


def test_hybrid_grid_keeps_ici_inside_a_node_and_puts_dcn_outermost():
    # Two hosts, one process per GPU: 8 processes of 2 devices each.
    devices = [FakeDevice(i, i // 2) for i in range(16)]
    hosts = ["a"] * 4 + ["b"] * 4
    shape = mesh.parse_shape("data:4,tensor:4")
    grid, how = mesh.hybrid_grid(shape, mesh.parse_dcn("data:2", shape), devices, hosts)
    assert how == "2 hosts" and grid.shape == (4, 1, 1, 1, 1, 4)
    node = np.vectorize(lambda d: hosts[d.process_index])(grid)[:, 0, 0, 0, 0, :]
    assert (node[:2] == "a").all() and (node[2:] == "b").all()  # data = node x 2 rows per node
    assert len({d.id for d in grid.flat}) == 16


def test_hybrid_grid_keeps_context_inside_a_node():
    """data over 2 nodes, context:4 and tensor:2 inside each: every context ring (fixed
    data and tensor) stays on one host; context across nodes is warned about."""
    devices = [FakeDevice(i, i // 8) for i in range(16)]
    hosts = ["a", "b"]
    shape = mesh.parse_shape("data:2,context:4,tensor:2")
    grid, _ = mesh.hybrid_grid(shape, mesh.parse_dcn("data:2", shape), devices, hosts)
    node = np.vectorize(lambda d: hosts[d.process_index])(grid)[:, 0, 0]  # [data, context, expert, tensor]
    assert (node[0] == "a").all() and (node[1] == "b").all()
    assert "context axis across 2 nodes" in mesh.dcn_warnings(mesh.parse_dcn("context:2", shape))[0]


def test_hybrid_grid_keeps_expert_groups_inside_a_node_unless_dcn_splits_them():
    """data over 2 nodes, expert:4 and tensor:2 inside each: every expert group (the devices
    along expert at fixed data and tensor, one MoE all-to-all) stays on one host. With
    mesh.dcn=expert:2 each group spans both hosts, half its experts on each, and that is
    warned about."""
    devices = [FakeDevice(i, i // 8) for i in range(16)]
    hosts = ["a", "b"]
    shape = mesh.parse_shape("data:2,expert:4,tensor:2")
    grid, _ = mesh.hybrid_grid(shape, mesh.parse_dcn("data:2", shape), devices, hosts)
    assert grid.shape == (2, 1, 1, 1, 4, 2)
    node = np.vectorize(lambda d: hosts[d.process_index])(grid)[:, 0, 0, 0]  # [data, expert, tensor]
    assert (node[0] == "a").all() and (node[1] == "b").all()
    assert mesh.dcn_warnings(mesh.parse_dcn("data:2", shape)) == []

    shape = mesh.parse_shape("expert:8,tensor:2")
    dcn = mesh.parse_dcn("expert:2", shape)
    grid, _ = mesh.hybrid_grid(shape, dcn, devices, hosts)
    node = np.vectorize(lambda d: hosts[d.process_index])(grid)[0, 0, 0, 0]  # [expert, tensor]
    assert (node[:4] == "a").all() and (node[4:] == "b").all()  # expert = node x 4 per node
    assert len({d.id for d in grid.flat}) == 16
    (warning,) = mesh.dcn_warnings(dcn)
    assert warning == (
        "mesh.dcn puts the expert axis across 2 nodes: every MoE layer's dispatch and combine "
        "all-to-alls send each token's embedding to its experts and back, forward and backward, "
        "so they would cross nodes. Keep expert inside a node and put data (or fsdp) on DCN.")


def test_processes_stand_in_for_nodes_on_one_host_and_one_process_simulates_them():
    shape = mesh.parse_shape("data:2,tensor:4")
    dcn = mesh.parse_dcn("data:2", shape)
    two = [FakeDevice(i, i // 4) for i in range(8)]
    assert mesh.granules(two, 2, ["vm", "vm"]) == ([0] * 4 + [1] * 4, "2 processes on 1 host(s), each standing in for a node")
    m = mesh.make_mesh(shape, jax.devices(), dcn=dcn, hosts=["vm"])
    assert [d.id for d in m.devices[0].flat] == [0, 1, 2, 3]


@pytest.mark.parametrize("shape, dcn, hosts, message", [
    ("data:2,tensor:4", "data:3", ["a"], "puts 3 nodes on axis 'data', but the mesh gives that axis 2 devices"),
    ("data:2,tensor:4", "data:-1", ["a"], "cannot be -1"),
    ("data:4,tensor:2", "data:4", ["a", "b"], "spans 4 nodes .* but this run has 2 process\\(es\\) on 2 host\\(s\\)"),
])
def test_dcn_that_does_not_fit_shows_the_arithmetic(shape, dcn, hosts, message):
    shape = mesh.parse_shape(shape)
    with pytest.raises(UserError, match=message):
        devices = [FakeDevice(i, i * len(hosts) // 8) for i in range(8)]
        mesh.hybrid_grid(shape, mesh.parse_dcn(dcn, shape), devices, hosts)


def test_uneven_nodes_are_refused_with_the_ici_arithmetic():
    shape = mesh.parse_shape("data:2,tensor:4")
    devices = [FakeDevice(i, 0 if i < 6 else 1) for i in range(8)]
    with pytest.raises(UserError, match=r"mesh.dcn=data:2 needs 4 devices in each of 2 nodes \(ICI tensor:4: 1 x 1 x 1 x 1 x 1 x 4 = 4\), but the nodes \(2 hosts\) have 2 or 6"):
        mesh.hybrid_grid(shape, mesh.parse_dcn("data:2", shape), devices, ["a", "b"])


def test_tensor_across_nodes_is_warned_about_and_trivial_dcn_is_none():
    shape = mesh.parse_shape("data:2,tensor:4")
    assert "tensor axis across 2 nodes" in mesh.dcn_warnings(mesh.parse_dcn("tensor:2", shape))[0]
    assert mesh.dcn_warnings(mesh.parse_dcn("data:2", shape)) == []
    assert mesh.parse_dcn("data:1", shape) is None and mesh.parse_dcn("", shape) is None


@pytest.mark.parametrize("attrs, groups", [
    ("replica_groups={{0,4},{1,5}}", [[0, 4], [1, 5]]),
    ("replica_groups=[2,4]<=[8]", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("replica_groups=[4,2]<=[2,4]T(1,0)", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_0'}",
     [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=2]", [[0, 1, 2, 3]]),
    ("source_target_pairs={{0,1},{1,0}}", [[0, 1], [1, 0]]),
])
def test_replica_groups_in_every_hlo_spelling(attrs, groups):
    assert hlo.replica_groups(attrs, 4) == groups
