"""Sampling tests' shared pieces: prompts, a model made decisive, greedy decoding by
recomputation, a sample's ids."""

import jax
import numpy as np

from meshtrain import sample


N_NEW = 12
PROMPT_LEN = 5


@jax.jit  # one program, not one per leaf shape
def peaky(params):
    """x10 on every weight matrix: with GPT-2's 0.02 init the logits are nearly flat and
    attention nearly uniform, so a broken cache could leave the argmax unchanged."""
    def one(path, a):
        name = str(path[-1].key)
        return a if name in ("scale", "bias") or name.startswith("b_") else a * 10
    return jax.tree_util.tree_map_with_path(one, params)


def make_prompts(rng, n: int, vocab: int) -> np.ndarray:
    """[n, PROMPT_LEN] rows that differ but end on the same token: only the context in the
    cache can make their continuations differ."""
    prompts = rng.integers(0, vocab, (n, PROMPT_LEN))
    prompts[:, -1] = prompts[0, -1]
    return prompts


def greedy_by_recompute(model, params, prompts: np.ndarray, n_new: int) -> np.ndarray:
    """[n, n_new]: the argmax at the last position of a full forward pass, appended, n_new
    times. One fixed-length buffer: causal attention makes the later zeros invisible."""
    fwd = jax.jit(lambda p, t: model.bind(p)(t))
    n, p = prompts.shape
    buf = np.zeros((n, p + n_new), np.int32)
    buf[:, :p] = prompts
    for i in range(n_new):
        buf[:, p + i] = np.asarray(fwd(params, buf))[:, p + i - 1].argmax(-1)
    return buf[:, p:]


def samples(out: str) -> list[list[int]]:
    """stdout of an ids-only sample -> the ids of each sample."""
    chunks = out.split(sample.SEPARATOR + "\n")
    assert chunks[-1] == "", out
    return [[int(i) for i in c.split()] for c in chunks[:-1]]
