"""data.packing=documents: a window of several documents computes what the documents
compute alone (attention masked per document, positions restarting, the boundary target
skipped), on every layout family as on one device (models/documents.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshtrain.errors import UserError
from meshtrain.models import documents
from meshtrain.models.hook import UNSHARDED
from meshtrain.parallel.pipeline import scan as pipeline
from meshtrain.run.compile_options import analysis_options
from meshtrain.run.experiment import Experiment
from meshtrain.step import train_step as step_lib
from meshtrain.step.tasks import LanguageModelling
from support.configs import configured
from support.training import devices_for

ROWS = 16  # divides over the 1F1B case's 4 microbatches x 4 batch shards


def windows(seq_len: int, eot: int, vocab: int, rows: int = ROWS, seed: int = 0) -> np.ndarray:
    """[rows, seq_len + 1] int32: each row three documents, each ending with `eot`, of
    random lengths (at least 3 tokens) that fill the window exactly."""
    rng = np.random.default_rng(seed)
    out = rng.integers(0, eot, (rows, seq_len + 1)).astype(np.int32)  # ids below eot: no stray ends
    for r in range(rows):
        a, b = sorted(rng.choice(np.arange(3, seq_len - 2), 2, replace=False))
        for end in (a - 1, b - 1, seq_len):
            out[r, end] = eot
    return out


def split_documents(row: np.ndarray, eot: int) -> list[np.ndarray]:
    ends = np.flatnonzero(row == eot)
    return np.split(row, ends[:-1] + 1)


def experiment(name: str, mesh: str, **overrides) -> Experiment:
    cfg = configured(name, **{"mesh.shape": mesh, **overrides})
    return Experiment.build(cfg, devices=devices_for(mesh))


def packed_loss_and_grads(exp: Experiment, task, batch) -> tuple[float, dict]:
    """The task's loss of `batch` and its gradients, as the train step computes them."""
    objective = step_lib.make_objective(exp.model, exp.layout, exp.mesh, task, exp.cfg.train.loss_chunk)
    value_and_grad = jax.jit(jax.value_and_grad(lambda p, b: objective(p, {}, b, None)[0]),
                             in_shardings=(exp.shardings.params, exp.batch_sharding),
                             compiler_options=analysis_options())
    loss, grads = jax.device_get(value_and_grad(exp.init_state().params, batch))
    if exp.model.pipeline is not None:
        grads[exp.model.stacked] = pipeline.from_stages(grads[exp.model.stacked], exp.model.pipeline)
    return float(loss), grads


def alone_loss_and_grads(exp: Experiment, docs: list[np.ndarray]) -> tuple[float, dict]:
    """The sum over `docs` of each document's summed next-token loss, run alone (a batch
    of one row, positions from 0), and its gradients."""
    def total(params):
        module = exp.model.bind(params)
        return sum(LanguageModelling().loss(module, d[None], None, None, constrain=UNSHARDED, layout=exp.layout,
                                            mesh=exp.mesh, loss_chunk=0, train=True)[0] * (len(d) - 1)
                   for d in map(jnp.asarray, docs))
    loss, grads = jax.device_get(jax.jit(jax.value_and_grad(total), compiler_options=analysis_options())(
        exp.init_state().params))
    return float(loss), grads


@pytest.fixture(scope="module", params=["gpt2_tiny_dp8", "llama_tiny_dp8"])
def one_device(request):
    """(experiment on one device, its documents task, a batch of packed windows)."""
    exp = experiment(request.param, "data:1")
    vocab = exp.model.cfg.vocab_size
    task = LanguageModelling(eot_id=vocab - 1)
    return exp, task, windows(exp.model.cfg.seq_len, vocab - 1, vocab)


def test_a_packed_window_equals_its_documents_alone(one_device):
    exp, task, batch = one_device
    batch = batch[:2]
    loss, grads = packed_loss_and_grads(exp, task, batch)
    docs = [d for row in batch for d in split_documents(row, task.eot_id)]
    assert len(docs) == 6 and sum(len(d) - 1 for d in docs) == batch.size - 2 * 3
    alone, alone_grads = alone_loss_and_grads(exp, docs)
    positions = batch.shape[0] * (batch.shape[1] - 1)  # the loss divides by B T
    np.testing.assert_allclose(loss * positions, alone, rtol=1e-5)
    jax.tree.map(lambda g, r: np.testing.assert_allclose(g * positions, r, rtol=2e-4, atol=1e-5 * np.abs(r).max()),
                 grads, alone_grads)


def test_documents_never_see_each_other(one_device):
    """Changing the first document of a row changes its own logits and no other's."""
    exp, task, batch = one_device
    module = exp.model.bind(exp.init_state().params)

    def logits(tokens):
        constrain, _ = task.documents(jnp.asarray(tokens), UNSHARDED)
        return np.asarray(module(jnp.asarray(tokens[:, :-1]), constrain))

    row = batch[:1]
    first_end = int(np.flatnonzero(row[0] == task.eot_id)[0])
    changed = row.copy()
    changed[0, :first_end] = (changed[0, :first_end] + 1) % task.eot_id
    a, b = logits(row), logits(changed)
    np.testing.assert_array_equal(a[0, first_end + 1:], b[0, first_end + 1:])
    assert np.abs(a[0, :first_end] - b[0, :first_end]).max() > 1e-3


CASES = {  # name: (config, mesh, overrides)
    "gpt2_dp_tp": ("gpt2_tiny_dp8", "data:2,tensor:4", {"layout": "dp_tp"}),
    "gpt2_fsdp_loss_chunks": ("gpt2_tiny_dp8", "fsdp:8", {"layout": "fsdp", "train.loss_chunk": 16}),
    "gpt2_ring": ("gpt2_tiny_dp8", "data:2,context:4", {"layout": "dp_cp", "model.context_attention": "ring"}),
    "gpt2_1f1b": ("gpt2_tiny_pp2_dp4", "data:4,stage:2", {"pipeline.schedule": "1f1b"}),
    "llama_dp_tp_sp": ("llama_tiny_dp8", "data:2,tensor:4", {"layout": "dp_tp_sp"}),
    "llama_ring_gqa": ("llama_tiny_dp8", "context:4,tensor:2", {"layout": "dp_tp_cp", "model.context_attention": "ring"}),
    "llama_allgather": ("llama_tiny_dp8", "data:2,context:4", {"layout": "dp_cp"}),
    "llama_gpipe": ("llama_tiny_pp2_dp4", "data:4,stage:2", {}),
}


@pytest.fixture(scope="module")
def references():
    """One device's packed loss and gradients, per (family, layer count): computed once."""
    return {}


@pytest.mark.parametrize("case", CASES)
def test_packed_documents_on_a_layout_equal_one_device(case, references):
    name, mesh, overrides = CASES[case]
    exp = experiment(name, mesh, **overrides)
    cfg = exp.model.cfg
    vocab, key = cfg.vocab_size, (exp.model.family.name, cfg.num_layers, cfg.seq_len)
    task = LanguageModelling(eot_id=vocab - 1)
    batch = windows(cfg.seq_len, vocab - 1, vocab, seed=1)
    loss, grads = packed_loss_and_grads(exp, task, batch)
    if key not in references:
        ref = experiment(name, "data:1", **{"layout": "dp", "pipeline.microbatches": 0, "model.num_layers": key[1]})
        references[key] = packed_loss_and_grads(ref, task, batch)
    ref_loss, ref_grads = references[key]
    assert abs(loss - ref_loss) / ref_loss < 1e-5, (loss, ref_loss)
    jax.tree.map(lambda g, r: np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-6 * np.abs(r).max()),
                 grads, ref_grads)


def test_segments_positions_and_weights_of_a_window():
    tokens = jnp.asarray([[5, 9, 7, 9, 9, 1, 2]])  # eot 9: documents [5 9] [7 9] [9] [1 2]
    docs, weights = documents.of_window(tokens, 9, lambda a: a)
    np.testing.assert_array_equal(docs.segments, [[0, 0, 1, 1, 2, 3]])
    np.testing.assert_array_equal(docs.positions, [[0, 1, 0, 1, 0, 0]])
    np.testing.assert_array_equal(weights, [[1, 0, 1, 0, 0, 1]])


def test_packing_needs_documents_and_a_language_model():
    with pytest.raises(UserError, match="data.packing=documents keeps documents apart.*synthetic"):
        Experiment.build(configured("gpt2_tiny_dp8", **{"mesh.shape": "data:1", "data.packing": "documents"}),
                         devices=devices_for("data:1"))
    with pytest.raises(UserError, match=r"data.packing='files' is not a way.*concat, documents"):
        documents.check_packing("files", {})
    with pytest.raises(UserError, match="task is 'classify'"):
        documents.check_packing("documents", {"eot_id": 3}, "classify")
