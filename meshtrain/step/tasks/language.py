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

from meshtrain.models import documents, stack
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
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        constrain, weights = self.documents(tokens, constrain)
        return loss_lib.next_token_loss(module, inputs, targets, key, run_layers, constrain=constrain,
                                        layout=layout, mesh=mesh, loss_chunk=loss_chunk, train=train,
                                        weights_bt=weights)
