"""ZeRO's stages in the survey's setting (tools/zero_table.py): the formulas' table."""

import sys

import pytest

from support.processes import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import zero_table  # noqa: E402  (tools/ is no package)


@pytest.fixture(scope="module")
def table():
    return {(r.layout, r.devices): r for r in zero_table.rows(devices=(1, 8))}


def test_one_device_is_the_same_for_every_stage(table):
    dp = table["dp", 1]
    for layout in zero_table.LAYOUTS:
        r = table[layout, 1]
        assert (r.params, r.gradients, r.optimizer, r.state_vs_dp) == (dp.params, dp.gradients, dp.optimizer, 1.0)


def test_stages_split_what_zero_says_at_eight_devices(table):
    """fp32 master weights, gradients and Adam moments: dp 4+4+8 Psi, zero1 4+4+8/N,
    zero2 4+4/N+8/N, fsdp (4+4+8)/N bytes per parameter (arXiv 1910.02054)."""
    psi = table["dp", 1].params / 4
    expected = {"dp": (4 * psi, 4 * psi, 8 * psi), "zero1": (4 * psi, 4 * psi, psi),
                "zero2": (4 * psi, psi / 2, psi), "fsdp": (psi / 2, psi / 2, psi)}
    for layout, (params, grads, opt) in expected.items():
        r = table[layout, 8]
        assert (r.params, r.gradients, r.optimizer) == pytest.approx((params, grads, opt), rel=1e-12)
        assert r.activations == table["dp", 8].activations  # the same rows on each device


def test_zero2_at_eight_devices_is_within_the_surveys_range(table):
    """At most 66% of DDP's state (Nichols et al. measured ZeRO at 42-66% of DDP's memory)."""
    assert table["zero2", 8].state_vs_dp <= 0.66
    assert [table[lay, 8].state for lay in zero_table.LAYOUTS] == sorted(
        (table[lay, 8].state for lay in zero_table.LAYOUTS), reverse=True)


def test_markdown_has_a_row_per_count_and_layout(table):
    text = zero_table.markdown([table[lay, n] for n in (1, 8) for lay in zero_table.LAYOUTS])
    lines = text.splitlines()
    assert lines[0].startswith("| N | layout | params | gradients | optimizer | state |")
    assert len(lines) == 2 + 2 * len(zero_table.LAYOUTS)
    assert lines[-2].startswith("| 8 | zero2 |") and lines[-2].endswith(f"| {table['zero2', 8].state_vs_dp:.0%} |")
