"""Language modelling: next-token prediction over rows of tokens.

    batch   tokens [B, T+1] int32 (inputs tokens[:, :-1], targets tokens[:, 1:])
    loss    mean next-token cross entropy in float32 (meshtrain/step/loss.py: whole, or a chunk
            of positions at a time with the model's hidden/project seam), plus in training
            a model's auxiliary losses (a mixture of experts' router losses), whose
            statistics are the metrics
    unit    tokens: T per row

With data.packing=documents (models/documents.py) the task derives each window's
documents from its end-of-text ids and hands them to the model on its `Constrain`; the
target that crosses a boundary weighs 0. The loss stays a sum divided by the B T
positions, so it is the same whatever cuts the batch (replicas, microbatches, pipeline
stages), and B T times a packed window's loss is the sum of its documents' summed
losses, each run alone.
"""

from __future__ import annotations

from meshtrain.models import documents, family, stack
from meshtrain.step import loss as loss_lib
from meshtrain.step.tasks.task import Field


class LanguageModelling:
    name = "lm"
    unit = "tokens"
    eval_metrics: tuple[str, ...] = ()

    def __init__(self, eot_id: int | None = None):
        self.eot_id = eot_id  # None: windows packed as one stream (data.packing=concat)

    @classmethod
    def from_data(cls, info: dict, data_cfg=None) -> "LanguageModelling":
        return cls(documents.check_packing((data_cfg or {}).get("packing", "concat"), info))

    def documents(self, tokens_bt1, constrain):
        """tokens [B, T+1] -> (constrain, with the window's documents when they are kept
        apart, and the targets' weights [B, T] in position order, or None)."""
        if self.eot_id is None:
            return constrain, None
        docs, weights = documents.of_window(tokens_bt1, self.eot_id, lambda a: stack.stored(a, constrain))
        return constrain.with_documents(docs), weights

    def batch_fields(self, cfg, rows: int) -> Field:
        return Field((rows, cfg.seq_len + 1), "int32", ("batch", None))

    def units_per_example(self, cfg) -> int:
        return cfg.seq_len

    @staticmethod
    def flops(family):
        return family.flops_per_token

    @staticmethod
    def source_args(dims: dict) -> dict:
        return {"seq_len": dims["seq_len"]}  # windows of seq_len + 1 tokens

    @staticmethod
    def check_config(train, dims: dict) -> None:
        loss_lib.check_config(train, dims["seq_len"])  # train.loss_chunk against the length

    def loss(self, module, tokens, key, run_layers, *, constrain, layout, mesh, loss_chunk, train):
        """(mean loss, statistics {name: []}) of a bound model on tokens [B, T+1]: inputs
        tokens[:, :-1] against targets tokens[:, 1:]. Over whole logits when the model has no
        hidden/project seam; else `hidden` once and the head (loss.head_loss: whole, or
        loss_chunk positions at a time). A model with auxiliary losses (`hidden_aux`,
        models/family.py) adds them in training and reports their statistics. Each target
        weighs what `documents` says, and the sum is divided by B T all the same (module
        docstring)."""
        inputs_bt, targets_bt = tokens[:, :-1], tokens[:, 1:]
        constrain, weights_bt = self.documents(tokens, constrain)
        if not loss_lib.has_seam(module):
            return loss_lib.cross_entropy(module(inputs_bt, constrain, key, run_layers), targets_bt, weights_bt), {}
        # hidden's rows are in the layout's storage order (context parallelism reorders them,
        # parallel/sequence.py); the targets are put in the same order, so nothing is re-sorted.
        aux, stats = 0.0, {}
        if family.implements(module, family.AuxLosses):
            h_btd, w, aux, stats = module.hidden_aux(inputs_bt, constrain, key, run_layers)
        else:
            h_btd, w = module.hidden(inputs_bt, constrain, key, run_layers)
        targets_bt = stack.stored(targets_bt, constrain)
        weights_bt = None if weights_bt is None else stack.stored(weights_bt, constrain)
        ce = loss_lib.head_loss(module, h_btd, w, targets_bt, weights_bt, constrain, layout, mesh,
                                loss_chunk=loss_chunk)
        return (ce + aux if train else ce), stats
