"""Hugging Face interop: tiny random transformers models (saved offline, tests/support/hf_models.py)
convert to meshtrain checkpoints whose logits match transformers', export back bit for
bit, and start a fine-tuning run under any layout with the first loss of the HF model."""

import dataclasses
import json
import shutil

import jax
import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from support import hf_models  # noqa: E402
from meshtrain import convert, tree_paths  # noqa: E402
from meshtrain.checkpoints import init_from, reading
from meshtrain.errors import UserError  # noqa: E402
from meshtrain.run.experiment import Experiment  # noqa: E402
from meshtrain.step import state as state_lib
from support.conversion import LAYOUTS, TOKENS, assert_bitwise_equal, assert_logits_match, finetune_config, first_loss, meshtrain_logits, quiet, safetensors_of

LLAMAS = {"plain_untied": {}, "llama3_scaled_tied": {"scaling": hf_models.LLAMA3_SCALING, "tied": True}}


# --- conversion: logits and round trips ------------------------------------------------

@pytest.mark.parametrize("shard", [None, "40KB"], ids=["one_file", "sharded"])
def test_gpt2_converts_with_transformers_logits_and_exports_bitwise(tmp_path, shard):
    hf = hf_models.gpt2(tmp_path / "hf", shard_size=shard)
    hf_models.add_tokenizer(hf, eos="<|endoftext|>")
    convert.from_hf(hf, tmp_path / "ckpt", say=quiet)
    theirs = hf_models.logits(hf, TOKENS)
    assert_logits_match(meshtrain_logits(tmp_path / "ckpt", TOKENS), theirs)
    convert.to_hf(tmp_path / "ckpt", tmp_path / "out", say=quiet)
    assert_bitwise_equal(hf, tmp_path / "out")
    np.testing.assert_array_equal(hf_models.logits(tmp_path / "out", TOKENS), theirs)


@pytest.mark.parametrize("variant", LLAMAS)
def test_llama_converts_with_transformers_logits_and_exports_bitwise(tmp_path, variant):
    hf = hf_models.llama(tmp_path / "hf", shard_size="60KB", **LLAMAS[variant])
    convert.from_hf(hf, tmp_path / "ckpt", say=quiet)
    src = init_from.read(tmp_path / "ckpt")
    assert src.family == "llama" and src.architecture["num_kv_heads"] == 2
    assert src.architecture["tie_embeddings"] == (variant == "llama3_scaled_tied")
    theirs = hf_models.logits(hf, TOKENS)
    assert_logits_match(meshtrain_logits(tmp_path / "ckpt", TOKENS), theirs)
    convert.to_hf(tmp_path / "ckpt", tmp_path / "out", say=quiet)
    assert_bitwise_equal(hf, tmp_path / "out")
    # The exported config.json (RoPE in transformers 4's keys) means the same model.
    np.testing.assert_array_equal(hf_models.logits(tmp_path / "out", TOKENS), theirs)


def test_bf16_stays_bf16_both_ways(tmp_path):
    import torch
    hf = hf_models.llama(tmp_path / "hf", dtype=torch.bfloat16)
    convert.from_hf(hf, tmp_path / "ckpt", say=quiet)
    saved = reading.saved_params(init_from.read(tmp_path / "ckpt"))
    assert {np.dtype(m.dtype).name for m in saved.values()} == {"bfloat16"}
    convert.to_hf(tmp_path / "ckpt", tmp_path / "out", say=quiet)
    assert_bitwise_equal(hf, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    convert.to_hf(tmp_path / "ckpt", tmp_path / "f32", dtype="float32", say=quiet)
    assert {d for d, _, _ in safetensors_of(tmp_path / "f32").values()} == {"F32"}
    # A float32 run reads the bf16 params cast (exactly) to float32.
    src, cfg = finetune_config(tmp_path / "ckpt", "data:1", "dp")
    exp = Experiment.build(cfg, devices=jax.devices()[:1], mesh_shape="data:1")
    params = tree_paths.flat(jax.device_get(reading.load_params(src, exp.model, exp.shardings.params)))
    wq = reading.read_leaf(src, "blocks/attn/wq", "blocks")
    assert params["blocks/attn/wq"].dtype == np.float32
    np.testing.assert_array_equal(params["blocks/attn/wq"], wq.astype(np.float32))


def test_the_tokenizer_follows_the_model(tmp_path):
    from meshtrain.data.tokenizers import load_tokenizer, make_tokenizer
    hf = hf_models.llama(tmp_path / "hf")
    hf_models.add_tokenizer(hf, eos="</s>")
    convert.from_hf(hf, tmp_path / "ckpt", say=quiet)
    src = init_from.read(tmp_path / "ckpt")
    assert src.tokenizer == f"hf:{tmp_path / 'ckpt' / 'tokenizer'}"
    tok = make_tokenizer(src.tokenizer)
    # The model's own end of sequence, no "<|endoftext|>" added: ids stay in its vocabulary.
    assert tok.eot_id == tok.hf.token_to_id("</s>") and tok.vocab_size == hf_models.VOCAB
    ids = tok.encode("the quick brown fox </s>")
    assert ids.max() < hf_models.VOCAB and tok.eot_id not in ids
    tok.save(tmp_path / "saved.json")  # a prepared dataset carries it
    assert load_tokenizer(tmp_path / "saved.json").encode("hello mesh").tolist() == tok.encode("hello mesh").tolist()
    convert.to_hf(tmp_path / "ckpt", tmp_path / "out", say=quiet)
    from transformers import AutoTokenizer
    theirs = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert theirs("hello mesh", add_special_tokens=False)["input_ids"] == tok.encode("hello mesh").tolist()


TIKTOKEN_RANKS = [bytes([b]) for b in range(256)] + [b"th", b"the", b" the"]


def tiktoken_tokenizer(directory):
    """Meta's tokenizer.model format (a "base64 rank" line a token), a tiny vocabulary."""
    import base64
    (directory / "tokenizer.model").write_text(
        "".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(TIKTOKEN_RANKS)))
    from meshtrain.data.tokenizers import make_tokenizer
    return make_tokenizer(f"hf:{directory}")


def test_a_tiktoken_tokenizer_model_is_read_offline(tmp_path):
    tok = tiktoken_tokenizer(tmp_path)
    assert tok.vocab_size == len(TIKTOKEN_RANKS) + 256 and tok.eot_id == len(TIKTOKEN_RANKS) + 1  # <|end_of_text|>
    assert tok.decode(tok.encode("the theme")) == "the theme"


def test_a_llama_3_converted_from_its_tokenizer_model_sees_begin_of_text_first_in_a_prompt(tmp_path):
    """A checkpoint converted with Meta's tokenizer.model (no tokenizer.json, so no
    post-processor) encodes prompts with <|begin_of_text|> first, as Meta's reference
    (bos=True) and the tokenizer.json transformers converts it to do; a run from scratch
    with the same tokenizer (prompt_special_tokens false) does not."""
    from meshtrain import sample
    from meshtrain.sampling import sources
    tok = tiktoken_tokenizer(tmp_path)
    bos = len(TIKTOKEN_RANKS)  # Llama 3's first special token
    plain = tok.encode("the theme").tolist()
    assert sample.encode_prompt("the theme", sources.prompt_tokenizer(tok, True), 1024) == [bos, *plain]
    assert sample.encode_prompt("", sources.prompt_tokenizer(tok, True), 1024) == [bos]
    assert sample.encode_prompt("the theme", sources.prompt_tokenizer(tok, False), 1024) == plain


# --- errors: one paragraph naming what is wrong and what is supported ------------------

def _error(tmp_path, hf_dir) -> str:
    with pytest.raises(UserError) as e:
        convert.from_hf(hf_dir, tmp_path / "ckpt", say=quiet)
    message = str(e.value)
    assert "\n" not in message
    return message


def test_bad_directories_are_one_paragraph(tmp_path, capsys):
    assert "no config.json" in _error(tmp_path, tmp_path)
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    message = _error(tmp_path, tmp_path / "bert")
    assert "'bert'" in message and "LlamaForCausalLM" in message and "GPT2LMHeadModel" in message
    # The CLI: status 2, the paragraph on stderr, no traceback.
    assert convert.main(["from_hf", f"--model={tmp_path / 'bert'}", f"--out={tmp_path / 'x'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshtrain convert: error: ") and "Traceback" not in err
    assert convert.main(["to_hf", "--model=x"]) == 2


def _edit_config(directory, **changes):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_unsupported_llama_features_are_named(tmp_path):
    hf = hf_models.llama(tmp_path / "hf")
    _edit_config(hf, attention_bias=True)
    assert "attention_bias is true" in _error(tmp_path, hf)
    _edit_config(hf, attention_bias=False, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4})
    message = _error(tmp_path, hf)
    assert "'yarn'" in message and "llama3" in message
    _edit_config(hf, rope_parameters=None, rope_scaling={"type": "linear", "factor": 2.0})
    assert "'linear'" in _error(tmp_path, hf)
    _edit_config(hf, rope_scaling=None, hidden_act="gelu")
    assert "hidden_act is 'gelu'" in _error(tmp_path, hf)


def test_missing_and_unknown_tensors_are_named(tmp_path):
    from safetensors.numpy import load_file, save_file
    hf = hf_models.gpt2(tmp_path / "hf")
    tensors = load_file(hf / "model.safetensors")
    dropped = tensors.pop("transformer.h.1.mlp.c_fc.bias")
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    message = _error(tmp_path, hf)
    assert "lacks 1 of the" in message and "transformer.h.1.mlp.c_fc.bias" in message
    tensors["transformer.h.1.mlp.c_fc.bias"] = dropped
    tensors["transformer.h.0.mlp.gate.weight"] = dropped
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    assert "transformer.h.0.mlp.gate.weight" in _error(tmp_path, hf)
    (hf / "model.safetensors").unlink()
    assert "no model.safetensors" in _error(tmp_path, hf)


def test_an_existing_output_is_not_overwritten(tmp_path):
    hf = hf_models.gpt2(tmp_path / "hf")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "x").write_text("")
    assert "already exists" in _error(tmp_path, hf)


# --- fine-tuning: init.from under any layout ---------------------------------------------


@pytest.fixture(scope="module")
def gpt2_ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpt2")
    hf = hf_models.gpt2(d / "hf")
    convert.from_hf(hf, d / "ckpt", say=quiet)
    return hf, d / "ckpt"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpt2_finetuning_starts_at_the_hf_loss(gpt2_ckpt, layout):
    hf, ckpt = gpt2_ckpt
    # seq_len 32 < the 64 positions: the position table is cut to the run's length.
    src, cfg = finetune_config(ckpt, *LAYOUTS[layout], seq_len=32)
    loss, batch = first_loss(src, cfg)
    ref = hf_models.loss(hf, batch)
    assert abs(loss - ref) / ref < 1e-5, (loss, ref)


@pytest.mark.parametrize("layout", ["dp8", "dp2_tp4"])
def test_llama_finetuning_starts_at_the_hf_loss(tmp_path, layout):
    hf = hf_models.llama(tmp_path / "hf")
    convert.from_hf(hf, tmp_path / "ckpt", say=quiet)
    src, cfg = finetune_config(tmp_path / "ckpt", *LAYOUTS[layout], seq_len=32)
    loss, batch = first_loss(src, cfg)
    ref = hf_models.loss(hf, batch)
    assert abs(loss - ref) / ref < 1e-5, (loss, ref)


def test_a_run_whose_model_differs_is_refused(gpt2_ckpt):
    _, ckpt = gpt2_ckpt
    src, cfg = finetune_config(ckpt, "data:1", "dp")
    with pytest.raises(UserError, match=r"model.num_layers=4 \(the checkpoint has 2\)"):
        cfg.model.num_layers = 4
        init_from.model_dims(src, cfg.model)
    cfg.model.num_layers, cfg.model.seq_len = 2, 128
    with pytest.raises(UserError, match="longer than the 64 positions"):
        init_from.model_dims(src, cfg.model)
    cfg.model.update(seq_len=32, mlp_dim=128)
    with pytest.raises(UserError, match="model.mlp_dim=128"):
        init_from.model_dims(src, cfg.model)
    with pytest.raises(UserError, match="model.mlp_dim=128"):  # the same, from the run's config
        Experiment.build(cfg, devices=jax.devices()[:1], mesh_shape="data:1")
    # A run built without model_dims (init.from unset) is refused when the params are read.
    cfg.init["from"] = ""
    cfg.model.update(name="gpt2", num_layers=2, embed_dim=64, num_heads=4, seq_len=32)
    exp = Experiment.build(cfg, devices=jax.devices()[:1], mesh_shape="data:1")
    with pytest.raises(UserError, match="mlp_dim: run 128, checkpoint 256"):
        reading.load_params(src, exp.model, exp.shardings.params)


def test_a_training_run_exports_and_restarts_under_another_layout(tmp_path, capsys):
    """A pipelined run's checkpoint (padded vocabulary, [stage, layer] stacks) goes to
    Hugging Face with the logits of its params, and into a dp2_tp4 run unchanged. Its
    synthetic data has no tokenizer: one warning line says so, and the configs carry no
    token id (GPT2Config's default, 50256, would lie outside its 200 ids)."""
    from meshtrain import train
    work = tmp_path / "run"
    assert train.run(["--config=gpt2_tiny_pp2_dp4", f"--workdir={work}", "--config.train.steps=2",
                      "--config.train.eval_every=0", "--config.model.vocab_size=200",
                      "--config.checkpoint.async=false"]) == 0
    src = init_from.read(work)
    assert src.family == "gpt2" and src.pipeline == (2, 1) and src.architecture["vocab_size"] == 200
    capsys.readouterr()
    convert.to_hf(work, tmp_path / "hf", say=quiet)
    assert capsys.readouterr().err == (f"meshtrain convert: warning: {tmp_path / 'hf'} has no tokenizer: the run "
                                       f"trained on synthetic data, token ids that stand for no text.\n")
    assert not list((tmp_path / "hf").glob("tokenizer*"))
    for name in ("config.json", "generation_config.json"):
        config = json.loads((tmp_path / "hf" / name).read_text())
        assert config.get("eos_token_id") is None and config.get("bos_token_id") is None, config
    tokens = TOKENS % 200
    assert_logits_match(meshtrain_logits(work, tokens)[..., :200], hf_models.logits(tmp_path / "hf", tokens))
    _, cfg = finetune_config(work, *LAYOUTS["dp2_tp4"])
    exp = Experiment.build(cfg)
    params = jax.device_get(reading.load_params(src, exp.model, exp.shardings.params))
    model = state_lib.abstract_model(src.model_config())
    for path, leaf in tree_paths.flat(params).items():  # both padded to 256 rows
        np.testing.assert_array_equal(leaf, reading.read_leaf(src, path, model.stacked), err_msg=path)
    shutil.rmtree(work)


def test_a_finetuned_run_exports_with_its_origins_config(tmp_path):
    """A fine-tuned run's checkpoint, whose meta["run"] names its family, architecture and
    init.from (what training records), exports its own params with the converted model's
    config.json settings (context length, token ids)."""
    from meshtrain import models
    from meshtrain.checkpoints import store as checkpoint_lib
    hf = hf_models.llama(tmp_path / "hf")
    convert.from_hf(hf, tmp_path / "ckpt", say=quiet)
    src, cfg = finetune_config(tmp_path / "ckpt", "data:1", "dp", seq_len=16)
    exp = Experiment.build(cfg, devices=jax.devices()[:1], mesh_shape="data:1")
    state, batches = reading.init_state(src, exp), exp.train_batches()
    step = exp.compile(analysis=True)  # two steps: as first_loss compiles its one
    for _ in range(2):  # the first step's lr is 0 (warmup)
        state, _ = step(state, exp.put_batch(next(batches)))
    run = {**init_from.run_summary(exp), "family": "llama", "init_from": str(tmp_path / "ckpt"),
           "architecture": models.architecture(exp.model.cfg)}
    checkpointer = checkpoint_lib.Checkpointer(tmp_path / "work" / "checkpoints", every=1, keep=1, use_async=False)
    checkpointer.save(1, state, {"data": {}, "skipped": 0, "run": run})
    checkpointer.close()
    convert.to_hf(tmp_path / "work", tmp_path / "out", say=quiet)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["max_position_embeddings"], config["eos_token_id"], config["vocab_size"]) == (64, 2, hf_models.VOCAB)
    theirs = hf_models.logits(tmp_path / "out", TOKENS[:, :16])
    assert_logits_match(meshtrain_logits(tmp_path / "work", TOKENS[:, :16]), theirs)
    assert np.abs(theirs - hf_models.logits(hf, TOKENS[:, :16])).max() > 1e-4  # it was trained


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory):
    """from_hf of a Llama whose tokenizer.json puts "<s>" (BOS) first, then `meshtrain.train
    --config.init.from` on text under dp2_tp4 (the tokenizer follows the checkpoint):
    (the Hugging Face directory, CKPT, the run's workdir, what training printed)."""
    import contextlib
    import io

    from meshtrain import train
    d = tmp_path_factory.mktemp("finetuned")
    hf = hf_models.llama(d / "hf")
    hf_models.add_tokenizer(hf, eos="</s>", bos=True)
    convert.from_hf(hf, d / "ckpt", say=quiet)
    text = d / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    work, out = d / "run", io.StringIO()
    with contextlib.redirect_stdout(out):
        assert train.run(["--config=llama_tiny_dp2_tp4", f"--workdir={work}", f"--config.init.from={d / 'ckpt'}",
                          "--config.data.kind=text", f"--config.data.path={text}", "--config.model.seq_len=32",
                          "--config.train.steps=3", "--config.train.batch_size=8", "--config.train.log_every=1",
                          "--config.train.eval_every=0", "--config.checkpoint.async=false"]) == 0
    return hf, d / "ckpt", work, out.getvalue()


def test_the_cli_finetunes_a_converted_model_exports_it_and_samples(finetuned, tmp_path, capsys):
    """The fine-tuned run exports with to_hf (transformers loads it) and meshtrain.sample
    samples it, its prompt led by the converted Llama's BOS."""
    from meshtrain import sample
    _, _, work, out = finetuned
    assert "init.from: " in out and "step 0, fresh optimizer" in out, out
    run = json.loads((work / "run.json").read_text())
    assert run["model"]["family"] == "llama" and run["config"]["data"]["tokenizer"].startswith("hf:")
    convert.to_hf(work, tmp_path / "out", say=quiet)
    tokens = TOKENS % run["model"]["vocab_size"]
    assert_logits_match(meshtrain_logits(work, tokens), hf_models.logits(tmp_path / "out", tokens))
    assert sample.main([f"--workdir={work}", "--prompt=the quick", "--max_new_tokens=5", "--temperature=0"]) == 0
    assert capsys.readouterr().out.startswith("<s>the quick")


def test_a_finetuned_run_encodes_prompts_as_the_model_it_came_from(finetuned):
    """What Llama's tokenizer does to a prompt (BOS first, as transformers' tokenizer(text))
    travels with every checkpoint made from the converted one: sampling the fine-tuned run,
    by its workdir or as a checkpoint, encodes a prompt to the converted model's ids; a
    run started from it (init.from) or resumed from it records the same, and a run from
    scratch does not (its model never saw BOS)."""
    from transformers import AutoTokenizer

    from meshtrain import sample
    from meshtrain.sampling import sources
    hf, ckpt, work, _ = finetuned
    text = "hello world, the quick"

    def prompt(**given) -> list[int]:
        flags = dict(workdir=None, checkpoint=None, step=None, mesh=None, layout=None, dtype=None) | given
        loaded = (sources.from_workdir if flags["workdir"] else sources.from_checkpoint)(flags)
        return sample.encode_prompt(text, loaded.tokenizer, loaded.model.cfg.vocab_size)
    theirs = AutoTokenizer.from_pretrained(hf)
    expected = theirs(text).input_ids
    assert expected == [theirs.convert_tokens_to_ids("<s>")] + theirs(text, add_special_tokens=False).input_ids
    assert prompt(checkpoint=str(ckpt)) == expected
    assert prompt(checkpoint=str(work)) == expected
    assert prompt(workdir=str(work)) == expected
    # A run from the run, or resumed from its checkpoint without init.from, keeps it.
    src = init_from.read(work)
    assert src.prompt_special_tokens and src.meta["run"]["prompt_special_tokens"] is True
    _, cfg = finetune_config(work, "data:1", "dp", seq_len=32)
    exp = Experiment.build(cfg, devices=jax.devices()[:1], mesh_shape="data:1")
    assert init_from.run_summary(exp)["prompt_special_tokens"] is True
    scratch = dataclasses.replace(exp, init=None)
    assert init_from.run_summary(scratch, resumed=src.meta["run"])["prompt_special_tokens"] is True
    assert init_from.run_summary(scratch)["prompt_special_tokens"] is False
    # Checkpoints written before meta carried it: a converted one did, a run as its origin.
    assert init_from.prompt_special_tokens({"family": "llama", "tokenizer": "hf:tokenizer"})
    assert init_from.prompt_special_tokens({"run": {"init_from": str(ckpt)}})
    assert not init_from.prompt_special_tokens({"run": {"init_from": str(work / "gone")}})
