"""Language modelling: next-token prediction over rows of tokens.

    batch   tokens [B, T+1] int32 (inputs tokens[:, :-1], targets tokens[:, 1:])
    loss    mean next-token cross entropy in float32 (meshtrain/step/loss.py: whole, or a chunk
            of positions at a time with the model's hidden/project seam), plus in training
            a model's auxiliary losses (a mixture of experts' router losses), whose
            statistics are the metrics
    unit    tokens: T per row
"""

from __future__ import annotations

from meshtrain.step import loss as loss_lib
from meshtrain.step.tasks.task import Field


class LanguageModelling:
    name = "lm"
    unit = "tokens"
    eval_metrics: tuple[str, ...] = ()

    @classmethod
    def from_data(cls, info: dict) -> "LanguageModelling":
        return cls()

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
        return loss_lib.next_token_loss(module, inputs, targets, key, run_layers, constrain=constrain,
                                        layout=layout, mesh=mesh, loss_chunk=loss_chunk, train=train)
