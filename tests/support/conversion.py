"""Hugging Face conversion tests' shared pieces: logits on both sides, bitwise exports,
fine-tuning configs and their first loss."""

import jax
import numpy as np
import pytest

from meshtrain import config as config_lib, tree_paths
from meshtrain.checkpoints import init_from, reading
from meshtrain.run.compile_options import analysis_options
from meshtrain.run.experiment import Experiment
from meshtrain.step import state as state_lib
from support import hf_models


# Logits agree to this fraction of the largest logit (float32 on both sides; we see <= 7e-7).
LOGIT_TOL = 1e-5


def quiet(_line):
    pass


def meshtrain_logits(ckpt, tokens) -> np.ndarray:
    """Logits of a checkpoint's model on one device in float32, params read leaf by leaf
    (vocabulary padding dropped). The forward runs once: compiled with the planner's
    analysis options (LLVM's optimisations and XLA:CPU's fusion emitters off, the same HLO)."""
    src = init_from.read(ckpt)
    model = state_lib.abstract_model(src.model_config())
    axes = tree_paths.flat(model.axes, is_leaf=lambda x: isinstance(x, tuple))
    vocab = src.architecture["vocab_size"]

    def leaf(path):
        x = reading.read_leaf(src, path, model.stacked).astype(np.float32)
        return x[tuple(slice(0, vocab) if a == "vocab" else slice(None) for a in axes[path])]
    params = reading.nest({p: leaf(p) for p in axes})
    return np.asarray(jax.jit(lambda p, t: model.bind(p)(t), compiler_options=analysis_options())(params, tokens))


def assert_logits_match(ours, theirs):
    err = np.abs(ours - theirs).max() / np.abs(theirs).max()
    assert err <= LOGIT_TOL, f"logits differ by {err:.2e} of the largest"


def safetensors_of(directory) -> dict:
    """{name: (dtype, shape, raw bytes)} of every tensor in a directory's safetensors."""
    from meshtrain.hf.safetensors_io import Reader
    reader = Reader(directory)
    try:
        return {n: (reader.dtype_name(n), reader.shape(n), reader.get(n).tobytes()) for n in reader.keys()}
    finally:
        reader.close()


def assert_bitwise_equal(original, exported):
    a, b = safetensors_of(original), safetensors_of(exported)
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name][:2] == b[name][:2], name
        assert a[name][2] == b[name][2], f"{name} differs"


TOKENS = np.random.default_rng(0).integers(0, hf_models.VOCAB, (2, 64))


def finetune_config(ckpt, mesh: str, layout: str, pipeline_microbatches: int = 0, **model):
    """A run starting from `ckpt`: model.name and the architecture follow it (validate)."""
    src = init_from.read(ckpt)
    c = config_lib.base(size="tiny", mesh=mesh, layout=layout)
    c.init["from"] = str(ckpt)
    c.model.update(model)
    c.pipeline.microbatches = pipeline_microbatches
    c.train.update(batch_size=16, eval_every=0, steps=2)
    return src, c


def first_loss(src, cfg, devices=None, mesh_shape=None):
    """The loss of the first training step of a run starting from checkpoint `src`, and its
    batch; its state starts at step 0 with zero moments, in the run's shardings."""
    exp = Experiment.build(cfg, devices=devices, mesh_shape=mesh_shape)
    state = reading.init_state(src, exp)
    assert int(state.step) == 0
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]  # Adam's mu and nu
    assert moments and all(not np.asarray(x).any() for x in moments)
    jax.tree.map(lambda a, s: a.sharding.is_equivalent_to(s, a.ndim) or pytest.fail(f"{a.sharding} != {s}"),
                 state.params, exp.shardings.params)
    batch = next(exp.train_batches())
    # One step: compiled with the planner's analysis options (the same partitioned HLO,
    # LLVM's optimisations and XLA:CPU's fusion emitters off, 3-4x faster to compile).
    _, metrics = exp.compile(analysis=True)(state, exp.put_batch(batch))
    return float(metrics["loss"]), batch


LAYOUTS = {"dp8": ("data:8", "dp", 0), "dp2_tp4": ("data:2,tensor:4", "dp_tp", 0),
           "pp2_dp4": ("data:4,stage:2", "dp_pp", 4)}
