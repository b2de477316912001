"""Llama: parameter counts, the params tree, forward invariants, KV-cache decoding,
grouped-query attention (also under tensor parallelism), every tiny layout against one
device, and Hugging Face's LlamaForCausalLM as the numerical reference.

The tests' own forward, backward and decoding programs run jitted, one program each rather
than one per op, compiled with the planner's analysis options (compile_options.ANALYSIS_OPTIONS:
the same HLO, 3x faster to compile): they run a few times on the tiny model, where slower
code costs nothing."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from meshtrain import config as config_lib, mesh as mesh_lib, tree_paths
from meshtrain.models import model_config
from meshtrain.models.llama import Llama, RopeScaling, inverse_frequencies, num_params
from meshtrain.models.sizes import LLAMA_SIZES
from meshtrain.parallel import layouts
from meshtrain.parallel.hook import Constrain
from meshtrain.run.compile_options import analysis_options
from meshtrain.step.state import abstract_model, param_shardings

from support.training import COMPARED, assert_same_training, losses_and_grads, trained


def cfg_for(size, **kw):
    cfg = config_lib.base(size=size)
    cfg.model.name = "llama"
    return dataclasses.replace(model_config(cfg.model, vocab_size=LLAMA_SIZES[size]["vocab_size"]), **kw)


def tiny(seq_len=16, **kw):
    return dataclasses.replace(cfg_for("tiny"), seq_len=seq_len, **kw)


TOKENS = jax.random.randint(jax.random.key(1), (4, 17), 0, 256)
SCALING = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=32)


@pytest.mark.parametrize("size, expected", [
    ("llama3_1b", 1_235_814_400),  # Llama 3.2 1B (tied)
    ("llama2_7b", 6_738_415_616),  # Llama 2 7B
    ("llama3_8b", 8_030_261_248),  # Llama 3 8B
])
def test_param_counts_match_published(size, expected):
    cfg = cfg_for(size)
    assert num_params(cfg) == expected
    model = abstract_model(dataclasses.replace(cfg, padded_vocab_size=cfg.vocab_size))
    assert sum(math.prod(s.shape) for s in jax.tree.leaves(model.shapes)) == expected


def test_params_tree_is_the_agreed_one():
    """The layout Hugging Face conversion is written against: names, shapes, logical axes."""
    c = tiny()
    L, D, H, K, E, F, V = 2, 64, 4, 2, 16, 192, 256
    model = abstract_model(c)
    axes = tree_paths.flat(model.axes, is_leaf=lambda x: isinstance(x, tuple))
    flat = {path: (s.shape, axes[path]) for path, s in tree_paths.flat(model.shapes).items()}
    assert flat == {
        "embed": ((V, D), ("vocab", "embed")),
        "blocks/attn_norm/scale": ((L, D), ("layers", "embed")),
        "blocks/attn/wq": ((L, D, H, E), ("layers", "embed", "heads", "head_dim")),
        "blocks/attn/wk": ((L, D, K, E), ("layers", "embed", "kv_heads", "head_dim")),
        "blocks/attn/wv": ((L, D, K, E), ("layers", "embed", "kv_heads", "head_dim")),
        "blocks/attn/wo": ((L, H, E, D), ("layers", "heads", "head_dim", "embed")),
        "blocks/mlp_norm/scale": ((L, D), ("layers", "embed")),
        "blocks/mlp/w_gate": ((L, D, F), ("layers", "embed", "mlp")),
        "blocks/mlp/w_up": ((L, D, F), ("layers", "embed", "mlp")),
        "blocks/mlp/w_down": ((L, F, D), ("layers", "mlp", "embed")),
        "final_norm/scale": ((D,), ("embed",)),
        "lm_head": ((D, V), ("embed", "vocab")),
    }
    assert "lm_head" not in abstract_model(tiny(tie_embeddings=True)).shapes


def params_of(cfg, seed=0):
    return nnx.to_pure_dict(nnx.state(Llama(cfg, nnx.Rngs(seed))))


def forward(cfg, params, tokens):
    """Logits [B, T, V] of the model `cfg` with `params`."""
    graphdef = nnx.graphdef(Llama(cfg, nnx.Rngs(0)))
    return jax.jit(lambda p, t: nnx.merge(graphdef, p)(t), compiler_options=analysis_options())(params, tokens)


def loss_and_grads(cfg, tokens, params=None):
    graphdef, state = nnx.split(Llama(cfg, nnx.Rngs(0)))
    params = nnx.to_pure_dict(state) if params is None else params

    def loss(p):
        logits = nnx.merge(graphdef, p)(tokens[:, :-1]).astype(jnp.float32)
        return -jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1).mean()
    return jax.jit(jax.value_and_grad(loss), compiler_options=analysis_options())(params)


@pytest.fixture(scope="module")
def tiny_reference():
    return loss_and_grads(tiny(), TOKENS)


@pytest.mark.parametrize("variant", [dict(scan_layers=False), dict(remat="full"), dict(remat="save_dots")])
def test_scan_unrolled_and_remat_are_the_same_function(variant, tiny_reference):
    ref_loss, ref_grads = tiny_reference
    loss, grads = loss_and_grads(tiny(**variant), TOKENS)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grads, ref_grads)


def test_vocab_padding_is_inert(tiny_reference):
    """Padded embedding rows and lm_head columns start at zero and get no gradient."""
    ref_loss, ref_grads = tiny_reference
    loss, grads = loss_and_grads(tiny(padded_vocab_size=384), TOKENS)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert np.all(grads["embed"][256:] == 0) and np.all(grads["lm_head"][:, 256:] == 0)
    np.testing.assert_allclose(grads["lm_head"][:, :256], ref_grads["lm_head"], rtol=1e-5, atol=1e-7)


def test_tied_output_is_untied_with_lm_head_equal_to_the_embedding():
    tied = tiny(tie_embeddings=True)
    params = params_of(tied)
    untied = dict(params, lm_head=params["embed"].T)
    np.testing.assert_allclose(forward(tied, params, TOKENS), forward(tiny(), untied, TOKENS),
                               rtol=1e-5, atol=1e-6)


def test_gqa_is_attention_with_each_kv_head_repeated_over_its_group():
    """K < H: query head h reads kv head h // (H/K), so repeating wk, wv per group gives
    the K == H model with the same function (Hugging Face's repeat_kv convention)."""
    gqa = tiny(num_kv_heads=2)
    params = params_of(gqa)
    mha = jax.tree.map(lambda a: a, params)
    for w in ("wk", "wv"):
        mha["blocks"]["attn"][w] = jnp.repeat(params["blocks"]["attn"][w], 2, axis=2)
    np.testing.assert_allclose(forward(gqa, params, TOKENS), forward(tiny(num_kv_heads=4), mha, TOKENS),
                               rtol=1e-5, atol=1e-5)


def decode_logits(cfg, params, tokens, prompt, constrain=None):
    """Prefill `prompt` tokens, then one token at a time -> logits [B, T, V] of every position."""
    graphdef = nnx.graphdef(Llama(cfg, nnx.Rngs(0)))
    kw = {} if constrain is None else dict(constrain=constrain)

    @functools.partial(jax.jit, compiler_options=analysis_options())  # prefill and one token: 2 programs
    def step(p, toks, cache, pos):
        return nnx.merge(graphdef, p).decode(toks, cache, pos, **kw)
    cache = nnx.merge(graphdef, params).init_cache(tokens.shape[0], tokens.shape[1])
    out, cache = step(params, tokens[:, :prompt], cache, jnp.int32(0))
    outs = [out]
    for i in range(prompt, tokens.shape[1]):
        out, cache = step(params, tokens[:, i:i + 1], cache, jnp.int32(i))
        outs.append(out)
    return jnp.concatenate(outs, axis=1), cache


@pytest.mark.parametrize("kw", [dict(), dict(num_kv_heads=1, tie_embeddings=True), dict(num_kv_heads=4),
                                dict(rope_theta=500_000.0, rope_scaling=SCALING)])
def test_kv_cache_decode_equals_the_full_forward(kw):
    cfg = tiny(**kw)
    params = params_of(cfg)
    tokens = TOKENS[:, :12]
    logits, cache = decode_logits(cfg, params, tokens, prompt=5)
    assert cache[0].shape == (2, 4, 12, cfg.num_kv_heads, 16)  # K heads cached, not H
    assert Llama(cfg, nnx.Rngs(0)).cache_axes()[0] == ("layers", "batch", "length", "kv_heads", "head_dim")
    np.testing.assert_allclose(logits, forward(cfg, params, tokens), rtol=1e-4, atol=1e-5)


def test_decode_and_forward_under_dp_tp_match_one_device():
    """GQA on tensor=4 with 2 kv heads (K < tensor size): the K-head cache is replicated
    over tensor while the query heads are split, and the results are unchanged."""
    cfg = tiny()
    params = params_of(cfg)
    mesh = mesh_lib.make_mesh(mesh_lib.resolve_shape(mesh_lib.parse_shape("data:2,tensor:4"), 8),
                              jax.devices()[:8])
    layout = layouts.get("dp_tp")
    sharded = jax.device_put(params, param_shardings(abstract_model(cfg), layout, mesh, "params"))
    assert sharded["blocks"]["attn"]["wq"].sharding.spec[2] == "tensor"
    assert all(s is None for s in sharded["blocks"]["attn"]["wk"].sharding.spec)
    constrain = Constrain(layout, mesh)
    tokens = TOKENS[:, :12]
    logits, cache = decode_logits(cfg, sharded, tokens, prompt=5, constrain=constrain)
    assert cache[0].sharding.spec[1] == "data"
    np.testing.assert_allclose(logits, forward(cfg, params, tokens), rtol=1e-4, atol=1e-5)
    graphdef = nnx.graphdef(Llama(cfg, nnx.Rngs(0)))
    full = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t, constrain), compiler_options=analysis_options())(sharded, tokens)
    np.testing.assert_allclose(full, forward(cfg, params, tokens), rtol=1e-4, atol=1e-5)
    assert isinstance(full.sharding, NamedSharding) and full.sharding.spec[2] == "tensor"


def test_checks_refuse_bad_dims():
    from meshtrain.errors import UserError
    from meshtrain.models.llama import _check
    for bad, match in [(dict(num_kv_heads=3), "num_kv_heads"), (dict(num_heads=32, embed_dim=96), "odd"),
                       (dict(rope_scaling=dataclasses.replace(SCALING, high_freq_factor=0.5)), "rope_scaling"),
                       (dict(tie_embeddings="true"), "tie_embeddings")]:
        with pytest.raises(UserError, match=match):
            _check(tiny(**bad))


# Every tiny Llama layout on 8 fake devices against the same run on one device (its plain
# jax.grad), the layout's gradients read off its train step (support.training.trained).
LAYOUTS = ["llama_tiny_dp8", "llama_tiny_fsdp8", "llama_tiny_dp2_tp4", "llama_tiny_dp2_fsdp2_tp2",
           "llama_tiny_pp2_dp4"]


@pytest.fixture(scope="module")
def one_device():
    cfg = config_lib.load("llama_tiny_dp8", COMPARED.items())
    return losses_and_grads(cfg, devices=jax.devices()[:1], mesh_shape="data:1")


@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_matches_one_device(name, make_config, one_device):
    assert_same_training(name, trained(make_config(name, **COMPARED)), one_device)


# Hugging Face's implementation as the reference: RoPE (rotate_half), Llama 3 scaling,
# GQA, SwiGLU, RMSNorm. The conversion here is the plain transpose/reshape the params
# tree promises; the project's checkpoint conversion lives elsewhere.

def to_hf_state_dict(cfg, params):
    import torch
    t = lambda a: torch.tensor(np.asarray(a, np.float32))  # noqa: E731
    d, b = cfg.embed_dim, params["blocks"]
    sd = {"model.embed_tokens.weight": t(params["embed"]), "model.norm.weight": t(params["final_norm"]["scale"])}
    for i in range(cfg.num_layers):
        a, m, pre = b["attn"], b["mlp"], f"model.layers.{i}."
        sd |= {pre + "input_layernorm.weight": t(b["attn_norm"]["scale"][i]),
               pre + "post_attention_layernorm.weight": t(b["mlp_norm"]["scale"][i]),
               pre + "self_attn.q_proj.weight": t(a["wq"][i].reshape(d, -1).T),
               pre + "self_attn.k_proj.weight": t(a["wk"][i].reshape(d, -1).T),
               pre + "self_attn.v_proj.weight": t(a["wv"][i].reshape(d, -1).T),
               pre + "self_attn.o_proj.weight": t(a["wo"][i].reshape(-1, d).T),
               pre + "mlp.gate_proj.weight": t(m["w_gate"][i].T),
               pre + "mlp.up_proj.weight": t(m["w_up"][i].T),
               pre + "mlp.down_proj.weight": t(m["w_down"][i].T)}
    sd["lm_head.weight"] = t(params["embed"] if cfg.tie_embeddings else params["lm_head"].T)
    return sd


@pytest.mark.parametrize("kw", [dict(), dict(rope_theta=500_000.0, rope_scaling=SCALING, tie_embeddings=True)])
def test_matches_hugging_face_llama(kw):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = tiny(seq_len=64, **kw)
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        rope |= {"rope_type": "llama3", **dataclasses.asdict(cfg.rope_scaling)}
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.embed_dim, intermediate_size=cfg.mlp_dim,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, max_position_embeddings=cfg.seq_len,
        rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings, rope_parameters=rope,
        attn_implementation="eager")
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    np.testing.assert_allclose(inverse_frequencies(cfg), hf.model.rotary_emb.inv_freq.numpy(), rtol=1e-6)
    # Random scales too, so a norm applied in the wrong place cannot hide behind ones.
    params = params_of(cfg)
    k1, k2 = jax.random.split(jax.random.key(2))
    params["blocks"]["attn_norm"]["scale"] = 1 + 0.1 * jax.random.normal(k1, (2, 64))
    params["final_norm"]["scale"] = 1 + 0.1 * jax.random.normal(k2, (64,))
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(cfg, params), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    tokens = jax.random.randint(jax.random.key(3), (2, 64), 0, cfg.vocab_size)
    with torch.no_grad():
        ref = hf(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(forward(cfg, params, tokens), ref, rtol=1e-4, atol=1e-4)
