"""Training a config for a few steps and comparing the result with another layout's: the
helpers of the equivalence tests (every layout equals one device)."""

import jax
import numpy as np

from meshtrain import pipeline, step as step_lib
from meshtrain.experiment import Experiment

STEPS = 20


def devices_for(mesh: str) -> list:
    """The first devices, as many as MESH ("data:2,tensor:4") has."""
    return jax.devices()[:int(np.prod([int(p.split(":")[1]) for p in mesh.split(",")]))]


def loss_and_grads(cfg, devices=None, mesh_shape=None):
    """(loss, gradients) of the first training batch, on the host; a pipelined model's
    gradients are put back in model layer order."""
    exp = Experiment.build(cfg, devices=devices, mesh_shape=mesh_shape)
    state = exp.init_state()
    batch = exp.put_batch(next(exp.train_batches()))
    loss_fn = step_lib.make_loss_fn(exp.model, exp.layout, exp.mesh)
    value_and_grad = jax.jit(jax.value_and_grad(lambda p, b: loss_fn(p, b, None)),
                             in_shardings=(exp.shardings.params, exp.batch_sharding))
    loss, grads = jax.device_get(value_and_grad(state.params, batch))
    if exp.model.pipeline is not None:
        grads[exp.model.stacked] = pipeline.from_stages(grads[exp.model.stacked], exp.model.pipeline)
    return float(loss), grads


def losses_and_grads(cfg, devices=None, mesh_shape=None, steps=STEPS):
    """Loss of each of `steps` steps, and the gradients at step 1 (gathered to host)."""
    exp = Experiment.build(cfg, devices=devices, mesh_shape=mesh_shape)
    state = exp.init_state()
    batches = exp.train_batches()
    first = exp.put_batch(next(batches))
    loss_fn = step_lib.make_loss_fn(exp.model, exp.layout, exp.mesh)
    grad_fn = jax.jit(jax.grad(lambda p, b: loss_fn(p, b, None)),
                      in_shardings=(exp.shardings.params, exp.batch_sharding))
    grads = jax.device_get(grad_fn(state.params, first))
    if exp.model.pipeline is not None:  # compare in model layer order
        grads[exp.model.stacked] = pipeline.from_stages(grads[exp.model.stacked], exp.model.pipeline)
    losses = []
    state, metrics = exp.train_step(state, first)
    losses.append(float(metrics["loss"]))
    for _ in range(steps - 1):
        state, metrics = exp.train_step(state, exp.put_batch(next(batches)))
        losses.append(float(metrics["loss"]))
    return np.array(losses), grads


def assert_same_training(name, result, reference):
    """Losses of every step within 1e-4 (relative), the model learning, and the first
    step's gradients within float tolerance, of a layout against one device."""
    (losses, grads), (ref_losses, ref_grads) = result, reference
    rel = np.abs(losses - ref_losses) / np.abs(ref_losses)
    assert rel.max() < 1e-4, f"{name}: loss sequence differs, max rel diff {rel.max():.2e}"
    assert losses[-1] < losses[0] - 0.5, f"{name}: the model should be learning over 20 steps"
    jax.tree.map(lambda g, r: np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6), grads, ref_grads)


def run(name, overrides, mesh, steps=STEPS):
    """losses_and_grads of config NAME with OVERRIDES on MESH's devices."""
    from conftest import configured
    cfg = configured(name, **overrides, **{"mesh.shape": mesh})
    return losses_and_grads(cfg, devices=devices_for(mesh), steps=steps)


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
