"""Checkpoint tests' shared pieces: a short run, its losses, a built experiment, a copied
workdir, restores compared, a small disk."""

import contextlib
import pathlib
import shutil
import subprocess

import jax
import numpy as np

from meshtrain.checkpoints import store as checkpoint_lib
from meshtrain.train import main
from support.configs import configured
from support.training import TOKEN_FLAGS, TOKENS


# TOKENS a step (16 rows of 64 positions), as the layout comparisons train: the runs' CPU is in
# proportion to their tokens, and what these tests compare is what a checkpoint carries.
RUN = ["--config.train.steps=20", "--config.train.log_every=1", "--config.train.eval_every=0",
       "--config.checkpoint.every=0", *TOKEN_FLAGS]


def train(name, workdir, *extra):
    return main([f"--config={name}", *RUN, *extra, f"--workdir={workdir}"])


def build(name, **overrides):
    """NAME's config as RUN trains it, with OVERRIDES."""
    return configured(name, **{"train.steps": 20, **TOKENS, **overrides})


def copy(src, tmp_path):
    dst = tmp_path / "w"
    shutil.copytree(src, dst)
    (dst / "meshtrain.lock").unlink()
    return dst


def restore_both(ckpt_dir, exp_a, exp_b, step=10):
    ck = checkpoint_lib.Checkpointer(ckpt_dir, every=0, keep=3, use_async=False)
    try:
        return ck.restore(step, exp_a), ck.restore(step, exp_b)
    finally:
        ck.close()


def assert_same_values(a, b):
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(a), jax.device_get(b))


def assert_requested_shardings(state, exp):
    for leaf, want in zip(jax.tree.leaves(state), jax.tree.leaves(exp.shardings), strict=True):
        assert leaf.sharding == want


@contextlib.contextmanager
def small_disk(path: pathlib.Path, size: str = "2560k"):
    """A tmpfs of `size` mounted at `path` (made here) and unmounted after; None where this
    process may not mount one (mounting needs root, and CAP_SYS_ADMIN in a container)."""
    path.mkdir(parents=True, exist_ok=True)
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                                 capture_output=True).returncode == 0
    except OSError:  # no mount command
        mounted = False
    try:
        yield path if mounted else None
    finally:
        if mounted and subprocess.run(["umount", str(path)], capture_output=True).returncode:
            subprocess.run(["umount", "--lazy", str(path)], capture_output=True)  # a file still open
