"""train.accum_gather: with microbatches under fsdp, "once" gathers the parameters once per
step and reduces the accumulated gradients once; "each" (XLA left to itself) gathers them
in every microbatch. What each sends is read from the compiled HLO (hlo.collective_table,
loop trip counts included); "once" changes no loss. Steps are compiled with the planner's
analysis options (compile_options.ANALYSIS_OPTIONS: the same HLO, 3x faster to compile), also
those run: a few steps of a tiny model, where slower code costs nothing.
"""

import dataclasses
import functools
import math
import re

import jax
import numpy as np
import pytest

from meshtrain.errors import UserError
from meshtrain.models.stack import is_matrix
from meshtrain.parallel.layouts.rules import mesh_axes_of
from meshtrain.planner import accumulation, analytic, bounds, hlo
from meshtrain.run.experiment import Experiment
from meshtrain.run.memory_budget import Budget
from meshtrain.step import train_step as step_lib
from meshtrain.train import main as train_main
from support.configs import configured
from support.training import loss_curve

STEPS = 3
K = 4  # microbatches


def run(name, **overrides):
    """{exp, hlo text, collective rows, losses of STEPS steps}, compiling the step once."""
    exp = Experiment.build(configured(name, **overrides))
    step = exp.compile(analysis=True)
    return {"exp": exp, "text": step.as_text(), "rows": hlo.collective_table(step, exp.mesh, lambda d: 0),
            "losses": loss_curve(exp, STEPS, step)}


def sent(r, kind, axes=("fsdp",)) -> tuple[int, float, int]:
    """(executions per step, bytes each device sends, result bytes) of `kind` over `axes`."""
    rows = [x for x in r["rows"] if x["kind"] == kind and x["mesh_axes"] == axes]
    return sum(x["count"] for x in rows), sum(x["bytes"] for x in rows), sum(x["result_bytes"] for x in rows)


def ops_in(text: str, kind: str) -> int:
    """How many `kind` instructions the HLO text holds (each runs once unless in a loop)."""
    return len(re.findall(rf"^\s*(?:ROOT )?%\S+ = .* {kind}(?:-start)?\(", text, re.M))


def param_bytes(exp, split_over=()) -> float:
    """Bytes of every parameter on one device when split only over the mesh axes `split_over`."""
    total = 0.0
    for s, sh in zip(jax.tree.leaves(exp.model.shapes), jax.tree.leaves(exp.shardings.params)):
        axes = [a for entry in sh.spec for a in mesh_axes_of(entry) if a in split_over]
        total += s.size * s.dtype.itemsize / math.prod(exp.mesh.shape[a] for a in axes)
    return total


@pytest.fixture(scope="module")
def fsdp8():
    return {"each": run("gpt2_tiny_fsdp8", **{"train.grad_accum_steps": K, "train.accum_gather": "each"}),
            "once": run("gpt2_tiny_fsdp8", **{"train.grad_accum_steps": K, "train.accum_gather": "once"}),
            "one": run("gpt2_tiny_fsdp8")}


def test_once_gathers_the_params_once_per_step(fsdp8):
    """One gather of every parameter, (n-1)/n of its bytes, the planner's bound exactly;
    "each" gathers at least once per microbatch (forward; backward re-gathers most)."""
    once, each = fsdp8["once"], fsdp8["each"]
    exp, n = once["exp"], 8
    _, once_bytes, once_result = sent(once, "all-gather")
    assert once_result == param_bytes(exp)
    assert once_bytes == pytest.approx((n - 1) / n * param_bytes(exp), rel=1e-9)
    bound = [r for r in bounds.collective_bounds(exp) if r["kind"] == "all-gather"]
    assert [r["mesh_axes"] for r in bound] == [("fsdp",)] and bound[0]["bytes"] == pytest.approx(once_bytes, rel=1e-9)
    assert sent(each, "all-gather")[1] >= K * once_bytes


def test_once_has_no_collective_inside_the_microbatch_loop(fsdp8):
    """Every all-gather and all-reduce of the step is an instruction of its own that runs
    once (XLA could otherwise sink the gather back into the while loop)."""
    text = fsdp8["once"]["text"]
    for kind in ("all-gather", "all-reduce"):
        ops = ops_in(text, kind)
        assert ops and sent(fsdp8["once"], kind)[0] == ops


def test_once_reduces_the_gradients_once(fsdp8):
    """Each microbatch's gradients are reduce-scattered under "each" (the CPU compiler emits
    an all-reduce and a slice): k times the result bytes of "once"'s single reduction;
    small scalars (loss, norm) beside them differ."""
    _, _, once = sent(fsdp8["once"], "all-reduce")
    _, _, each = sent(fsdp8["each"], "all-reduce")
    assert once == pytest.approx(param_bytes(fsdp8["once"]["exp"]), rel=1e-3)
    assert each == pytest.approx(K * once, rel=1e-3)


def test_once_trains_like_each_and_like_one_microbatch(fsdp8):
    np.testing.assert_allclose(fsdp8["once"]["losses"], fsdp8["each"]["losses"], rtol=1e-5)
    np.testing.assert_allclose(fsdp8["once"]["losses"], fsdp8["one"]["losses"], rtol=1e-5)


def test_planner_memory_counts_the_gathered_params_and_accumulator(fsdp8):
    """The formula's gradients grow by the gathered params and a float32 accumulator of
    their size (float32 model: 8 bytes per parameter), less the accumulator at the
    optimizer's sharding that "each" keeps."""
    once, each = fsdp8["once"]["exp"], fsdp8["each"]["exp"]
    extra = analytic.memory(once)["gradients"] - analytic.memory(each)["gradients"]
    assert extra == pytest.approx(2 * param_bytes(once) - param_bytes(once, ("fsdp",)), rel=1e-9)


@pytest.mark.parametrize("name", ["gpt2_tiny_dp2_fsdp2_tp2", pytest.param("llama_tiny_fsdp8", marks=pytest.mark.slow)])
def test_once_across_layouts(name):
    """fsdp_tp (data x fsdp x tensor) and Llama: one gather over fsdp of the fsdp-sharded
    params' tensor shards, the planner's bound; the losses of "each"."""
    over = {"train.grad_accum_steps": K}
    once, each = run(name, **over, **{"train.accum_gather": "once"}), run(name, **over, **{"train.accum_gather": "each"})
    exp = once["exp"]
    # (n-1)/n of each fsdp-sharded leaf's tensor shard; the rest are not gathered
    gathered = param_bytes(exp, ("tensor",)) - param_bytes(exp, ("tensor", "fsdp"))
    assert sent(once, "all-gather")[1] == pytest.approx(gathered, rel=1e-9)
    assert sent(once, "all-gather")[0] == ops_in(once["text"], "all-gather")
    bound = sum(r["bytes"] for r in bounds.collective_bounds(exp) if r["kind"] == "all-gather")
    assert bound == pytest.approx(sent(once, "all-gather")[1], rel=1e-9)
    np.testing.assert_allclose(once["losses"], each["losses"], rtol=1e-5)


def test_bf16_compute_gathers_matrices_in_bf16():
    """Cast before the gather: matrices travel in bfloat16, vectors in float32."""
    exp = Experiment.build(configured("gpt2_tiny_fsdp8", **{"train.grad_accum_steps": K, "train.accum_gather": "once",
                                                      "model.dtype": "bfloat16"}))
    compiled = exp.compile(analysis=True)
    rows = hlo.collective_table(compiled, exp.mesh, lambda d: 0)
    gathered = sum(r["result_bytes"] for r in rows if r["kind"] == "all-gather")
    flat = jax.tree.leaves(exp.model.axes, is_leaf=lambda x: isinstance(x, tuple))
    want = sum(s.size * (2 if is_matrix(a) else 4) for s, a in zip(jax.tree.leaves(exp.model.shapes), flat))
    assert gathered == want


def budget(per_device):
    return Budget(per_device, 1, 1.0, "a test", host=False)


def chosen(cfg, per_device: float | None) -> Experiment:
    """`cfg` built with train.accum_gather decided under a budget of `per_device` bytes (None: no limit known)."""
    b = None if per_device is None else budget(per_device)
    return Experiment.build(cfg, choose_gather=functools.partial(accumulation.choose, budget=b, local=False))


def test_auto_chooses_once_when_the_formula_fits(make_config):
    """Decided before the step is built, which is built once, in the mode chosen."""
    cfg = make_config("gpt2_tiny_fsdp8", **{"train.grad_accum_steps": K})
    exp = Experiment.build(cfg)
    assert exp.accum_gather == "each"  # "auto" without a budget to decide against
    need = sum(analytic.memory(dataclasses.replace(exp, accum_gather="once")).values())
    roomy = chosen(cfg, need)
    line = accumulation.line(roomy)
    assert roomy.accum_gather == "once" and "once per step" in line and "auto" in line
    assert analytic.gathered(roomy) == ("fsdp",)
    tight = chosen(cfg, need * 0.99)
    assert tight.accum_gather == "each" and "do not fit" in accumulation.line(tight)
    assert chosen(cfg, None).accum_gather == "each"


@pytest.mark.parametrize("name, overrides, mode", [
    ("gpt2_tiny_dp8", {"train.grad_accum_steps": K, "train.accum_gather": "once"}, "once"),
    ("gpt2_tiny_fsdp8", {}, "each"),
])
def test_nothing_to_choose_without_sharded_params_or_microbatches(name, overrides, mode, make_config):
    exp = chosen(make_config(name, **overrides), 1.0)
    assert exp.accum_why.startswith("nothing to choose")
    assert exp.accum_gather == mode
    assert analytic.gathered(exp) == ()


def test_bad_value_names_the_choices(make_config):
    with pytest.raises(UserError) as err:
        Experiment.build(make_config("gpt2_tiny_fsdp8", **{"train.accum_gather": "twice"}))
    for word in ("train.accum_gather='twice'", "once", "each", "auto"):
        assert word in str(err.value)


def test_train_says_which_it_chose(capfd, monkeypatch, tmp_path):
    """... and builds its step once, in the mode chosen."""
    monkeypatch.chdir(tmp_path)
    built, make = [], step_lib.make_train_step
    monkeypatch.setattr(step_lib, "make_train_step", lambda *a, **k: built.append(k["reduction"].gather) or make(*a, **k))
    status = train_main(["--config=gpt2_tiny_fsdp8", f"--config.train.grad_accum_steps={K}", "--config.train.steps=0"])
    out, err = capfd.readouterr()
    assert status == 0, err
    lines = [line for line in out.splitlines() if line.startswith("gradient accumulation:")]
    assert len(lines) == 1 and "once per step" in lines[0] and "fit" in lines[0], out
    assert built == ["once"]
