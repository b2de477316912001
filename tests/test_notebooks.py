"""The notebooks run top to bottom and draw their figures; meshtrain.pictures draws
what its docstrings say.

Each notebook is executed by nbclient in an IPython kernel started from this interpreter
(a kernelspec written to a temporary JUPYTER_PATH, so no installed kernelspec is needed),
with notebooks/ as the working directory. The stored notebooks carry no outputs.
"""

import os
import sys

import jax
import matplotlib
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from meshtrain import config as config_lib, mesh as mesh_lib
from meshtrain import pictures
from meshtrain.pictures import spatial as spatial_pictures
from meshtrain.run.experiment import Experiment
from support import notebooks
from support.notebooks import NOTEBOOKS, code_cells

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

NAMES = ["layouts.ipynb", "scaling.ipynb"]


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


# --- the stored notebooks ------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_stored_notebook_is_clear_and_starts_with_the_colab_cell(name):
    import nbformat

    path = NOTEBOOKS / name
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert path.stat().st_size < 64 * 1024, f"{name} is {path.stat().st_size} bytes: clear its outputs"
    for c in code_cells(nb):
        assert c.outputs == [] and c.execution_count is None, \
            f"{name}: stored with outputs; clear them (jupyter nbconvert --clear-output --inplace)"
    first, second = (c.source for c in code_cells(nb)[:2])
    assert 'IN_COLAB = "google.colab" in sys.modules' in first
    assert "if IN_COLAB:\n" in first and first.count("%pip install") == 1, "the install runs only in Colab"
    # From the repository, never by a bare name ("meshtrain" on the package index is another project).
    assert '%pip install --quiet "meshtrain-jax[notebooks] @ {SOURCE}"' in first
    assert "sys.path.insert" in first, "a checkout without an install finds the repository root"
    # The device count is set in the second cell, before anything touches a device.
    for setting in ('jax.config.update("jax_platforms", "cpu")', 'jax.config.update("jax_num_cpu_devices"'):
        assert setting in second
    assert "jax.devices" not in first
    assert second.index('"jax_num_cpu_devices"') < second.index("jax.device_count()")


def test_colab_cell_is_a_no_op_outside_colab(monkeypatch):
    """Outside Colab the cell neither installs nor, when meshtrain imports, touches sys.path."""
    import nbformat

    source = code_cells(nbformat.read(NOTEBOOKS / NAMES[0], as_version=4))[0].source
    body = source.replace("%pip install", "raise AssertionError  # pip install")
    before = list(sys.path)
    exec(compile(body, "colab_cell", "exec"), {"__name__": "colab_cell"})
    assert sys.path == before


# --- executing them ------------------------------------------------------------------------

@pytest.fixture
def kernel_env(tmp_path):
    """A kernelspec that starts this interpreter, found through JUPYTER_PATH, and the
    environment the kernel gets (without MPLBACKEND, so the inline backend draws)."""
    notebooks.kernel_spec(tmp_path / "jupyter", sys.executable)
    env = {k: v for k, v in os.environ.items() if k != "MPLBACKEND"}
    env["JUPYTER_PATH"] = os.pathsep.join([str(tmp_path / "jupyter"), env.get("JUPYTER_PATH", "")]).rstrip(os.pathsep)
    env["PYDEVD_DISABLE_FILE_VALIDATION"] = "1"
    return env


# layouts.ipynb runs, with the same checks, against the installed wheel in
# test_install.py::test_a_notebook_runs_against_the_installed_package: once is enough.
@pytest.mark.slow
@pytest.mark.parametrize("name", ["scaling.ipynb"])
def test_notebook_runs_and_draws(name, kernel_env, monkeypatch):
    nb, elapsed = notebooks.execute(name, kernel_env, NOTEBOOKS, monkeypatch)
    figures = notebooks.assert_runs_and_draws(name, nb)
    print(f"{name}: {elapsed:.1f} s, {figures} figures")


# --- pictures.py ---------------------------------------------------------------------------

def mesh_of(shape: str) -> jax.sharding.Mesh:
    s = mesh_lib.parse_shape(shape)
    return mesh_lib.make_mesh(s, jax.devices()[:int(np.prod(list(s.values())))])


def distinct_blocks(shape, sharding) -> set:
    return {tuple(s.indices(n)[:2] for s, n in zip(idx, shape))
            for idx in sharding.devices_indices_map(tuple(shape)).values()}


CASES = [
    ("data:8", (16, 32), P()),
    ("data:8", (16, 32), P("data")),
    ("data:8", (64,), P("data")),
    ("data:8", (), P()),
    ("data:2,tensor:4", (8, 12), P(None, "tensor")),
    ("data:2,tensor:4", (8, 12), P("data", "tensor")),
    ("data:2,tensor:4", (2, 8, 3, 4, 16), P(None, None, None, "tensor", None)),
    ("data:2,fsdp:2,tensor:2", (4, 6, 8), P("data", "fsdp", "tensor")),
    ("data:2,fsdp:2,tensor:2", (2, 4, 8, 6), P("data", None, ("fsdp", "tensor"))),
    ("data:4,stage:2", (2, 1, 64, 256), P("stage", None, None, None)),
]


@pytest.mark.parametrize("mesh_shape,shape,spec", CASES)
def test_sharding_picture_draws_one_rectangle_per_block(mesh_shape, shape, spec):
    sharding = NamedSharding(mesh_of(mesh_shape), spec)
    fig, ax = plt.subplots()
    pictures.sharding_picture(ax, shape, sharding, title="x")
    blocks = distinct_blocks(shape, sharding)
    assert len(ax.patches) == len(blocks)
    assert len(ax.texts) == len(blocks)
    # The rectangles tile the drawn area exactly: no overlap, no gap.
    x0, x1 = ax.get_xlim()
    y1, y0 = ax.get_ylim()
    area = sum(p.get_width() * p.get_height() for p in ax.patches)
    assert area == pytest.approx((x1 - x0) * (y1 - y0))
    # Every device appears in exactly one label per block it holds.
    held = sorted(i for b in pictures.shard_blocks(shape, sharding).values() for i in b)
    assert held == sorted(d.id for d in sharding.mesh.devices.flat)
    assert "rows" in ax.get_title() and "cols" in ax.get_title()


def test_sharding_picture_labels_and_colours_replicas():
    """dp2 x tp4: columns split over tensor, each piece held by devices i and i+4."""
    sharding = NamedSharding(mesh_of("data:2,tensor:4"), P(None, "tensor"))
    fig, ax = plt.subplots()
    pictures.sharding_picture(ax, (64, 256), sharding, dim_names=("embed", "mlp"))
    assert sorted(t.get_text() for t in ax.texts) == ["0,4", "1,5", "2,6", "3,7"]
    assert len({tuple(p.get_facecolor()) for p in ax.patches}) == 4
    assert "cols mlp=256" in ax.get_title() and ax.get_xlim() == (0, 256)
    fig, ax = plt.subplots()
    pictures.sharding_picture(ax, (64, 256), NamedSharding(sharding.mesh, P()))
    assert [t.get_text() for t in ax.texts] == ["0-7"]


def test_memory_keys_follow_the_report():
    from meshtrain.planner import report

    assert pictures.MEMORY_KEYS == tuple(report.MEMORY_KEYS)


def test_format_ids():
    assert pictures.format_ids([3]) == "3"
    assert pictures.format_ids([4, 0]) == "0,4"
    assert pictures.format_ids(range(4)) == "0-3"
    assert pictures.format_ids([0, 1, 2, 3, 8, 9, 10, 11]) == "0-3,8-11"
    assert pictures.format_ids([0, 1, 5]) == "0,1,5"


@pytest.fixture(scope="module")
def tiny():
    def build(name):
        cfg = config_lib.load(name)
        return Experiment.build(cfg)
    return build


def test_layout_figure_one_panel_per_weight_matrix(tiny):
    exp = tiny("gpt2_tiny_dp2_tp4")
    leaves = pictures.main_leaves(exp)
    assert set(leaves) >= {"wte", "wpe", "blocks/attn/w_qkv", "blocks/attn/w_out", "blocks/mlp/w_fc",
                           "blocks/mlp/w_proj"}
    assert "blocks/ln1/scale" not in leaves and "ln_f/bias" not in leaves
    fig = pictures.layout_figure(exp)
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert len(panels) == len(leaves)
    by_title = {ax.get_title().split(" ")[0]: ax for ax in panels}
    assert sorted(t.get_text() for t in by_title["wte"].texts) == ["0,4", "1,5", "2,6", "3,7"]
    assert [t.get_text() for t in by_title["wpe"].texts] == ["0-7"]
    assert "data:2 x tensor:4" in fig._suptitle.get_text()


def test_layout_figure_opt_state_shows_zero1(tiny):
    exp = tiny("gpt2_tiny_dp8_zero1")
    params = pictures.layout_figure(exp, leaves=["blocks/mlp/w_fc"])
    moments = pictures.layout_figure(exp, leaves=["blocks/mlp/w_fc"], target="opt_state")
    assert len(params.axes[0].patches) == 1
    assert len(moments.axes[0].patches) == 8
    with pytest.raises(KeyError, match="no parameter nope"):
        pictures.layout_figure(exp, leaves=["nope"])


# --- pictures/spatial.py -------------------------------------------------------------------

def patches_by_gid(ax) -> dict[str, list]:
    out: dict[str, list] = {}
    for p in ax.patches:
        out.setdefault(p.get_gid(), []).append(p)
    return out


def test_row_spans_follow_the_sharding():
    sharding = NamedSharding(mesh_of("data:2,tensor:4"), P("data", "tensor", None, None))
    shape = (32, 16, 16, 3)
    assert spatial_pictures.row_spans(shape, sharding) == [(0, 4, [0]), (4, 8, [1]), (8, 12, [2]), (12, 16, [3])]
    assert spatial_pictures.row_spans(shape, sharding, example=16) == [(0, 4, [4]), (4, 8, [5]), (8, 12, [6]),
                                                                        (12, 16, [7])]
    # Batch unsplit: each row span is held by the two data replicas.
    rows = NamedSharding(sharding.mesh, P(None, "tensor", None, None))
    assert [ids for _, _, ids in spatial_pictures.row_spans(shape, rows)] == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize("height, halo", [(16, 1), (8, 1), (8, 3)])
def test_rows_picture_draws_each_piece_with_its_halo(height, halo):
    """4 row pieces: each drawn twice (the image, the piece), with `halo` rows above and below
    it coloured by the device that holds them, or padding outside the image."""
    sharding = NamedSharding(mesh_of("data:2,tensor:4"), P("data", "tensor", None, None))
    fig, ax = plt.subplots()
    spatial_pictures.rows_picture(ax, (32, height, height, 16), sharding, halo)
    by = patches_by_gid(ax)
    piece = height // 4
    assert [p.get_height() for p in by["rows"]] == [piece] * 4
    assert [p.get_height() for p in by["own"]] == [piece] * 4
    # Every piece gets `halo` rows each side: from neighbours inside the image, padding outside.
    assert sum(p.get_height() for p in by["halo"] + by["pad"]) == 4 * 2 * halo
    # Padding: the rows of the `halo` above and below a piece that are outside the image.
    assert sum(p.get_height() for p in by["pad"]) == sum(max(0, halo - r0) + max(0, r0 + piece + halo - height)
                                                         for r0 in range(0, height, piece))
    # Halo rows are coloured by their sender: the colour of that device's rows in the image.
    own = {t.get_text(): p.get_facecolor()[:3] for p, t in zip(by["rows"], ax.texts[:4])}
    assert sorted(own) == ["0", "1", "2", "3"]
    senders = [t.get_text() for t in ax.texts if t.get_text().startswith("from ")]
    assert len(senders) == len(by["halo"])
    for p, text in zip(by["halo"], senders):
        assert p.get_facecolor()[:3] == own[text.removeprefix("from ")]
        assert p.get_hatch() == "///"
    # With a halo deeper than a piece, a piece receives from two devices on one side.
    assert len(by["halo"]) == (6 if halo <= piece else 10)


def test_rows_figure_one_panel_per_activation(tiny):
    exp = tiny("vgg_tiny_dp2_spatial4")
    fig = spatial_pictures.rows_figure(exp, {"images": 1, "pool after conv2": 1})
    assert len(fig.axes) == 3
    first, images, pooled = fig.axes
    assert sorted(t.get_text() for t in first.texts) == [str(i) for i in range(8)]  # batch x height blocks
    assert [p.get_height() for p in patches_by_gid(images)["own"]] == [4] * 4
    assert [p.get_height() for p in patches_by_gid(pooled)["own"]] == [2] * 4
    assert "dp_spatial" in fig._suptitle.get_text()
    with pytest.raises(KeyError, match="no activation nope"):
        spatial_pictures.rows_figure(exp, {"nope": 1})


def fake_report(devices: int, params: float, layout_axes: dict[str, float], step: float = 1e-3) -> dict:
    mem = {"params": params, "optimizer": 2 * params, "gradients": params, "activations": 5 * params}
    return {
        "devices": devices,
        "analytic_memory_per_device_bytes": {**mem, "total": 9 * params},
        "memory_per_device_bytes": {**mem, "activations": -1.0, "peak_estimate": 10 * params},
        "collectives_by_axes": [{"mesh_axes": a.split("+"), "bytes": b, "lower_bound_bytes": b / 2}
                                for a, b in layout_axes.items()],
        "collective_bytes_per_step": sum(layout_axes.values()),
        "predicted_step_time_s": step, "predicted_mfu": 0.4,
    }


def test_compare_figure_bars():
    reports = {"dp8": fake_report(8, 2**20, {"data": 3 * 2**20}),
               "dp2_tp4": fake_report(8, 2**18, {"data": 2**18, "tensor": 2**22}),
               "one": fake_report(1, 2**20, {})}
    fig = pictures.compare_figure(reports)
    formulas, compiled, traffic = fig.axes[:3]
    # 4 memory parts x 3 layouts, stacked; the compiled panel draws a negative remainder as 0.
    assert len(formulas.patches) == 12 and len(compiled.patches) == 12
    assert min(p.get_height() for p in compiled.patches) == 0
    assert [t.get_text() for t in formulas.get_xticklabels()] == list(reports)
    # Two mesh-axes groups (data, tensor) x 3 layouts, stacked; MiB since the largest is 4 MiB.
    assert len(traffic.patches) == 6
    assert "MiB" in traffic.get_ylabel()


def test_scaling_rows_and_figure():
    rows = []
    for n in (1, 2, 4, 8):
        rows.append(pictures.scaling_row("dp", fake_report(n, 2**20, {"data": 1.0})))
        rows.append(pictures.scaling_row("fsdp", fake_report(n, 2**20 / n, {"fsdp": 1.0}, step=2e-3)))
    assert rows[0] == {"strategy": "dp", "devices": 1, "analytic_memory_bytes": 9 * 2**20,
                       "compiled_memory_bytes": 10 * 2**20, "step_time_s": 1e-3, "mfu": 0.4,
                       "collective_bytes": 1.0, "params_bytes": 2**20, "optimizer_bytes": 2**21,
                       "gradients_bytes": 2**20, "activations_bytes": 5 * 2**20}
    fig = pictures.scaling_figure(rows)
    assert len(fig.axes) == 3
    for ax in fig.axes:
        assert ax.get_xscale() == "log"
        assert [line.get_label() for line in ax.get_lines()] == ["dp", "fsdp"]
        assert list(ax.get_lines()[0].get_xdata()) == [1, 2, 4, 8]
    assert list(fig.axes[2].get_lines()[1].get_ydata()) == [2.0] * 4  # ms
    assert list(fig.axes[0].get_lines()[1].get_ydata()) == [9.0, 4.5, 2.25, 1.125]  # MiB
