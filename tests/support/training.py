"""Training a config for a few steps and comparing the result with another layout's: the
helpers of the equivalence tests (every layout equals one device)."""

import jax
import numpy as np
import pytest

from meshtrain.errors import UserError
from meshtrain.parallel.pipeline import scan as pipeline
from meshtrain.run.compile_options import analysis_options, known_options, SHORT_RUN_STEPS
from meshtrain.run.experiment import Experiment
from meshtrain.run.verify import step_1_gradients
from meshtrain.step import train_step as step_lib
from support.configs import configured

# The layout comparisons train STEPS steps at the full learning rate from the first
# (FULL_LR: no warm-up): each step then moves the weights as far as a step in mid-run, so
# five test a layout's update as hard as twenty of a 30-step warm-up did, whose first
# steps barely move them (gpt2, llama and mixtral tiny fall 0.38-0.53 in five steps at
# full lr, 0.02-0.05 in the warm-up's first five, 0.59-0.74 in its first twenty).
STEPS = 5
FULL_LR = {"optim.warmup_steps": "0"}
# The layout comparisons (test_equivalence, test_context, test_llama) train 16 rows a
# step, not the tiny configs' 32: a step's CPU is in proportion to its rows on this host
# (gpt2_tiny_dp8 115 -> 61 CPU-ms, llama_tiny's ring 234 -> 120) and the split of each row
# is what they compare. Every data replica still gets whole rows (16 / 8 = 2 on data:8).
ROWS = {"train.batch_size": "16"}
# And the language models' rows 64 positions long, not the tiny configs' 128: a layout splits
# a row's positions only under context parallelism (whose tests choose their own lengths),
# so the comparisons check the same splits at half the tokens a step. Both sides of every
# comparison take it (conftest's one-device reference included).
TOKENS = {**ROWS, "model.seq_len": "64"}
# A language model's layout comparison: TOKENS at the full learning rate. (Not every run of
# TOKENS: a test comparing parameters after a few steps keeps the warm-up, as Adam's
# m / sqrt(v) turns float32 rounding in near-zero gradients into updates of lr's size.)
COMPARED = {**TOKENS, **FULL_LR}
TOKEN_FLAGS = [f"--config.{k}={v}" for k, v in TOKENS.items()]  # the same, for a command line

# XLA:CPU's emitters as users get them. The suite compiles with the classic loop emitters
# (tests/conftest.py), which turn a few ops into loops (a scatter-add into a `while`) and
# so move buffers: a test that reads a step's loops or its temporary bytes compiles it so.
USERS_EMITTERS = {"xla_cpu_use_fusion_emitters": True, "xla_llvm_disable_expensive_passes": False}


def compiled_as_users_compile(exp: Experiment):
    """exp's train step compiled with USERS_EMITTERS, those this jaxlib has (the rest of the
    suite's flags kept)."""
    return exp.train_step.lower(exp.abstract_state(), exp.abstract_batch()).compile(known_options(USERS_EMITTERS))


def devices_for(mesh: str) -> list:
    """The first devices, as many as MESH ("data:2,tensor:4") has."""
    return jax.devices()[:int(np.prod([int(p.split(":")[1]) for p in mesh.split(",")]))]


def assert_refused(name: str, overrides: dict, words: list[str]) -> None:
    """Building config `name` with `overrides` stops with a UserError that says each of
    `words` (what was wrong, and the fix)."""
    cfg = configured(name, **overrides)
    with pytest.raises(UserError) as e:
        Experiment.build(cfg, devices=devices_for(cfg.mesh.shape))
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def _gradients(exp, params, batch) -> tuple[float, dict]:
    """(loss, gradients) of `batch` by a plain jax.grad program, on the host; a pipelined
    model's gradients put back in model layer order. The program runs once, so it compiles
    with the planner's analysis options (compile_options.ANALYSIS_OPTIONS: the same HLO, 3x
    faster to compile, slower code)."""
    objective = step_lib.make_objective(exp.model, exp.layout, exp.mesh)
    value_and_grad = jax.jit(jax.value_and_grad(lambda p, b: objective(p, {}, b, None)[0]),
                             in_shardings=(exp.shardings.params, exp.batch_sharding),
                             compiler_options=analysis_options())
    loss, grads = jax.device_get(value_and_grad(params, batch))
    if exp.model.pipeline is not None:
        grads[exp.model.stacked] = pipeline.from_stages(grads[exp.model.stacked], exp.model.pipeline)
    return float(loss), grads


def stepped(exp, n, state=None, step=None):
    """Yields (state, metrics) after each of `n` train steps from `state` (default: a fresh
    initial state), on the config's batches from the first. `step`: the train step to run
    (default exp.train_step; `exp.compile(analysis=True)` compiles once, 3-4x faster, for
    the few steps a test runs)."""
    state = exp.init_state() if state is None else state
    step = exp.train_step if step is None else step
    batches = exp.train_batches()
    for _ in range(n):
        state, metrics = step(state, exp.put_batch(next(batches)))
        yield state, metrics


def step_for(exp, steps):
    """The train step a run of `steps` steps takes: compiled with the analysis options up
    to compile_options.SHORT_RUN_STEPS (LLVM -O0, as `plan --verify` does: where it pays, and why
    not `train`), else exp.train_step (None, stepped's default)."""
    return exp.compile(analysis=True) if steps <= SHORT_RUN_STEPS else None


def loss_curve(exp, n, step=None) -> np.ndarray:
    """The loss of each of `n` steps from a fresh initial state (`stepped`)."""
    return np.array([float(m["loss"]) for _, m in stepped(exp, n, step=step)])


def loss_and_grads(cfg, devices=None, mesh_shape=None):
    """(loss, gradients) of the first training batch (_gradients)."""
    exp = Experiment.build(cfg, devices=devices, mesh_shape=mesh_shape)
    return _gradients(exp, exp.init_state().params, exp.put_batch(next(exp.train_batches())))


def losses_and_grads(cfg, devices=None, mesh_shape=None, steps=STEPS):
    """Loss of each of `steps` steps, and the gradients at step 1 from a plain jax.grad
    program (_gradients). Up to SHORT_RUN_STEPS steps, compiled with the analysis options."""
    exp = Experiment.build(cfg, devices=devices, mesh_shape=mesh_shape)
    state = exp.init_state()
    _, grads = _gradients(exp, state.params, exp.put_batch(next(exp.train_batches())))
    losses = [float(metrics["loss"]) for _, metrics in stepped(exp, steps, state, step_for(exp, steps))]
    return np.array(losses), grads


def trained(cfg, steps=STEPS, devices=None):
    """(loss of each of `steps` steps, step 1's gradients) of `cfg` on its own mesh (or
    `devices`), as losses_and_grads gives them, read off the train step alone: one program
    compiled, not a gradient program beside it (run/verify.py's step_1_gradients, as --verify
    reads them). Up to SHORT_RUN_STEPS steps, compiled with the analysis options."""
    assert cfg.optim.name == "adamw", "step 1's gradients are read from Adam's first moment"
    exp = Experiment.build(cfg, devices=devices)
    losses, grads = [], None
    for state, metrics in stepped(exp, steps, step=step_for(exp, steps)):
        losses.append(float(metrics["loss"]))
        if grads is None:
            grads = step_1_gradients(exp, state, float(metrics["grad_norm"]))
    return np.array(losses), grads


def assert_same_training(name, result, reference):
    """Losses of every step within 1e-4 (relative), the model learning, and the first
    step's gradients within float tolerance, of a layout against one device."""
    (losses, grads), (ref_losses, ref_grads) = result, reference
    rel = np.abs(losses - ref_losses) / np.abs(ref_losses)
    assert rel.max() < 1e-4, f"{name}: loss sequence differs, max rel diff {rel.max():.2e}"
    assert losses[-1] < losses[0] - 0.3, f"{name}: the model should be learning, {losses[0]:.3f} -> {losses[-1]:.3f}"
    jax.tree.map(lambda g, r: np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6), grads, ref_grads)


def run(name, overrides, mesh, steps=STEPS):
    """trained(): config NAME with OVERRIDES on MESH's devices, step 1's gradients read
    off its train step."""
    cfg = configured(name, **overrides, **{"mesh.shape": mesh})
    return trained(cfg, steps, devices=devices_for(mesh))


def assert_equal_training(label, got, ref):
    """Every step's loss within relative 1e-5 of one device's, the model learning, and the
    first step's gradients within float32 rounding."""
    (losses, grads), (ref_losses, ref_grads) = got, ref
    rel = np.abs(losses - ref_losses) / np.abs(ref_losses)
    print(f"{label}: max relative loss difference {rel.max():.2e} over {len(losses)} steps, "
          f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")  # the figures docs and notes quote (pytest -s)
    assert rel.max() < 1e-5, f"{label}: loss sequence differs, max rel diff {rel.max():.2e}"
    assert losses[-1] < losses[0] - 0.3, f"{label}: the model should be learning"
    jax.tree.map(lambda g, r: np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6), grads, ref_grads)
