"""Named layouts. Each is a string in the layout grammar (see rules.parse).

Memory per device for Psi parameters with fp32 params and Adam (12 B/param live
state; the fp32 gradient, 4 B/param, lives only inside the step), n = size of the
sharding axis, and what each costs in communication (wire elements per device per
step; x4 bytes in fp32):

           state            gradient buffer         communication
  dp       12 Psi           4 Psi                   all-reduce of grads, 2 (n-1)/n Psi
  zero1    4 Psi + 8 Psi/n  4 Psi: whole until the  reduce-scatter of grads into the optimizer
                            backward pass ends      shards, all-gather of the updated params:
                                                    2 (n-1)/n Psi, as dp
  zero2    4 Psi + 8 Psi/n  4 Psi / n: each layer's as zero1, but one reduce-scatter per
                            reduce-scattered in     microbatch (train.grad_accum_steps) or
                            the layer scan          pipeline tick
  fsdp     12 Psi / n       4 Psi / n               ZeRO-3: params all-gathered for forward and
                                                    again for backward, grads reduce-scattered,
                                                    3 (n-1)/n Psi (1.5 x dp)
  tp       ~12 Psi / t      ~4 Psi / t              Megatron: 2 all-reduces of [batch, length,
                                                    embed] per layer forward, 2 in backward; no
                                                    gradient all-reduce over tensor
  dp_tp    ~12 Psi / t      ~4 Psi / t              tp inside, dp all-reduce of the tensor-sharded
                                                    grads across data
  fsdp_tp  ~12 Psi / (f t)  ~4 Psi / (f t)          both
  dp_spatial 12 Psi         4 Psi                   image rows split over tensor: per conv of
                                                    kernel k, k//2 rows x width x channels each
                                                    way at each split boundary (collective-
                                                    permutes); grads all-reduced over data+tensor
  *_sp     as without sp                            Megatron sequence parallelism (Korthikanti et
                                                    al. 2022): `length:tensor` last, so it splits
                                                    only what heads and mlp leave whole (the
                                                    residual stream, norms, dropout); each tensor
                                                    all-reduce becomes a reduce-scatter + an
                                                    all-gather of the same bytes
  *_cp     as without cp, the   as without cp       context parallelism: `length:context` splits
           weights replicated                       every activation's positions; attention passes
           over context                             keys and values over context (all-gather or a
                                                    ring, model.context_attention); the weights'
                                                    gradients are all-reduced over context too
  *_ep     experts split     as the weights         expert parallelism (GShard): `experts:expert`
           over expert                              puts each expert's weights on 1/e of the
                                                    devices; `batch` takes expert after the data
                                                    axes, so the rest of the model runs data
                                                    parallel over it; each MoE layer's tokens go
                                                    to their experts' devices by an all-to-all
                                                    and back, forward and backward
The rule order matters: a mesh axis goes to the first rule that claims it.

Pipeline presets (`*_pp*`) add `stage:stage` in front of every table, so the
stacked block params [stage, layers, ...] live on their stage's devices, and add
`stage` to `batch` in the activations: outside the pipeline (embedding, logits,
loss) the stage devices split the batch instead of all computing the same head.
`stage` comes last in `batch`, so dropping it inside the pipeline is an
all-gather over `stage` of contiguous rows, not a shuffle.

Their params (hence opt_state and grads) tables also split the tables used only
outside the pipeline over `stage`: the token table and an untied head by `vocab`
(`vocab:tensor+stage` under tp), GPT-2's position table by `length`. One SPMD program
gives every device a shard of every array, so "only on the first and last stage" would
still cost a whole copy on each; split, each device keeps 1/S (GPT-2 medium on
dp2_pp4_tp4: 376 -> 256 MiB of params and Adam state per device) and the step gathers
the tables over `stage` once, in the compute dtype: ZeRO-3 over `stage` for them alone.
"""

from meshtrain.errors import UserError
from meshtrain.parallel.layouts.rules import Layout, parse

# Conv nets' channel tensor parallelism: `filters` (the inner conv of a pair) is their mlp.
_TP = "heads:tensor;mlp:tensor;vocab:tensor;filters:tensor"
# embed first, then mlp, then head_dim: every GPT-2 weight, bias and LayerNorm gets
# exactly one dim sharded over fsdp, so per-device state is exactly 1/n; a conv net's
# kernels, BatchNorm vectors and statistics split by channels or filters.
_FSDP_PARAMS = "embed:fsdp;mlp:fsdp;head_dim:fsdp;channels:fsdp;filters:fsdp"
# ZeRO-1/2's split, one dim per weight as fsdp
_OVER_DATA = "embed:data;mlp:data;head_dim:data;channels:data;filters:data"
# Pipeline storage of the tables used outside the stages: the token table (and an untied
# head) split over stage by vocab row, the position table by position (`length` names no
# other parameter), so each stage holds 1/S of them instead of a whole copy. Compute
# (activations) keeps them whole over stage: one all-gather per step in the compute dtype.
_EMBED_PP = "vocab:stage;length:stage"
_TP_PP = "heads:tensor;mlp:tensor;vocab:tensor+stage;length:stage"  # tensor first: gathering
# over stage then joins contiguous rows of each tensor shard

# Sequence parallelism: length last, so heads and mlp claim tensor first and only the
# residual stream, norms and dropout ([batch, length, embed]) split by position.
_SP = "length:tensor"
# Context parallelism: every activation split by position over context (attention passes
# keys and values between the pieces: parallel/context_attention.py).
_CP = "length:context"
# Expert parallelism: the experts over `expert`, whose devices split the batch elsewhere.
# `experts` comes first, so an array with both dims (capacity dispatch's buffers [X, B, C,
# D]) puts expert on its experts; its batch then falls to the next rule without expert.
_EP = "experts:expert"
# Under fsdp, the dense weights (attention, norms, tables) split by embed over fsdp and
# expert, whose devices run them data parallel: ZeRO-3 over both. An expert weight, its
# expert axis taken by `experts`, falls to the next rule, embed over fsdp alone.
_EP_FSDP = "embed:fsdp+expert"

PRESETS = {
    "dp": "batch:data",
    "fsdp": f"batch:data+fsdp | params={_FSDP_PARAMS}",
    "zero1": f"batch:data | opt_state={_OVER_DATA}",
    "zero2": f"batch:data | opt_state={_OVER_DATA} | grads={_OVER_DATA}",
    "tp": _TP,
    "dp_tp": f"batch:data;{_TP}",
    "fsdp_tp": f"batch:data+fsdp;{_TP} | params={_TP};embed:fsdp;channels:fsdp",
    # Spatial partitioning (Mesh-TensorFlow, LBANN): image activations split by rows over
    # `tensor`; XLA's SPMD partitioner adds each convolution's halo exchange.
    "dp_spatial": "batch:data;height:tensor",
    "dp_tp_sp": f"batch:data;{_TP};{_SP}",
    "fsdp_tp_sp": f"batch:data+fsdp;{_TP};{_SP} | params={_TP};embed:fsdp;channels:fsdp",
    "dp_cp": f"batch:data;{_CP}",
    "fsdp_cp": f"batch:data+fsdp;{_CP} | params={_FSDP_PARAMS}",
    "dp_tp_cp": f"batch:data;{_TP};{_CP}",
    "fsdp_tp_cp": f"batch:data+fsdp;{_TP};{_CP} | params={_TP};embed:fsdp;channels:fsdp",
    "dp_ep": f"{_EP};batch:data+expert;batch:data",
    "fsdp_ep": f"{_EP};batch:data+fsdp+expert;batch:data+fsdp | params={_EP};{_EP_FSDP};{_FSDP_PARAMS}",
    "dp_ep_tp": f"{_EP};batch:data+expert;batch:data;{_TP}",
    "fsdp_ep_tp": f"{_EP};batch:data+fsdp+expert;batch:data+fsdp;{_TP} | params={_EP};{_TP};{_EP_FSDP};embed:fsdp;channels:fsdp",
    "dp_pp": f"stage:stage;batch:data+stage | params=stage:stage;{_EMBED_PP}",
    "fsdp_pp": f"stage:stage;batch:data+fsdp+stage | params=stage:stage;{_EMBED_PP};{_FSDP_PARAMS}",
    "zero1_pp": f"stage:stage;batch:data+stage | params=stage:stage;{_EMBED_PP}"
                f" | opt_state=stage:stage;{_EMBED_PP};{_OVER_DATA}",
    "zero2_pp": f"stage:stage;batch:data+stage | params=stage:stage;{_EMBED_PP}"
                f" | opt_state=stage:stage;{_EMBED_PP};{_OVER_DATA} | grads=stage:stage;{_EMBED_PP};{_OVER_DATA}",
    "dp_pp_cp": f"stage:stage;batch:data+stage;{_CP} | params=stage:stage;{_EMBED_PP}",
    "dp_pp_tp": f"stage:stage;batch:data+stage;{_TP} | params=stage:stage;{_TP_PP}",
    "fsdp_pp_tp": f"stage:stage;batch:data+fsdp+stage;{_TP} | params=stage:stage;{_TP_PP};embed:fsdp",
}
PIPELINE_PRESETS = tuple(name for name in PRESETS if "pp" in name)
# preset -> (mesh axes it needs, mesh axes it may use) when those have size > 1: a mesh
# axis of size > 1 outside the second set is left unused (every device on it repeats the
# same work). The planner's search and the linter read this.
PRESET_AXES = {
    "dp": ({"data"}, {"data"}), "zero1": ({"data"}, {"data"}), "zero2": ({"data"}, {"data"}),
    "fsdp": ({"fsdp"}, {"data", "fsdp"}), "tp": ({"tensor"}, {"tensor"}),
    "dp_tp": ({"data", "tensor"}, {"data", "tensor"}),
    "fsdp_tp": ({"fsdp", "tensor"}, {"data", "fsdp", "tensor"}),
    "dp_spatial": ({"tensor"}, {"data", "tensor"}),
    "dp_tp_sp": ({"data", "tensor"}, {"data", "tensor"}),
    "fsdp_tp_sp": ({"fsdp", "tensor"}, {"data", "fsdp", "tensor"}),
    "dp_cp": ({"context"}, {"data", "context"}),
    "fsdp_cp": ({"fsdp", "context"}, {"data", "fsdp", "context"}),
    "dp_tp_cp": ({"context", "tensor"}, {"data", "context", "tensor"}),
    "fsdp_tp_cp": ({"fsdp", "context", "tensor"}, {"data", "fsdp", "context", "tensor"}),
    "dp_ep": ({"expert"}, {"data", "expert"}),
    "fsdp_ep": ({"fsdp", "expert"}, {"data", "fsdp", "expert"}),
    "dp_ep_tp": ({"expert", "tensor"}, {"data", "expert", "tensor"}),
    "fsdp_ep_tp": ({"fsdp", "expert", "tensor"}, {"data", "fsdp", "expert", "tensor"}),
    "dp_pp": ({"stage"}, {"data", "stage"}), "zero1_pp": ({"stage", "data"}, {"data", "stage"}),
    "zero2_pp": ({"stage", "data"}, {"data", "stage"}),
    "fsdp_pp": ({"stage", "fsdp"}, {"data", "fsdp", "stage"}),
    "dp_pp_cp": ({"stage", "context"}, {"data", "stage", "context"}),
    "dp_pp_tp": ({"stage", "tensor"}, {"data", "stage", "tensor"}),
    "fsdp_pp_tp": ({"stage", "fsdp", "tensor"}, {"data", "stage", "fsdp", "tensor"}),
}


def get(name_or_rules: str) -> Layout:
    """A preset by name, or a layout written in the grammar."""
    text = name_or_rules.strip()
    if text in PRESETS:
        return parse(PRESETS[text], name=text)
    if ":" not in text:
        raise UserError(
            f"Unknown layout {text!r}. The presets are: {', '.join(PRESETS)}; or write "
            f"rules in the layout grammar, e.g. 'batch:data+fsdp;heads:tensor;embed:fsdp' "
            f"(see docs/layouts.md).")
    return parse(text)
