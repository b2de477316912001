"""The halo formula of spatial layouts (planner/halo.py) against the compiled step's
collective-permutes, its rows against a brute-force count, and the plan command for image
models. Each config is compiled once per module."""

import json
import os
import re

import pytest

from meshtrain.models import conv as conv_lib
from meshtrain.planner import halo, hardware, hlo, report as report_lib
from meshtrain.run.experiment import Experiment
from support.training import compiled_as_users_compile
from support.configs import configured

H100 = hardware.get("h100")
# name -> overrides: VGG tiny's own spatial config, and ResNet tiny (strided convs) under it
SPATIAL = {"vgg_tiny_dp2_spatial4": {},
           "resnet_tiny_dp8": {"mesh.shape": "data:2,tensor:4", "layout": "dp_spatial"}}


def _build(name, **overrides):
    return Experiment.build(configured(name, **overrides))


@pytest.fixture(scope="module")
def planned():
    out = {}
    for name, overrides in {**SPATIAL, "vgg_tiny_dp8": {}, "resnet_tiny_dp8 dp": {}}.items():
        exp = _build(name.split()[0], **overrides)
        # The spatial steps' HLO text is read below, with no loops in it: compiled as users
        # compile it. The others' plans alone are read: compiled as `meshtrain plan` does, faster.
        compiled = compiled_as_users_compile(exp) if name in SPATIAL else exp.compile(analysis=True)
        out[name] = (exp, compiled, report_lib.plan(exp, H100, compiled, 0.0))
    return out


def _brute_force(k: int, stride: int, pass_: str, rows: int = 24, split: int = 3) -> tuple[int, int]:
    """Rows of the exchanged array a middle device needs from above and below, found by
    listing what each of its rows reads: the forward's outputs read inputs stride*j - p + i;
    the input gradient's inputs read the outputs j whose windows cover them."""
    p, out_rows = k // 2, conv_lib.conv_output_size(rows, stride)
    lo, hi = rows // split, 2 * rows // split           # the device's input rows
    olo, ohi = out_rows // split, 2 * out_rows // split  # and output rows
    if pass_ == "input gradient":
        need = {j for i in range(lo, hi) for j in range(out_rows) if stride * j - p <= i <= stride * j - p + k - 1}
        return len({j for j in need if j < olo}), len({j for j in need if j >= ohi})
    need = {stride * j - p + i for j in range(olo, ohi) for i in range(k)}
    need = {r for r in need if 0 <= r < rows}
    return len({r for r in need if r < lo}), len({r for r in need if r >= hi})


@pytest.mark.parametrize("k, stride", [(3, 1), (3, 2), (7, 2), (1, 1), (1, 2), (5, 1)])
@pytest.mark.parametrize("pass_", halo.PASSES)
def test_rows_match_a_brute_force_count(k, stride, pass_):
    assert halo.halo_rows(k, stride, pass_) == _brute_force(k, stride, pass_)


def test_one_conv_by_hand():
    """VGG tiny's conv2 (3x3, 16 -> 16 channels, 16 x 16 rows) for 16 images a device in
    float32, height split 4 ways: one row of 16 x 16 x 4 bytes per image each way, sent by
    3 of the 4 devices in each direction, in each of the three passes."""
    spec = conv_lib.ConvSpec("conv2", 3, 16, 16, 1, 16, 16, ("filters", "channels"))
    found = halo.exchanges([spec], images=16, dtype_bytes=4)
    row = 16 * 16 * 16 * 4
    assert [(e.pass_, e.above, e.below, e.row_bytes) for e in found] == [
        ("forward", 1, 1, row), ("input gradient", 1, 1, row), ("weight gradient", 1, 1, row)]
    assert [e.per_device(4) for e in found] == [3 / 4 * 2 * row] * 3
    first = spec._replace(name="conv1", c_in=3, axes=("image_channels", "filters"))
    assert [e.pass_ for e in halo.exchanges([first], 16, 4)] == ["forward", "weight gradient"]  # images: no gradient


def _compiled_by_direction(compiled) -> dict[str, float]:
    """Bytes each device sends per step in collective-permutes to the next device along the
    split ("down": the receiver's rows from above) and to the previous one ("up")."""
    out = {"down": 0.0, "up": 0.0}
    text = compiled.as_text()
    assert "while(" not in text  # no loops: each op runs once a step
    devices = int(re.search(r"num_partitions=(\d+)", text).group(1))
    for line in text.splitlines():
        m = re.search(r"= (\S+) collective-permute\(.*source_target_pairs=\{(.*?)\}\}", line)
        if m:
            pairs = [(int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)", m.group(2) + "}")]
            way = "down" if pairs[0][1] > pairs[0][0] else "up"
            out[way] += hlo.shape_bytes(m.group(1)) * len(pairs) / devices
    return out


@pytest.mark.parametrize("name", SPATIAL)
def test_compiled_halo_within_1_1x_of_the_formula_each_way(name, planned):
    exp, compiled, r = planned[name]
    h = r["halo"]
    assert h["mesh_axes"] == ["tensor"] and h["split"] == 4
    assert 1 / 1.1 <= h["ratio"] <= 1.1
    s = h["split"]
    want = {"down": sum((s - 1) / s * c["rows_above"] * c["row_bytes"] for c in h["convs"]),
            "up": sum((s - 1) / s * c["rows_below"] * c["row_bytes"] for c in h["convs"])}
    got = _compiled_by_direction(compiled)
    for way in want:
        assert 1 / 1.1 <= got[way] / want[way] <= 1.1, (way, got, want)
    assert h["compiled_bytes"] == pytest.approx(got["down"] + got["up"])
    # the least leaves out the weight gradient's second fetch, which XLA makes: named as excess
    assert h["bound_bytes"] == pytest.approx(h["bytes"] - h["terms"]["weight gradient"])
    tensor = next(a for a in r["collectives_by_axes"] if a["mesh_axes"] == ["tensor"])
    assert any("weight gradient fetches x's halo rows again" in why for why in tensor["excess"])


def test_no_halo_without_a_row_split(planned):
    assert planned["vgg_tiny_dp8"][2]["halo"] is None


@pytest.mark.parametrize("name", ["vgg_tiny_dp8", "resnet_tiny_dp8 dp"])
def test_a_classifier_plan_counts_convs_and_no_language_model_formula(name, planned):
    """Compiled FLOPs (matmuls and convs) are 6 x the forward's multiply-adds less the first
    conv's input gradient, which is not computed (images have no gradient), and with a
    strided conv's input gradient counted without the zeros it dilates dy with (ResNet's);
    no attention, no activation formula, and the data axis's reduction equals its bound
    within BatchNorm's synchronised statistics."""
    exp, _, r = planned[name]
    cfg, images = exp.model.cfg, exp.cfg.train.batch_size
    first = exp.model.family.convs(cfg)[0]
    assert r["flops_per_step"] == pytest.approx(r["model_flops_per_step"] - 2 * first.macs * images)
    assert r["attention"] is None and r["analytic_memory_per_device_bytes"]["activations"] is None
    assert r["memory_ratio"]["optimizer"] == pytest.approx(1.0)  # SGD's one momentum buffer
    (data,) = r["collectives_by_axes"]
    assert 1.0 <= data["ratio"] < 1.05


def test_plan_prints_compiled_and_formula(capsys, monkeypatch):
    from meshtrain import plan
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    assert plan.main(["--config=vgg_tiny_dp2_spatial4"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "halo exchanges over" in x)
    assert line.startswith("  halo exchanges over tensor (height split 4 ways): ")
    assert re.search(r"compiled [\d.]+ KiB in 22 ops, formula [\d.]+ KiB in 22 \(1\.00x\)", line)
    assert plan.main(["--config=vgg_tiny_dp2_spatial4", "--json"]) == 0
    h = json.loads(capsys.readouterr().out)["halo"]
    assert h["compiled_bytes"] > 0 and h["bytes"] > 0 and h["ratio"] == pytest.approx(h["compiled_bytes"] / h["bytes"])
