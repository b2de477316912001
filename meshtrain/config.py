"""Configs: one `base()` of every key, named runs in configs/NAME.py.

`load(name_or_path)` imports the file and calls its `get_config()`; `override`
applies `--config.key=value` strings to the locked ConfigDict, parsing each value
to the type of the key it replaces. Unknown keys and bad values are `UserError`s
with a suggestion. The command line itself is meshtrain/cli.py's.
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import pathlib
import re

import ml_collections

from meshtrain.errors import UserError


# The shipped configs are the package meshtrain.configs (configs/ at the repository root
# links to it), so `--config=NAME` finds them after any kind of install.
CONFIG_DIR = pathlib.Path(__file__).resolve().parent / "configs"


def base(size: str = "tiny", mesh: str = "data:1", layout: str = "dp") -> ml_collections.ConfigDict:
    """Every key meshtrain reads, with defaults. `None` model dims come from model.size."""
    c = ml_collections.ConfigDict()
    c.model = dict(
        name="gpt2", size=size,
        num_layers=None, num_heads=None, embed_dim=None, mlp_dim=None, seq_len=None,
        vocab_size=None,     # None: from model.size (synthetic data) or the tokenizer (text)
        # Llama only (None: from model.size): grouped-query KV heads, RoPE base, tied output.
        num_kv_heads=None, rope_theta=None, tie_embeddings=None,
        # Mixtral only (None: from model.size): experts per block, routed per token, always on.
        num_experts=None, experts_per_token=None, num_shared_experts=None,
        # Image families only (None: from model.size): input height = width, BatchNorm on/off.
        image_size=None, batch_norm=None,
        vocab_multiple=128,  # embedding rows are padded to a multiple of this (and of its shards)
        dropout=0.0, dtype="float32", param_dtype="float32",
        remat="none", scan_layers=True,
        # auto | xla | cudnn (meshtrain/models/attention.py; docs/performance.md)
        attention="auto",
        # allgather | ring: how attention meets the pieces of a sequence split over the
        # context axis (meshtrain/parallel/context_attention.py; docs/layouts.md)
        context_attention="allgather",
    )
    # How a mixture of experts runs (models/moe.py; docs/models.md "Mixtures of experts"):
    # dispatch dropless | capacity; grouped_matmul auto | windowed | ragged_dot: how dropless
    # computes each expert's rows (models/moe_dropless.py; auto is windowed, measured the
    # faster on CPU and GPU); capacity_factor: an expert's slots per sequence over its
    # even share k T / X (capacity only; tokens past it are dropped and counted); the
    # load-balance and router z-loss weights in the training loss.
    c.moe = dict(dispatch="dropless", grouped_matmul="auto", capacity_factor=1.25, aux_loss_coef=0.01,
                 z_loss_coef=0.001)
    # dcn: the inter-node factor of each axis, e.g. "data:2" (docs/multihost.md).
    c.mesh = dict(shape=mesh, dcn="")
    c.layout = layout
    # nonfinite: "crash" stops at a step with a non-finite loss or gradient, "skip" leaves
    # params and optimizer state unchanged (at most max_skips steps in a row). stop_at > 0
    # ends the run after that step with a checkpoint; the lr schedule still spans steps.
    # profile "START:STOP" writes a JAX profiler trace of those steps to WORKDIR/profile/
    # (docs/profiling.md); "" is off. loss_chunk: positions per chunk of the loss, whose
    # float32 logits are recomputed in backward instead of kept (0: the whole sequence at
    # once). grad_dtype: the dtype gradients are reduced in over the data axis ("" as the
    # backward produces them). Both in docs/performance.md. grad_accum_steps: gradient
    # accumulation, the batch cut into that many pieces run one after another (the
    # pipeline's own microbatches are pipeline.microbatches). accum_gather, with
    # grad_accum_steps > 1 and params sharded over a batch axis (fsdp): "once" gathers the params once per
    # step and reduce-scatters the accumulated gradients once (more memory: the gathered
    # params and a float32 accumulator of full size), "each" gathers them in every
    # microbatch, "auto" picks once when the planner's memory formula says it fits the
    # device (docs/performance.md); a no-op elsewhere. skip_memory_check: start even
    # when the compiled step's memory does not fit the devices (run/memory_check.py).
    # trackers: where metric rows go besides the progress lines, a comma list of
    # tensorboard, jsonl, wandb (the `wandb` extra), or none (meshtrain/runlog/trackers.py;
    # docs/architecture.md, "Outputs").
    # offload: what lives in host memory between steps, a comma list of opt_state, params
    # (or "" / none; meshtrain/parallel/offload.py, docs/performance.md).
    # grad_compression: the data replicas' gradients reduced over slow links as int8 (a byte
    # a value) or onebit (a sign a value), or none; compress_axes: over which replica axes
    # ("": those mesh.dcn splits, else data); error_feedback: what compression loses is
    # added back the next step (meshtrain/parallel/compression.py, docs/performance.md);
    # compress_momentum: each replica's next momentum is compressed instead of its gradient
    # (1-bit Adam's form; adamw or sgd with momentum, no clipping), after compress_warmup
    # steps reduced exactly, Adam's variance frozen from then (parallel/momentum_compression.py).
    # hang_timeout: seconds without a finished step before every process reports where it
    # is and exits 3 (None: max(300, 20 x the median step); 0: off); hang_timeout_busy bounds
    # the first step, a checkpoint save or an eval (0: none). straggler_every: steps per
    # window of the straggler report (0: off), which names a process whose own time per step
    # exceeds the others' by straggler_fraction of the step. docs/multihost.md.
    c.train = dict(steps=300, batch_size=32, grad_accum_steps=1, seed=0,
                   log_every=10, eval_every=100, eval_steps=4,
                   nonfinite="crash", max_skips=10, stop_at=0, profile="",
                   loss_chunk=256, grad_dtype="", accum_gather="auto", skip_memory_check=False,
                   trackers="tensorboard,jsonl", offload="", grad_compression="none", compress_axes="",
                   error_feedback=True, compress_momentum=False, compress_warmup=0,
                   hang_timeout=None, hang_timeout_busy=1800.0,
                   straggler_every=100, straggler_fraction=0.1)
    # DiLoCo (meshtrain/parallel/diloco.py, docs/performance.md): every > 0 trains each
    # island (a node of mesh.dcn's data factor, or each data replica) apart for that many
    # steps, then averages the islands' progress with outer Nesterov SGD (outer_lr, outer_momentum).
    # fragments > 1: streaming DiLoCo, the stacked layers in that many ranges meeting in turn.
    c.diloco = dict(every=0, outer_lr=0.7, outer_momentum=0.9, fragments=1)
    # Orbax checkpoints (docs/checkpoints.md). dir "" is WORKDIR/checkpoints (none without
    # --workdir); every=0 saves only at the end, at stop_at and on SIGTERM or Ctrl-C;
    # every_minutes also saves at the first log step that many minutes after the last save
    # (0: off), so a long run always has a recent step; keep=0 keeps all. skip_disk_check:
    # start even when the disk cannot hold the checkpoints the run keeps (checkpoints/disk_space.py).
    c.checkpoint = {"dir": "", "every": 1000, "every_minutes": 30.0, "keep": 3, "async": True,
                    "skip_disk_check": False}
    # init.from: a checkpoint to start from (fine-tuning): its params, step 0, fresh optimizer.
    c.init = {"from": ""}
    # Pipeline over the mesh `stage` axis (meshtrain/parallel/pipeline/scan.py); microbatches=0 is off.
    c.pipeline = dict(microbatches=0, schedule="gpipe", repeats=1, stash="inputs", split="jaxpr")
    # Multi-process runs (docs/multihost.md), in seconds: how long processes wait for each
    # other at start, and how long a silent process may stay silent before all stop.
    c.distributed = dict(init_timeout=300, heartbeat_timeout=60)
    # optim.* (docs/optimizers.md): name adamw | sgd | lars | lamb. b1, b2: Adam's (adamw,
    # lamb); momentum, nesterov: sgd's and lars's (momentum 0: plain SGD); eps: Adam's
    # denominator (adamw, lamb), LARS's trust-ratio denominator; trust_coefficient: LARS's.
    # mu_dtype: the first moment's dtype (Adam's mu, the momentum buffer), "" the param
    # dtype. lr_batch_size: 0 uses optim.lr as given; N > 0 makes optim.lr the lr of a
    # batch of N, scaled by train.batch_size / N (the linear scaling rule).
    c.optim = dict(name="adamw", lr=3e-3, min_lr=3e-4, warmup_steps=30, schedule="cosine",
                   weight_decay=0.1, b1=0.9, b2=0.95, eps=1e-8, grad_clip=1.0,
                   mu_dtype="", momentum=0.9, nesterov=False, trust_coefficient=0.001,
                   lr_batch_size=0)
    # data.* is read by meshtrain/data (docs/data.md); workers > 0 reads in grain workers,
    # prefetch is batches read ahead; packing: concat | documents (models/documents.py).
    c.data = dict(kind="synthetic", path="", tokenizer="byte", name="", data_dir="",
                  split="train", eval_split="validation", feature="", cache_dir="",
                  val_fraction=0.05, random_offsets=False, workers=0, prefetch=2, packing="concat",
                  # Image models: augment is auto | "" | flip | crop | crop_flip (auto: the
                  # dataset's default, docs/data.md); crop_scale the smallest crop's area.
                  augment="auto", crop_scale=0.08)
    c.lock()
    return c


def gpt2_pretraining(size: str, mesh: str, layout: str, *, lr: float,
                     remat: str = "none") -> ml_collections.ConfigDict:
    """base() with the settings of a real GPT-2 run: bf16 compute (params and Adam state
    stay float32), 64 x 1024 tokens a step, 700 warmup steps, cosine to lr / 10."""
    c = base(size=size, mesh=mesh, layout=layout)
    c.model.dtype = "bfloat16"
    c.model.remat = remat
    c.train.update(steps=20_000, batch_size=64, log_every=50, eval_every=1000, eval_steps=20)
    c.optim.update(lr=lr, min_lr=lr / 10, warmup_steps=700)
    return c


def image_classification(name: str, size: str, *, mesh: str, layout: str) -> ml_collections.ConfigDict:
    """base() for an image classifier (model.name vgg or resnet; tasks/classify.py):
    synthetic images unless data.* says otherwise, SGD with momentum 0.9 and weight decay
    5e-4 on the matrices and kernels, no clipping; classes are not padded to 128 (that
    padding is for a vocabulary's matmul tiles)."""
    c = base(size=size, mesh=mesh, layout=layout)
    c.model.update(name=name, vocab_multiple=1)
    c.train.update(steps=300, batch_size=32, log_every=10, eval_every=100, eval_steps=4)
    c.optim.update(name="sgd", lr=0.05, min_lr=0.0, momentum=0.9, weight_decay=5e-4,
                   warmup_steps=10, grad_clip=0.0)
    return c


def available() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.py") if not p.stem.startswith("_"))


def load(name_or_path: str, overrides=()) -> ml_collections.ConfigDict:
    """`gpt2_tiny_dp8` (a file in configs/) or a path to a .py file, locked, with the
    (key, value) `overrides` applied in order as --config.KEY=VALUE would apply them."""
    path = pathlib.Path(name_or_path)
    if not (path.suffix == ".py" and path.exists()):
        path = CONFIG_DIR / f"{name_or_path}.py"
    if not path.exists():
        close = difflib.get_close_matches(name_or_path, available(), n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise UserError(
            f"Unknown config {name_or_path!r}.{hint} Pass a name from configs/ "
            f"({', '.join(available())}) or a path to a .py file with get_config().")
    spec = importlib.util.spec_from_file_location(f"meshtrain_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        cfg = module.get_config()
    except (AttributeError, KeyError) as e:  # a locked ConfigDict refusing a key
        old = next((k for k in RENAMED if re.search(rf"""['"]{k.split('.')[-1]}['"]""", str(e))), None)
        if old is None:
            raise
        raise UserError(f"{path.name} sets {old}, which is now {RENAMED[old]}: {RENAMED_WHY[old]} "
                        f"Rename it in the file.") from None
    cfg.lock()
    for key, value in overrides:
        override(cfg, key, str(value))
    return cfg


# Keys renamed, old -> new. Given on the command line or in a config file they are refused
# with the new name; in the configs older runs saved (run.json) they are translated.
RENAMED = {"train.microbatches": "train.grad_accum_steps"}
RENAMED_WHY = {"train.microbatches": "the gradient accumulation steps a batch is cut into, named apart "
                                     "from the pipeline's pipeline.microbatches."}


def upgrade(saved: dict) -> dict:
    """A config dict an older run saved, with renamed keys under their new names."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in saved.items()}
    for old, new in RENAMED.items():
        (section, leaf), (_, new_leaf) = old.split("."), new.split(".")
        if isinstance(out.get(section), dict) and leaf in out[section]:
            out[section].setdefault(new_leaf, out[section].pop(leaf))
    return out


def keys(cfg: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
    """Every dotted key of `cfg`, in its order: ["model.name", ..., "data.prefetch"]."""
    out = []
    for k, v in cfg.items():
        out.extend(keys(v, f"{prefix}{k}.") if isinstance(v, ml_collections.ConfigDict) else [f"{prefix}{k}"])
    return out


def get(cfg: ml_collections.ConfigDict, key: str):
    """The value of dotted `key`."""
    node = cfg
    for part in key.split("."):
        node = node[part]
    return node


def _parse_value(key: str, old, text: str):
    """Parses `text` to the type of `old` (the current value of `key`)."""
    def bad(kind):
        return UserError(f"--config.{key}={text!r}: expected {kind} (the current value is {old!r}).")
    if isinstance(old, bool):
        low = text.lower()
        if low in ("true", "1", "yes"):
            return True
        if low in ("false", "0", "no"):
            return False
        raise bad("true or false")
    if isinstance(old, int):
        try:
            return int(text)
        except ValueError:
            raise bad("an integer") from None
    if isinstance(old, float):
        try:
            return float(text)
        except ValueError:
            raise bad("a number") from None
    if isinstance(old, str):
        return text
    if text.lower() == "none":
        return None
    if text.lower() in ("true", "false"):  # a key whose default is None, e.g. model.tie_embeddings
        return text.lower() == "true"
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def override(cfg: ml_collections.ConfigDict, key: str, text: str) -> None:
    """Sets dotted `key` from its command-line text; unknown keys are errors."""
    known = keys(cfg)
    if key in RENAMED and RENAMED[key] in known:
        raise UserError(f"--config.{key} is now --config.{RENAMED[key]}: {RENAMED_WHY[key]} "
                        f"Give --config.{RENAMED[key]}={text}.")
    if key not in known:
        close = difflib.get_close_matches(key, known, n=3, cutoff=0.5)
        hint = f" Did you mean {' or '.join(close)}?" if close else ""
        section = key.split(".")[0]
        listed = [k for k in known if k.startswith(section + ".")] or known
        raise UserError(
            f"Unknown config key {key!r}.{hint} Known keys{' in ' + section if listed is not known else ''}: "
            f"{', '.join(listed)}.")
    *parents, leaf = key.split(".")
    node = cfg
    for p in parents:
        node = node[p]
    with node.unlocked():
        node[leaf] = _parse_value(key, node[leaf], text)
