"""Layout grammar, strict resolution, and golden sharding tables per preset."""

import os
import pathlib

import pytest
from jax.sharding import PartitionSpec as P

from meshtrain.errors import UserError
from meshtrain.models import model_config
from meshtrain.parallel import layouts
from meshtrain.parallel.layouts.tables import sharding_table
from meshtrain.parallel.pipeline.scan import Pipeline
from meshtrain.step.state import abstract_model

GOLDEN = pathlib.Path(__file__).parent / "golden"


def test_grammar_and_priority():
    lay = layouts.parse("batch:data+fsdp;heads:tensor;embed:fsdp")
    assert lay.params == lay.activations == lay.opt_state
    # batch claims fsdp first, so embed stays replicated in activations ...
    assert lay.spec(("batch", "length", "embed"), "activations") == P(("data", "fsdp"), None, None)
    # ... while a weight with no batch dim gets fsdp on embed.
    assert lay.spec(("embed", "heads"), "params") == P("fsdp", "tensor")
    assert lay.spec(("layers", "embed"), "params") == P(None, "fsdp")


def test_sections_override_targets():
    lay = layouts.parse("batch:data | opt_state=embed:data;mlp:data")
    assert lay.spec(("embed", "mlp"), "params") == P(None, None)
    assert lay.spec(("embed", "mlp"), "opt_state") == P("data", None)
    assert lay.spec(("batch", "embed"), "activations") == P("data", None)


def test_grads_follows_params_unless_given():
    """zero1 keeps gradients where the weights are until the backward pass ends (grads
    follows params); zero2 splits them like the moments (parallel/layouts/rules.py)."""
    zero1, zero2 = layouts.get("zero1"), layouts.get("zero2")
    assert zero1.grads == zero1.params and "grads=" not in zero1.describe()
    assert zero2.grads == zero2.opt_state != zero2.params
    assert zero2.spec(("layers", "embed", "mlp"), "grads") == P(None, "data", None)
    assert zero2.spec(("layers", "embed", "mlp"), "params") == P(None, None, None)


def test_describe_round_trips():
    for name in layouts.PRESETS:
        lay = layouts.get(name)
        again = layouts.parse(lay.describe(), name=name)
        assert again == lay


@pytest.mark.parametrize("text, words", [
    ("batch:data;embd:fsdp", ["'embd'", "vocabulary", "embed"]),
    ("batch:dta", ["'dta'", "data, stage, fsdp, context, expert, tensor"]),
    ("batch;heads:tensor", ["not 'logical:mesh_axis"]),
    ("weights=batch:data", ["'weights'", "params, opt_state, grads, activations"]),
    ("nonsense", ["Unknown layout 'nonsense'", "dp, fsdp, zero1, zero2, tp, dp_tp, fsdp_tp"]),
    ("batch:data+data", ["repeats a mesh axis"]),
    ("batch:data | heads:tensor", ["two sections for all targets"]),
    ("batch:data | params=embed:fsdp | params=mlp:fsdp", ["two sections for params"]),
])
def test_bad_layouts_say_why(text, words):
    with pytest.raises(UserError) as e:
        layouts.get(text)
    for w in words:
        assert w in str(e.value)


def test_unknown_logical_name_in_model_is_an_error():
    with pytest.raises(UserError, match="Unknown logical axis name 'hidden'.*batch, length, embed"):
        layouts.get("dp").spec(("batch", "hidden"), "activations", where="parameter foo")


def test_unruled_name_is_replicated_on_purpose():
    assert layouts.get("dp").spec(("vocab", "embed")) == P(None, None)


@pytest.mark.parametrize("preset", list(layouts.PRESETS))
def test_golden_tables(preset, make_config):
    # Expert presets are shown on Mixtral tiny (their experts), the others on GPT-2 tiny.
    cfg = make_config("mixtral_tiny_dp8" if "_ep" in preset else "gpt2_tiny_dp8")
    # Pipeline presets are shown on stage-stacked blocks [stage, layers, ...].
    pipe = Pipeline(stages=2, microbatches=2) if preset in layouts.PIPELINE_PRESETS else None
    model = abstract_model(model_config(cfg.model, vocab_size=256), pipe)
    table = sharding_table(model.axes, layouts.get(preset), model.activation_axes())
    path = GOLDEN / f"{preset}.txt"
    if os.environ.get("UPDATE_GOLDEN"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(table)
    assert path.exists(), f"missing {path}; run UPDATE_GOLDEN=1 pytest tests/test_layouts.py"
    assert table == path.read_text(), (
        f"sharding table for {preset!r} changed; review the diff and regenerate with "
        f"UPDATE_GOLDEN=1 pytest tests/test_layouts.py")


IMAGE_GOLDEN = [("vgg", p) for p in ("dp", "fsdp", "zero1", "dp_tp", "dp_spatial")] + \
    [("resnet", p) for p in ("fsdp", "dp_tp", "dp_spatial")]


@pytest.mark.parametrize("family, preset", IMAGE_GOLDEN)
def test_golden_tables_image_models(family, preset, make_config):
    """The image families' tiny sizes: conv kernels and BatchNorm vectors by channels and
    filters, activations by batch, height and width (BatchNorm's statistics follow the
    params rules, as the scales beside them show)."""
    cfg = make_config(f"{family}_tiny_dp8")
    model = abstract_model(model_config(cfg.model, vocab_size=10))
    table = sharding_table(model.axes, layouts.get(preset), model.activation_axes())
    path = GOLDEN / f"{family}_tiny_{preset}.txt"
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(table)
    assert path.exists(), f"missing {path}; run UPDATE_GOLDEN=1 pytest tests/test_layouts.py -k golden"
    assert table == path.read_text(), (
        f"sharding table of {family} tiny for {preset!r} changed; review the diff and regenerate with "
        f"UPDATE_GOLDEN=1 pytest tests/test_layouts.py -k golden")
