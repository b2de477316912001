"""Mesh shapes: parsing, -1 filling, and errors that show the arithmetic."""

import jax
import pytest

from meshtrain import mesh
from meshtrain.errors import UserError


def test_parse_fills_all_axes_in_order():
    assert mesh.parse_shape("data:8,tensor:4") == {"data": 8, "stage": 1, "fsdp": 1, "context": 1, "expert": 1, "tensor": 4}
    assert mesh.parse_shape({"fsdp": 2}) == {"data": 1, "stage": 1, "fsdp": 2, "context": 1, "expert": 1, "tensor": 1}
    assert mesh.format_shape(mesh.parse_shape("tensor:2")) == "data:1,stage:1,fsdp:1,context:1,expert:1,tensor:2"


def test_expert_sits_between_context_and_tensor():
    """Written in any order, expert reads back in AXES order, and may be the -1 axis."""
    shape = mesh.parse_shape("tensor:2,expert:4,data:2")
    assert list(shape) == ["data", "stage", "fsdp", "context", "expert", "tensor"]
    assert mesh.format_shape(shape) == "data:2,stage:1,fsdp:1,context:1,expert:4,tensor:2"
    assert mesh.format_factors(shape) == "data:2,expert:4,tensor:2"
    assert mesh.resolve_shape(mesh.parse_shape("data:2,expert:-1"), 16)["expert"] == 8
    m = mesh.make_mesh(mesh.parse_shape("data:2,expert:4"))  # the tests' 8 CPU devices
    assert m.axis_names[4] == "expert" and m.devices.shape == (2, 1, 1, 1, 4, 1)


def test_minus_one_is_filled():
    shape = mesh.resolve_shape(mesh.parse_shape("data:-1,tensor:4"), 32)
    assert shape["data"] == 8




def test_too_few_and_too_many_devices():
    with pytest.raises(UserError, match=r"needs 8 x 1 x 1 x 1 x 1 x 4 = 32 devices, more than the 8 available"):
        mesh.resolve_shape(mesh.parse_shape("data:8,tensor:4"), 8)
    with pytest.raises(UserError, match=r"needs 2 x 1 x 1 x 1 x 1 x 1 = 2 devices, fewer than the 8 available"):
        mesh.resolve_shape(mesh.parse_shape("data:2"), 8)


def test_minus_one_that_cannot_divide():
    with pytest.raises(UserError, match=r"multiply to 3, which does not divide the 8"):
        mesh.resolve_shape(mesh.parse_shape("data:-1,tensor:3"), 8)


@pytest.mark.parametrize("spec, message", [
    ("data:8,model:4", "unknown axis 'model'. The mesh axes are data, stage, fsdp, context, expert, tensor"),
    ("data=8", "is not 'axis:size'"),
    ("data:0", "has size 0"),
    ("data:-1,tensor:-1", "only one axis may be -1"),
    ("data:2,data:2", "given twice"),
])
def test_bad_shapes(spec, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        mesh.parse_shape(spec)


def test_make_mesh_has_all_axes_in_auto_mode():
    m = mesh.make_mesh(mesh.parse_shape("data:2,tensor:4"))
    assert m.axis_names == mesh.AXES
    assert dict(m.shape) == {"data": 2, "stage": 1, "fsdp": 1, "context": 1, "expert": 1, "tensor": 4}
    assert all(t == jax.sharding.AxisType.Auto for t in m.axis_types)


def test_backend_already_started_fixes_the_count():
    jax.devices()
    count, why = mesh.simulate_cpu_devices(mesh.parse_shape("data:32"))
    assert count == 8 and "already" in why
