"""The model seam: what the core (state, step, pipeline, checkpoints, metrics) knows of
a model. A model is a file in meshtrain/models/ that builds a `Family` and calls
`register(family)`; nothing else in meshtrain names it.

A family gives:

  config      its config dataclass, a subclass of `ModelConfig` (the fields the core reads)
  task        the task it is trained for (meshtrain/step/tasks): "lm" (default) or "classify";
              the task fixes the forward pass's signature:
  module      module(cfg, rngs) -> nnx.Module, whose
                  lm:       __call__(tokens [B, T] int32, constrain, key, run_layers) -> logits [B, T, V]
                  classify: __call__(images [B, H, W, C] float, constrain, key, train) -> logits [B, V]
              carries logical axes on every nnx.Param and nnx.BatchStat (`out_sharding`
              metadata; BatchStat variables are the model's non-trainable state, e.g.
              BatchNorm's running statistics, updated by the forward pass when `train`),
              pins its activations with `constrain`, and (lm) runs its stacked layers
              through `stack.run_layers` so a pipeline can take the pass over; an lm
              module optionally also has
                  hidden(tokens, constrain, key, run_layers) -> (h [B, T, D] after the
                      final norm, w: the output projection as compute wants it)
                  project(h [B, t, D], w, constrain) -> logits [B, t, V]
              with __call__ = project(*hidden(...)) and project reading nothing but its
              arguments: the loss then projects a chunk of positions at a time
              (meshtrain/step/loss.py); without them it takes whole logits; and for the
              1f1b/interleaved pipeline schedules, hidden cut in its two ends:
                  embed_tokens(tokens, constrain, key) -> x [B, T, D], what the first layer takes
                  head(x, constrain) -> (h, w) as hidden returns them, from the last layer's x
  sizes       model.size -> {field: value}; fields named like a `model.*` config key are
              overridden by that key when it is set; every size has num_layers and
              vocab_size (the outputs: token ids or classes), an lm's also seq_len
  stacked     the params subtree whose leaves have a leading `layers` dim (what the
              pipeline cuts into stages); None for a family without one stack of identical
              layers (VGG, ResNet), whose pipeline layouts are refused
  activations activations(cfg, b) -> [(what, shape, logical axes)] of the arrays the forward
              pass constrains for a batch of b rows: layout validation checks their
              divisibility, and the golden sharding tables list them
  layer_activation_bytes  optional: (cfg, tokens, tensor, remat, sp=1, context=1) -> bytes one layer
              keeps for its backward pass under the remat policy, for `tokens` (rows x length)
              on a device that splits heads and mlp `tensor` ways, the residual stream `sp`
              ways by position (sequence parallelism), and each sequence's positions
              `context` ways (then tokens = rows x length / context; `context_elements`);
              each keyword is passed only when above 1 (and `expert`, the devices a mixture
              of experts' `experts` is split over, only to a family with experts): the
              planner's analytic activation memory (meshtrain/planner/analytic.py)
  weight_input_bytes  with embed_tokens and head: (cfg, tokens, tensor) -> bytes one layer's
              weight-gradient pass reads, its weight matrices' inputs and their outputs'
              cotangents, what the zb schedule keeps from an item's B to its W
              (planner/pipeline_memory.py)
  num_params  the closed-form parameter count (unpadded vocabulary)
  active_params  optional: the parameters one token passes through, where fewer than
              num_params (a mixture of experts routes each token through k of X experts);
              FLOPs and MFU count these
  flops_per_token  lm: training FLOPs per token (6 N + attention, llm.c's convention)
  flops_per_example  classify: training FLOPs per image (3 x the forward's 2 x multiply-adds)
  size_keys   logical axis -> the config key that sets its size, for error messages
  check       optional: cfg -> None, raising UserError for a combination the family refuses
  convs       optional: cfg -> [models.conv.ConvSpec], every conv in forward order (kernel,
              stride, channels, heights, logical names; its name is its params' path
              prefix): the planner's halo formula for spatial layouts (planner/halo.py)
  describe    cfg -> one line, for logs and checkpoint metadata
  pipelines   False for a family the pipeline schedules cannot run (its layers carry more
              than the residual stream from one to the next)
  metrics     names of the scalar statistics its loss reports beside the loss (an lm
              module with `hidden_aux`, below), logged with every train row

Optional auxiliary losses (models/mixtral.py's routers): an lm module with
    hidden_aux(tokens, constrain, key, run_layers) -> (h, w, aux_loss [] float32,
        {name: [] float32} for each of the family's `metrics`)
has the loss add aux_loss in training (never in evaluation) and report the statistics.

Optional decoding (meshtrain/sample.py, meshtrain/sampling/generate.py): a module with
    init_cache(batch, max_len) -> cache (a pytree of arrays)
    cache_axes() -> the logical axes of each cache leaf (the cache's tree structure)
    decode(tokens [B, t], cache, pos [] int32, constrain) -> (logits [B, t, V], cache)
and a config whose `max_context()` says how far past model.seq_len decoding may go.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

from flax import nnx

from meshtrain.errors import UserError
from meshtrain.models.stack import Axes


@runtime_checkable
class HiddenProject(Protocol):
    """An lm module whose forward is project(*hidden(...)): the loss projects a chunk of
    positions at a time."""

    def hidden(self, tokens_bt, constrain, key, run_layers): ...
    def project(self, h_btd, w, constrain): ...


@runtime_checkable
class PipelineEnds(Protocol):
    """An lm module whose hidden is cut in its two ends, for the 1f1b/interleaved schedules."""

    def embed_tokens(self, tokens_bt, constrain, key): ...
    def head(self, x_btd, constrain): ...


@runtime_checkable
class AuxLosses(Protocol):
    """An lm module with auxiliary losses (the routers of a mixture of experts)."""

    def hidden_aux(self, tokens_bt, constrain, key, run_layers): ...


def implements(module, protocol: type) -> bool:
    """Whether a module, class or instance, has the methods of one of the protocols above."""
    return issubclass(module if isinstance(module, type) else type(module), protocol)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Fields every model config has; family configs add their dimensions."""

    num_layers: int
    vocab_size: int          # the outputs the data can produce: token ids, or a classifier's classes
    padded_vocab_size: int   # rows of the embedding table / logits (>= vocab_size); extra ones are inert
    seq_len: int = 0         # context length the model is trained at (0: inputs are not sequences)
    dropout: float = 0.0
    dtype: str = "float32"        # compute dtype
    param_dtype: str = "float32"  # storage dtype of parameters and optimizer state
    remat: str = "none"           # see models/remat.py
    scan_layers: bool = True
    attention: str = "xla"        # xla | cudnn, resolved from model.attention (models/attention.py)
    context_attention: str = "allgather"  # allgather | ring: positions split over devices (parallel/context_attention.py)
    # Fields set from config sections of their name (how the model runs, not its weights:
    # models.model_config), never part of a checkpoint's architecture; each is a
    # dataclass the config's __post_init__ builds from the section's dict.
    RUN_FIELDS: ClassVar[tuple[str, ...]] = ()

    def max_context(self) -> tuple[int, str]:
        """(the most positions the model can decode over, why that many), for sampling's
        --max_len: model.seq_len here; a family whose positions go further says so
        (models/llama.py), one whose positions are a table says why not (models/gpt2.py)."""
        return self.seq_len, f"the model was trained at model.seq_len={self.seq_len} positions"


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    config: type[ModelConfig]
    module: Callable[[Any, nnx.Rngs], nnx.Module]
    sizes: Mapping[str, Mapping[str, Any]]
    activations: Callable[[Any, int], Sequence[tuple[str, tuple[int, ...], Axes]]]
    num_params: Callable[[Any], int]
    flops_per_token: Callable[[Any], float] | None
    size_keys: Mapping[str, str]
    describe: Callable[[Any], str]
    stacked: str | None = "blocks"
    task: str = "lm"
    flops_per_example: Callable[[Any], float] | None = None
    check: Callable[[Any], None] | None = None
    layer_activation_bytes: Callable[..., float] | None = None
    weight_input_bytes: Callable[..., float] | None = None
    convs: Callable[[Any], list] | None = None
    active_params: Callable[[Any], int] | None = None
    pipelines: bool = True
    metrics: tuple[str, ...] = ()
    # cfg -> {remat tag: (elements per token on every tensor rank, elements per token split
    # over tensor)}: what a layer's tagged activations (models/remat.py TAGS) hold, which the
    # planner counts in host memory under model.remat=offload_*; None: not counted
    tagged_elements: Callable[[Any], Mapping[str, tuple[float, float]]] | None = None

    def fields(self) -> tuple[str, ...]:
        """The dimension fields a size sets (the same for every size of the family)."""
        return tuple(next(iter(self.sizes.values())))


_FAMILIES: dict[str, Family] = {}


def korthikanti_bytes(tokens: int, compute_bytes: int, *, whole: float, split: float, stream: float = 0,
                      scores: float, tensor: int, sp: int = 1) -> float:
    """Activation bytes a layer keeps (Korthikanti et al. 2022, arXiv 2205.05198, §4), from
    per-token element counts: `stream` elements of the residual stream (the norms' inputs,
    the block input) and `whole` elements every tensor rank keeps in full (attention's and
    the MLP's inputs), `split` elements divided over the `tensor` ranks (heads, mlp), and
    `scores` attention-probability elements (heads x length, divided too). `sp`: the ranks
    sequence parallelism splits the stream over by position (the tensor ranks under an *_sp
    layout, 1 without). The paper's TP+SP row, sbh(34 + 5as/h)/t, also splits attention's
    and the MLP's inputs, re-gathering them in backward; here they are gathered once
    (parallel/sequence.sequence_gather) and kept whole, as XLA saves a matmul's input."""
    return tokens * compute_bytes * (stream / sp + whole + (split + scores) / tensor)


def context_elements(kind: str, heads: int, head_dim: int, seq_len: int, context: int) -> tuple[float, float]:
    """(score elements, gathered k and v elements) a layer keeps per token of a device for
    the backward pass when attention's positions are split `context` ways
    (parallel/context_attention.py; planner/context.py), both to be divided over the head
    shards. Scores: allgather's [2c, T] block, `heads` x T per token, as without the split;
    the ring's own [2c, 2c] block and n-1 blocks of 2c x c, heads x T (n+1)/(2n). Keys and
    values: the n-1 other devices' (gathered, or received round the ring), 2 (n-1) x heads
    x head_dim, at the H query heads (k and v are repeated before they travel)."""
    scores = heads * seq_len * ((context + 1) / (2 * context) if kind == "ring" else 1.0)
    return scores, 2 * (context - 1) * heads * head_dim


def register(family: Family) -> Family:
    for field in ("num_layers", "vocab_size"):
        for size, dims in family.sizes.items():
            if field not in dims:
                raise ValueError(f"model family {family.name!r}: size {size!r} has no {field!r}")
    if family.pipelines and implements(family.module, PipelineEnds) and family.weight_input_bytes is None:
        raise ValueError(f"model family {family.name!r} runs under the zb schedule (embed_tokens and head) "
                         f"but gives no weight_input_bytes, its W stash's bytes")
    _FAMILIES[family.name] = family
    return family


def get(name: str) -> Family:
    if name not in _FAMILIES:
        raise UserError(f"model.name={name!r} is not a known model; the models are: "
                        f"{', '.join(sorted(_FAMILIES))}.")
    return _FAMILIES[name]


def names() -> list[str]:
    return sorted(_FAMILIES)
