"""One batch's loss and gradients from a config, for tests that compare implementations."""

import jax

from meshtrain import pipeline, step as step_lib
from meshtrain.experiment import Experiment


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
