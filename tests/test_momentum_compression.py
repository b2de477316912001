"""The momentum compressed instead of the gradient (train.compress_momentum,
parallel/momentum_compression.py): the warm-up steps reduce exactly, after them the
optimizer's momentum is the compressed one (a sign and a scale a block), Adam's variance
frozen from the warm-up's end is optax's Adam before it, and what cannot take it is
refused with the fix."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from meshtrain.errors import UserError
from meshtrain.parallel import compression, momentum_compression
from meshtrain.run.experiment import Experiment
from support.configs import configured
from support.training import TOKENS, assert_refused, stepped

WARMUP = 2
ON = {"mesh.dcn": "data:2", "optim.grad_clip": "0", "train.grad_compression": "onebit",
      "train.compress_momentum": "true", "train.compress_warmup": str(WARMUP)}


def history(**overrides) -> list[tuple[float, float, np.ndarray]]:
    """Per step: (loss, the largest |feedback buffer|, Adam's first moment of the first MLP
    matrix [2, 64, 256]), read before the next step takes the state (it is donated)."""
    exp = Experiment.build(configured("gpt2_tiny_dp8", **{"train.steps": "4", **TOKENS, **overrides}))
    out = []
    for state, m in stepped(exp, WARMUP + 2, step=exp.compile(analysis=True)):
        buffers = max((float(jnp.abs(x).max()) for x in jax.tree.leaves(state.comm)), default=0.0)
        mu = optax.tree_utils.tree_get(state.opt_state, "mu")["blocks"]["mlp"]["w_fc"]
        out.append((float(m["loss"]), buffers, np.abs(np.asarray(jax.device_get(mu)))))
    return out


def test_warm_up_steps_are_exact_and_then_the_momentum_is_a_sign_and_a_scale_a_block():
    """Until train.compress_warmup the step reduces as train.grad_dtype=float32 does (the
    replicas' gradients summed in float32), to the bit, the buffers untouched; the first
    compressed step leaves Adam's first moment (1 - b1) x the compressed mean: a leaf's
    values take one magnitude per 64-value block (the gradient's compression would leave
    up to 2^3 a block after three steps, the exact reduction about one a value)."""
    exact = history(**{k: v for k, v in ON.items() if not k.startswith("train.")}, **{"train.grad_dtype": "float32"})
    moved = history(**ON)
    assert [loss for loss, _, _ in moved[:WARMUP + 1]] == [loss for loss, _, _ in exact[:WARMUP + 1]]
    assert moved[WARMUP + 1][0] != exact[WARMUP + 1][0]
    assert moved[WARMUP - 1][1] == 0 and moved[WARMUP][1] > 0

    def magnitudes(mu):  # distinct |mu| to 15 bits of the mantissa (a value near a boundary may count twice)
        return len(np.unique(mu.astype(np.float32).view(np.int32) >> 8))
    blocks = moved[WARMUP][2].size // compression.BLOCK["onebit"] + 8
    print("distinct |mu|:", magnitudes(moved[WARMUP][2]), "against", magnitudes(exact[WARMUP][2]), "blocks", blocks)
    assert magnitudes(moved[WARMUP][2]) <= 2 * blocks
    assert magnitudes(exact[WARMUP][2]) > 10 * 2 * blocks


def test_frozen_variance_is_optax_adam_until_the_freeze_and_holds_its_variance_after():
    b1, b2, eps, freeze = 0.9, 0.95, 1e-8, 3
    frozen, adam = momentum_compression.frozen_variance_adam(b1, b2, eps, freeze), optax.scale_by_adam(b1, b2, eps)
    params = {"w": jnp.zeros((5, 7))}
    s1, s2 = frozen.init(params), adam.init(params)
    grads = [{"w": jax.random.normal(jax.random.key(i), (5, 7))} for i in range(6)]
    for i, g in enumerate(grads):
        u1, s1 = frozen.update(g, s1)
        u2, s2 = adam.update(g, s2)
        if i < freeze:
            np.testing.assert_array_equal(u1["w"], u2["w"])
            np.testing.assert_array_equal(s1.nu["w"], s2.nu["w"])
            held = s1.nu["w"]
        else:
            np.testing.assert_array_equal(s1.nu["w"], held)
            np.testing.assert_array_equal(s1.mu["w"], s2.mu["w"])
            want = (s1.mu["w"] / (1 - b1 ** (i + 1))) / (jnp.sqrt(held / (1 - b2 ** freeze)) + eps)
            np.testing.assert_allclose(u1["w"], want, rtol=1e-6)


def test_the_keys_types_are_checked():
    """A config file may give a string where the command line's parser would keep the type."""
    train = types.SimpleNamespace(grad_compression="onebit", grad_dtype="", error_feedback=True,
                                  compress_momentum=True, compress_warmup=10, offload="")
    optim = types.SimpleNamespace(name="adamw", grad_clip=0.0, momentum=0.9, b1=0.9)
    momentum_compression.check(train, optim)
    for key, value, words in (("compress_momentum", "yes", "must be true or false"),
                              ("compress_warmup", -1, "a count of steps >= 0")):
        with pytest.raises(UserError, match=f"train.{key}={value!r}: {words}"):
            momentum_compression.check(types.SimpleNamespace(**{**vars(train), key: value}), optim)


@pytest.mark.parametrize("name,overrides,words", [
    ("gpt2_tiny_dp8", {"train.compress_momentum": "true"}, ["no compression to move"]),
    ("gpt2_tiny_dp8", {**ON, "optim.grad_clip": "1.0"}, ["optim.grad_clip=1.0", "set optim.grad_clip=0"]),
    ("gpt2_tiny_dp8", {**ON, "train.compress_warmup": "0"}, ["variance", "train.compress_warmup"]),
    ("gpt2_tiny_dp8", {**ON, "optim.name": "lamb"}, ["optim.name=lamb", "adamw"]),
    ("gpt2_tiny_dp8", {**ON, "optim.name": "sgd", "optim.momentum": "0"}, ["sgd with optim.momentum > 0"]),
    ("gpt2_tiny_dp8_zero1", ON, ["split differently", "dp, dp_tp"]),
    ("gpt2_tiny_dp8", {**ON, "diloco.every": "4"}, ["diloco.every", "compress_momentum=false"]),
])
def test_what_cannot_compress_its_momentum_is_refused_with_the_fix(name, overrides, words):
    assert_refused(name, overrides, words)
