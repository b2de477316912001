"""Sample text from a trained run or a converted Hugging Face model, with a KV cache on the
run's mesh (nanoGPT's sample.py, on a device mesh).

    meshtrain sample (--workdir=W | --checkpoint=CKPT) [--step=N] --prompt=TEXT
        [--num_samples=1] [--max_new_tokens=N] [--max_len=N] [--temperature=0.8] [--top_k=0] [--top_p=1.0]
        [--seed=0] [--mesh=SHAPE] [--layout=NAME] [--dtype=float32]

--workdir: the run is rebuilt from W/run.json: the model exactly as trained, the same
mesh shape and layout, the params of the latest committed checkpoint (or --step), and
the tokenizer of the run's data config (`from_workdir`), which encodes the prompt as the
model the run was fine-tuned from does (a converted Llama's BOS first: the step's meta
"prompt_special_tokens", init_from.prompt_special_tokens).

--checkpoint: a checkpoint `python -m meshtrain.convert from_hf` wrote (or any other
that `init.from` accepts): the model is its architecture, with the vocabulary padded
for the layout as training pads it; the mesh is --mesh (default data:1, one device)
under --layout (default dp); the tokenizer is the checkpoint's (`from_checkpoint`).

--max_len: the context to generate in (prompt + new tokens, the KV cache's length),
model.seq_len by default; a RoPE model may go past it to the context it supports
(ModelConfig.max_context: a converted Llama's max_position_embeddings), GPT-2's learned
position table may not.

Either way CPU devices are simulated to fit the mesh (as in training), a mesh of fewer
devices than the host has uses the first ones, the params are read straight into the
layout's shardings, and the generation (meshtrain/sampling/generate.py) is compiled once.
Samples go to stdout, each followed by a separator line; what was loaded and how fast
it ran go to stderr. Bad input exits with status 2 and one paragraph. See
docs/sampling.md.
"""

from __future__ import annotations

import sys
import time

from meshtrain import cli, mesh as mesh_lib
from meshtrain.errors import UserError
from meshtrain.sampling.sources import DTYPES, check_source, from_checkpoint, from_workdir

SEPARATOR = "---------------"
DEFAULT_MAX_NEW = 256


def parser() -> cli.Parser:
    p = cli.command_parser("meshtrain sample", __doc__)
    src = p.add_argument_group("what to sample from (one of)")
    src.add_argument("--workdir", metavar="DIR", help="a run's workdir (`meshtrain train --workdir=DIR`)")
    src.add_argument("--checkpoint", metavar="CKPT", help="a converted checkpoint (`meshtrain convert from_hf`)")
    src.add_argument("--step", type=int, metavar="N", help="this committed step instead of the latest (--workdir)")
    p.add_argument("--prompt", default="", help="text to continue (token ids like 3,17,42 when the model "
                                                "has no tokenizer); empty starts a document")
    p.add_argument("--num_samples", type=int, default=1, metavar="N", help="samples to draw, in one batch")
    p.add_argument("--max_new_tokens", type=int, metavar="N",
                   help=f"tokens to generate (default: the rest of --max_len; without it, the rest of "
                        f"model.seq_len, at most {DEFAULT_MAX_NEW})")
    p.add_argument("--max_len", type=int, metavar="N",
                   help="the context to generate in, prompt and new tokens (default: model.seq_len); a "
                        "RoPE model (llama) may go past model.seq_len up to the context it supports "
                        "(max_position_embeddings), GPT-2's learned positions may not")
    p.add_argument("--temperature", type=float, default=0.8, help="0 is greedy")
    p.add_argument("--top_k", type=int, default=0, help="keep the K most likely tokens (0: all)")
    p.add_argument("--top_p", type=float, default=1.0, help="keep the smallest set of tokens with this much "
                                                              "probability (1: all)")
    p.add_argument("--seed", type=int, default=0, help="the sampling seed")
    layout = p.add_argument_group("where it runs (--checkpoint; a --workdir run uses its own)")
    layout.add_argument("--mesh", metavar="SHAPE", help="the mesh, e.g. data:2,tensor:4 (default data:1)")
    layout.add_argument("--layout", metavar="NAME", help="the layout (default dp)")
    layout.add_argument("--dtype", choices=DTYPES, help="the compute dtype (default: the run's, or float32)")
    return p


def check_flags(args) -> dict:
    """The parsed flags as a dict, checked: exactly one source, values in range."""
    flags = vars(args)
    check_source(flags)
    checks = [("num_samples", flags["num_samples"] >= 1, "at least 1"),
              ("max_new_tokens", flags["max_new_tokens"] is None or flags["max_new_tokens"] >= 1, "at least 1"),
              ("max_len", flags["max_len"] is None or flags["max_len"] >= 2,
               "at least 2 (a prompt token and a new one)"),
              ("temperature", flags["temperature"] >= 0, ">= 0 (0 is greedy)"),
              ("top_k", flags["top_k"] >= 0, ">= 0 (0 keeps every token)"),
              ("top_p", 0 < flags["top_p"] <= 1, "in (0, 1] (1 keeps every token)"),
              ("seed", 0 <= flags["seed"] < 2**31, "in [0, 2**31)")]
    for name, ok, rule in checks:
        if not ok:
            raise UserError(f"--{name}={flags[name]}: must be {rule}.")
    return flags


def execute(args) -> int:
    flags = check_flags(args)
    src = from_workdir(flags) if flags["workdir"] is not None else from_checkpoint(flags)
    from meshtrain.sampling import generate as gen
    model, layout, mesh = src.model, src.layout, src.mesh
    prompt = encode_prompt(flags["prompt"], src.tokenizer, model.cfg.vocab_size)
    n_new = new_tokens(len(prompt), flags["max_new_tokens"], flags["max_len"], model.cfg)
    rows = gen.padded_rows(flags["num_samples"], layout, mesh)
    check_cache(model, layout, mesh, rows, gen.cache_length(model, layout, mesh, len(prompt) + n_new))
    params = src.restore()

    say = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    say(f"meshtrain.sample: {src.what} | {model.family.describe(model.cfg)}, compute {model.cfg.dtype}")
    shape = mesh_lib.format_factors(dict(mesh.shape))
    say(f"mesh {'data:1' if shape == '1' else shape} ({src.devices}), layout {layout.name} | "
        f"{flags['num_samples']} sample(s) in {rows} rows, prompt {len(prompt)} tokens + {n_new} new")
    prompts = [prompt] * flags["num_samples"]
    t0 = time.perf_counter()
    fn = gen.compile_generate(gen.make_generate(model, layout, mesh, src.shardings, max_new_tokens=n_new),
                              params, rows, len(prompt), layout, mesh)
    t1 = time.perf_counter()
    out = gen.generate(fn, params, prompts, layout, mesh,
                       **{k: flags[k] for k in ("seed", "temperature", "top_k", "top_p")})
    t2 = time.perf_counter()
    say(f"compiled in {t1 - t0:.1f}s; generated {out.size} tokens in {t2 - t1:.2f}s "
        f"({out.size / (t2 - t1):,.0f} tokens/s)")
    for row in out:
        print(decode(src.tokenizer, prompt, row))
        print(SEPARATOR, flush=True)
    return 0


def new_tokens(prompt_len: int, asked: int | None, max_len: int | None, model_cfg) -> int:
    """--max_new_tokens, else the rest of the context: of --max_len when it is given, else
    of model.seq_len but at most DEFAULT_MAX_NEW. The prompt and the new tokens (the KV
    cache's length) must fit in --max_len (default model.seq_len), and --max_len in what
    the model's positions reach (`max_context()`: GPT-2's position table is model.seq_len
    rows; Llama's RoPE goes to its max_position_embeddings)."""
    limit, why = model_cfg.max_context()
    if max_len is not None and max_len > limit:
        raise UserError(f"--max_len={max_len} is longer than this model can decode: {why}. "
                        f"Use --max_len={limit} or less.")
    context = max_len or model_cfg.seq_len
    name = f"--max_len={context}" if max_len else f"model.seq_len={context}"
    longer = f", or a longer --max_len (up to {limit})" if context < limit else ""
    if prompt_len >= context:
        raise UserError(f"The prompt is {prompt_len} tokens, but the model's context is {name} "
                        f"tokens, and at least one new token must fit. Shorten the prompt{longer}.")
    n_new = asked or (context - prompt_len if max_len else min(DEFAULT_MAX_NEW, context - prompt_len))
    if prompt_len + n_new > context:
        raise UserError(f"The prompt ({prompt_len} tokens) plus --max_new_tokens={n_new} is "
                        f"{prompt_len + n_new} tokens, more than the model's context, {name}. "
                        f"Use --max_new_tokens={context - prompt_len} or less, or a shorter "
                        f"prompt{longer}.")
    return n_new


def check_cache(model, layout, mesh, rows: int, length: int) -> None:
    """Divisibility of the sampling batch's activations and of the cache, before tracing."""
    import jax

    from meshtrain.step import state as state_lib
    state_lib.check_activations(model, rows, layout, mesh)

    cache = jax.eval_shape(lambda p: model.bind(p).init_cache(rows, length), model.shapes)
    axes = model.bind(model.shapes).cache_axes()
    is_axes = lambda a: isinstance(a, tuple) and all(isinstance(n, (str, type(None))) for n in a)  # noqa: E731
    for i, (leaf, leaf_axes) in enumerate(zip(jax.tree.leaves(cache), jax.tree.leaves(axes, is_leaf=is_axes))):
        spec = layout.spec(leaf_axes, "activations", where="the KV cache")
        state_lib.check_divisible(leaf.shape, leaf_axes, spec, mesh, layout, f"KV cache leaf {i}",
                                  model.size_keys())


def encode_prompt(text: str, tok, vocab_size: int) -> list[int]:
    """The prompt's ids; an empty prompt starts from end of text (a document's start).
    Without a tokenizer (synthetic data, or a checkpoint converted without one) the
    prompt is ids: "3,17,42" or "3 17 42"."""
    if tok is not None:
        ids = [int(i) for i in tok.encode(text)] or [int(tok.eot_id)]
        if max(ids) >= vocab_size:
            raise UserError(f"--prompt={text!r} encodes to id {max(ids)}, but the model embeds only "
                            f"{vocab_size} tokens: its tokenizer ({tok.describe()}) has ids the "
                            f"model was not trained with. Leave those tokens out of the prompt.")
        return ids
    parts = text.replace(",", " ").split()
    try:
        ids = [int(p) for p in parts]
    except ValueError:
        ids = []
    if not ids or not all(0 <= i < vocab_size for i in ids):
        raise UserError(f"--prompt={text!r}: the model has no tokenizer (a run trained on "
                        f"synthetic data, or a checkpoint converted from a directory without "
                        f"one), so the prompt is token ids in [0, {vocab_size}), e.g. "
                        f"--prompt=3,17,42.")
    return ids


def decode(tok, prompt: list[int], new) -> str:
    """The sample as text: prompt and continuation (ids joined by spaces without a tokenizer)."""
    ids = list(prompt) + [int(i) for i in new]
    return " ".join(map(str, ids)) if tok is None else tok.decode(ids)


run, main = cli.entry_points(parser, execute)


if __name__ == "__main__":
    sys.exit(main())
