"""Hugging Face interop for the mixtral family: a tiny random MixtralForCausalLM (saved
offline, tests/support/hf_models.py) converts with transformers' logits from either layout of
its experts, exports back bit for bit, fine-tunes from its first loss, samples what
transformers' generate does; the closed-form parameter counts equal transformers'."""

import json

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from support import hf_models  # noqa: E402
from meshtrain import convert, sample  # noqa: E402
from meshtrain.checkpoints import init_from  # noqa: E402
from meshtrain.errors import UserError  # noqa: E402
from meshtrain.models import mixtral, sizes  # noqa: E402
from support.conversion import (LAYOUTS, TOKENS, assert_bitwise_equal, assert_logits_match, finetune_config,  # noqa: E402
                          first_loss, meshtrain_logits, quiet, safetensors_of)
from support.sampling import samples  # noqa: E402

# The config.json keys that make a MixtralForCausalLM what it is.
KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "num_local_experts", "num_experts_per_tok", "vocab_size", "max_position_embeddings", "rms_norm_eps",
        "tie_word_embeddings", "router_aux_loss_coef", "sliding_window", "bos_token_id", "eos_token_id")


# Top-k is not decided by rounding when the k-th and (k+1)-th router logits are this far
# apart: they are ~3 here and float32 rounds them by ~1e-6 (the closest call is ~9e-4).
ROUTER_MARGIN = 1e-4


def router_margin(directory, tokens) -> float:
    """The smallest gap, over tokens and layers, between the k-th and (k+1)-th router
    logit of the saved model: how far top-k is from a tie that rounding could flip."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    k = model.config.num_experts_per_tok
    with torch.no_grad():
        logits = model(torch.as_tensor(np.asarray(tokens)), output_router_logits=True).router_logits
    top = torch.stack(logits).float().topk(k + 1, dim=-1).values
    return float((top[..., k - 1] - top[..., k]).min())


def config_of(directory) -> dict:
    from transformers import AutoConfig
    c = AutoConfig.from_pretrained(directory)
    return {**{k: getattr(c, k) for k in KEYS}, "rope_theta": c.rope_parameters["rope_theta"],
            "architectures": c.architectures}


@pytest.fixture(scope="module")
def per_expert(tmp_path_factory):
    """Mistral's layout (what save_pretrained writes), in shards, converted."""
    d = tmp_path_factory.mktemp("mixtral")
    hf = hf_models.mixtral(d / "hf", shard_size="100KB")
    convert.from_hf(hf, d / "ckpt", say=quiet)
    return hf, d / "ckpt"


@pytest.mark.parametrize("fused", [False, True], ids=["per_expert", "fused"])
def test_converts_with_transformers_logits_and_exports_bitwise(per_expert, tmp_path, fused):
    """Both layouts convert to transformers' logits and export as save_pretrained writes:
    the fused file (the same weights, seed 0) exports to the per-expert file's bytes."""
    original, ckpt = per_expert
    hf = hf_models.mixtral(tmp_path / "hf", fused=True) if fused else original
    names = list(safetensors_of(hf))
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in names) == fused, names
    if fused:
        ckpt = tmp_path / "ckpt"
        convert.from_hf(hf, ckpt, say=quiet)
    src = init_from.read(ckpt)
    assert src.family == "mixtral"
    assert {k: src.architecture[k] for k in ("num_experts", "experts_per_token", "num_shared_experts",
                                             "rope_theta", "tie_embeddings")} == {
        "num_experts": 4, "experts_per_token": 2, "num_shared_experts": 0, "rope_theta": 1e6,
        "tie_embeddings": False}
    assert router_margin(hf, TOKENS) > ROUTER_MARGIN
    theirs = hf_models.logits(hf, TOKENS)
    ours = meshtrain_logits(ckpt, TOKENS)
    print(f"logits: max |ours - transformers'| / max |transformers'| = "
          f"{np.abs(ours - theirs).max() / np.abs(theirs).max():.2e}")
    assert_logits_match(ours, theirs)
    convert.to_hf(ckpt, tmp_path / "out", say=quiet, warn=quiet)
    assert_bitwise_equal(original, tmp_path / "out")
    np.testing.assert_array_equal(hf_models.logits(tmp_path / "out", TOKENS), theirs)
    assert config_of(tmp_path / "out") == config_of(hf)


@pytest.mark.parametrize("layout", ["dp8", "dp2_tp4"])
def test_finetuning_starts_at_the_hf_loss(per_expert, layout):
    """init.from: the first training loss is transformers' cross entropy (router losses off,
    dropless, so that nothing but the language-model loss is compared)."""
    hf, ckpt = per_expert
    src, cfg = finetune_config(ckpt, *LAYOUTS[layout], seq_len=32)
    cfg.moe.update(aux_loss_coef=0.0, z_loss_coef=0.0)
    loss, batch = first_loss(src, cfg)
    ref = hf_models.loss(hf, batch)
    assert abs(loss - ref) / ref < 1e-5, (loss, ref)


HF_NEW = 16
HF_PROMPT = [3, 17, 42, 7, 99]


@pytest.fixture(scope="module")
def peaked(tmp_path_factory):
    """Weights drawn with std 0.5 (the router's unscaled): peaked logits, and neither the
    argmax nor top-k near a tie along the way (as tests/test_sample.py's hf_ckpt)."""
    d = tmp_path_factory.mktemp("mixtral_peaked")
    hf = hf_models.mixtral(d / "hf", initializer_range=0.5, router_scale=1.0)
    convert.from_hf(hf, d / "ckpt", say=quiet)
    expected, gap = hf_models.greedy(hf, HF_PROMPT, HF_NEW)
    assert len(expected) == HF_NEW and len(set(expected)) > 4 and gap > 1e-2, (expected, gap)
    assert router_margin(hf, [HF_PROMPT + expected]) > ROUTER_MARGIN
    return d / "ckpt", expected


@pytest.mark.parametrize("mesh", [[], ["--mesh=data:2,tensor:4", "--layout=dp_tp"]], ids=["one_device", "dp2_tp4"])
def test_greedy_sample_equals_transformers_generate(peaked, capsys, mesh):
    ckpt, expected = peaked
    assert sample.main([f"--checkpoint={ckpt}", f"--prompt={','.join(map(str, HF_PROMPT))}",
                        f"--max_new_tokens={HF_NEW}", "--temperature=0", *mesh]) == 0
    out = capsys.readouterr()
    assert samples(out.out) == [HF_PROMPT + expected]
    assert "mixtral: 2 layers" in out.err and "converted from" in out.err, out.err


def test_shared_experts_do_not_export(tmp_path):
    """A mixtral with shared experts (meshtrain's) has no MixtralForCausalLM form."""
    from meshtrain import tree_paths
    from meshtrain.checkpoints import reading
    from meshtrain.step import state as state_lib
    arch = dict(sizes.MIXTRAL_SIZES["tiny"], num_shared_experts=1)
    model = state_lib.abstract_model(init_from.config_of("mixtral", arch))
    params = {p: np.zeros(s.shape, np.float32) for p, s in tree_paths.flat(model.shapes).items()}
    assert "blocks/moe/shared_gate" in params
    convert.write_checkpoint(tmp_path / "ckpt", reading.nest(params),
                             {"family": "mixtral", "architecture": arch, "tokenizer": None, "source": {}})
    with pytest.raises(UserError, match="num_shared_experts=1: shared experts are meshtrain's"):
        convert.to_hf(tmp_path / "ckpt", tmp_path / "out", say=quiet, warn=quiet)
    assert not (tmp_path / "out").exists()


def test_a_sliding_window_is_refused(tmp_path):
    hf = hf_models.mixtral(tmp_path / "hf", sliding_window=32)
    with pytest.raises(UserError, match="sliding_window=32 is shorter than max_position_embeddings=64"):
        convert.from_hf(hf, tmp_path / "ckpt", say=quiet)
    # As long as the context, a window changes nothing: it converts.
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "sliding_window": 64}))
    convert.from_hf(hf, tmp_path / "ckpt", say=quiet)


# The real configs (the Hub's mistralai/Mixtral-8x7B-v0.1 and -8x22B-v0.1 config.json), the
# published totals and active counts (Jiang et al. 2024; Mistral's 8x22B announcement) with
# their significant figures.
REAL = {"mixtral_8x7b": (46.7e9, 12.9e9, 3, 3), "mixtral_8x22b": (141e9, 39e9, 3, 2)}


def _round(n: float, figures: int) -> float:
    return float(f"{n:.{figures}g}")


@pytest.mark.parametrize("size", REAL)
def test_parameter_counts_equal_transformers(size):
    """mixtral.num_params and active_params equal the parameters of transformers'
    MixtralForCausalLM of the same config, built on the meta device (no weights)."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM
    s = sizes.MIXTRAL_SIZES[size]
    cfg = init_from.config_of("mixtral", s)
    hf_cfg = MixtralConfig(vocab_size=s["vocab_size"], hidden_size=s["embed_dim"], intermediate_size=s["mlp_dim"],
                           num_hidden_layers=s["num_layers"], num_attention_heads=s["num_heads"],
                           num_key_value_heads=s["num_kv_heads"], num_local_experts=s["num_experts"],
                           num_experts_per_tok=s["experts_per_token"], tie_word_embeddings=False)
    with torch.device("meta"):
        model = MixtralForCausalLM(hf_cfg)
    total = sum(p.numel() for p in model.parameters())
    experts = model.model.layers[0].mlp.experts
    per_expert = sum(p.numel() for p in experts.parameters()) // s["num_experts"]
    active = total - s["num_layers"] * (s["num_experts"] - s["experts_per_token"]) * per_expert
    assert per_expert == 3 * s["embed_dim"] * s["mlp_dim"]
    assert (mixtral.num_params(cfg), mixtral.active_params(cfg)) == (total, active)
    published_total, published_active, total_figures, active_figures = REAL[size]
    assert _round(total, total_figures) == published_total, total
    assert _round(active, active_figures) == published_active, active
