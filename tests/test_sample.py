"""Sampling: greedy decoding with the KV cache equals recomputing the whole prefix at every
step (one device and tensor parallel, GPT-2 and Llama, a pipelined run's checkpoint); the
sampling knobs; `python -m meshtrain.sample` end to end and its errors; --checkpoint: a
converted Hugging Face model samples what transformers' greedy `generate` does."""

import dataclasses
import json
import subprocess
import sys

from support import hf_models  # builds Hugging Face models; imports torch and transformers when called
import jax
import numpy as np
import pytest

from meshtrain import config as config_lib, sample
from meshtrain.checkpoints import init_from, store as checkpoint_lib
from meshtrain.parallel.pipeline.scan import from_stages
from meshtrain.run.experiment import Experiment
from meshtrain.sampling import generate as gen
from support.sampling import N_NEW, greedy_by_recompute, make_prompts, peaky, samples
from support.processes import own_devices_env


@pytest.fixture(scope="module", params=["gpt2_tiny_dp2_tp4", "llama_tiny_dp2_tp4"])
def tiny(request):
    """A tiny model on one device: its experiment, peaky params, prompts, the reference
    greedy tokens and the compiled generation."""
    cfg = config_lib.load(request.param)
    one = Experiment.build(cfg, devices=jax.devices()[:1], mesh_shape="data:1")
    # jitted: eagerly, each initialiser compiles on its own
    params = jax.device_get(peaky(jax.jit(one.model.init_params, static_argnums=0)(0)))
    prompts = make_prompts(np.random.default_rng(0), 3, one.model.cfg.vocab_size)
    expected = greedy_by_recompute(one.model, params, prompts, N_NEW)
    assert len({tuple(r) for r in expected}) == 3  # the context decides: the test can fail
    fn = gen.make_generate(one.model, one.layout, one.mesh, one.shardings.params, max_new_tokens=N_NEW)
    return dict(cfg=cfg, exp=one, params=params, prompts=prompts, expected=expected, fn=fn)


def _run(t, **knobs):
    exp = t["exp"]
    return gen.generate(t["fn"], t["params"], t["prompts"], exp.layout, exp.mesh, **knobs)


def test_greedy_with_cache_equals_recompute_on_one_device(tiny):
    np.testing.assert_array_equal(_run(tiny, temperature=0.0), tiny["expected"])


def test_greedy_with_cache_equals_recompute_under_dp2_tp4(tiny):
    exp = Experiment.build(tiny["cfg"])
    assert dict(exp.mesh.shape) == {"data": 2, "stage": 1, "fsdp": 1, "context": 1, "expert": 1, "tensor": 4}
    fn = gen.make_generate(exp.model, exp.layout, exp.mesh, exp.shardings.params, max_new_tokens=N_NEW)
    params = jax.device_put(tiny["params"], exp.shardings.params)
    # 3 samples over data=2: padded to 4 rows, the extra dropped.
    assert gen.padded_rows(3, exp.layout, exp.mesh) == 4
    out = gen.generate(fn, params, tiny["prompts"], exp.layout, exp.mesh, temperature=0.0)
    np.testing.assert_array_equal(out, tiny["expected"])


def test_sampling_knobs(tiny):
    greedy = tiny["expected"]
    # Keeping only the top token, by count or by mass, is greedy whatever the draw.
    np.testing.assert_array_equal(_run(tiny, temperature=1.0, top_k=1, seed=3), greedy)
    np.testing.assert_array_equal(_run(tiny, temperature=1.0, top_p=1e-6, seed=3), greedy)
    a, b, c = (_run(tiny, temperature=1.0, seed=s) for s in (7, 7, 8))
    np.testing.assert_array_equal(a, b)
    assert (a != c).any() and (a != greedy).any()
    assert len({tuple(r) for r in _run(tiny, temperature=1.0, top_k=0, seed=7)}) == 3


def test_sample_logits_filters():
    """Draws stay in the top k / the nucleus and follow the softmax."""
    probs = np.array([0.5, 0.3, 0.1, 0.06, 0.04])
    logits = np.tile(np.log(probs), (4000, 1)).astype(np.float32)
    key = jax.random.key(0)
    draw = jax.jit(gen.sample_logits)

    def freq(**kw):
        knobs = dict(temperature=1.0, top_k=0, top_p=1.0) | kw
        toks = np.asarray(draw(logits, key, knobs["temperature"], knobs["top_k"], knobs["top_p"]))
        return np.bincount(toks, minlength=len(probs)) / len(toks)
    np.testing.assert_allclose(freq(), probs, atol=0.03)
    np.testing.assert_array_equal(freq(temperature=0.0), [1, 0, 0, 0, 0])
    top3 = freq(top_k=3)
    assert top3[3:].sum() == 0
    np.testing.assert_allclose(top3[:3], probs[:3] / probs[:3].sum(), atol=0.03)
    # Mass before token i: 0, .5, .8 -> top_p=0.75 keeps tokens 0 and 1.
    nucleus = freq(top_p=0.75)
    assert nucleus[2:].sum() == 0 and nucleus[1] > 0.3
    assert freq(temperature=0.2)[0] > freq()[0]  # colder: more mass on the mode


def _write_run_json(workdir, exp):
    """The run.json keys sampling reads (meshtrain.train writes them and more)."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "run.json").write_text(json.dumps({
        "config": exp.cfg.to_dict(), "model": dataclasses.asdict(exp.model.cfg),
        "mesh": {"shape": dict(exp.mesh.shape)}}))


def test_pipelined_checkpoint_samples_in_layer_order(tmp_path, capsys):
    """A GPipe run's [stage, layers/stage] stacks are read and put back in layer order:
    the greedy sample equals the unpipelined model's recomputed one."""
    cfg = config_lib.load("gpt2_tiny_pp2_dp4")
    exp = Experiment.build(cfg)
    assert exp.model.pipeline is not None
    state = exp.init_state()
    state = state.replace(params=peaky(state.params))
    ckpt = checkpoint_lib.Checkpointer(tmp_path / "checkpoints", every=1, keep=1, use_async=False)
    ckpt.save(5, state, {"run": init_from.run_summary(exp)})
    ckpt.close()
    _write_run_json(tmp_path, exp)

    prompt = [3, 1, 4, 1, 5]
    assert sample.main([f"--workdir={tmp_path}", "--prompt=3,1,4,1,5", "--num_samples=2",
                        f"--max_new_tokens={N_NEW}", "--temperature=0"]) == 0
    out = capsys.readouterr()
    lines = out.out.splitlines()
    assert lines[1] == lines[3] == sample.SEPARATOR and lines[0] == lines[2]
    assert "step 5" in out.err and "data:4,stage:2" in out.err and "in 8 rows" in out.err

    params = jax.device_get(state.params)
    params[exp.model.stacked] = from_stages(params[exp.model.stacked], exp.model.pipeline)
    flat = dataclasses.replace(exp.model, pipeline=None, shapes=None, axes=None)
    expected = greedy_by_recompute(flat, params, np.array([prompt]), N_NEW)[0]
    assert [int(i) for i in lines[0].split()] == prompt + list(expected)


# --- the command line -------------------------------------------------------------------

def run_cli(module, *args, timeout=600):
    """`python -m MODULE ARGS` in a fresh interpreter that simulates its own devices. It
    keeps the suite's other XLA flags (LLVM -O1, conftest.py): its programs compile as
    fast as the suite's and share their persistent cache."""
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          env=own_devices_env(), timeout=timeout)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The README's tiny run (gpt2_tiny_dp2_tp4) on a small text file, a few steps, trained
    in this process (the sampling commands are the ones under test)."""
    from meshtrain import train
    root = tmp_path_factory.mktemp("sample_cli")
    rng = np.random.default_rng(0)
    words = "the cat sat on a mat and ate its hat while a dog ran past".split()
    text = "\n".join(" ".join(rng.choice(words, 10)) for _ in range(150)) + "\n"
    (root / "corpus.txt").write_text(text)
    assert train.main(["--config=gpt2_tiny_dp2_tp4", f"--workdir={root / 'w'}",
                       "--config.data.kind=text", f"--config.data.path={root / 'corpus.txt'}",
                       "--config.train.steps=4", "--config.train.log_every=2",
                       "--config.train.eval_every=0"]) == 0
    return root / "w"


def test_cli_prints_samples(trained):
    r = run_cli("meshtrain.sample", f"--workdir={trained}", "--prompt=the cat", "--num_samples=3",
                "--max_new_tokens=20", "--top_k=20", "--seed=1")
    assert r.returncode == 0, r.stderr
    samples = r.stdout.split(sample.SEPARATOR + "\n")
    assert len(samples) == 4 and samples[-1] == ""  # each sample is followed by the separator
    assert all(s.startswith("the cat") for s in samples[:3])
    assert "step 4 of" in r.stderr and "mesh data:2,tensor:4" in r.stderr and "layout dp_tp" in r.stderr
    assert "3 sample(s) in 4 rows, prompt 7 tokens + 20 new" in r.stderr


def test_cli_bad_input_is_one_paragraph_with_status_2(trained):
    r = run_cli("meshtrain.sample", f"--workdir={trained}", "--prompt=" + "x" * 120,
                "--max_new_tokens=20", timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("meshtrain sample: error: The prompt (120 tokens) plus "
                               "--max_new_tokens=20 is 140 tokens") and "\n\n" not in r.stderr.strip()


@pytest.mark.parametrize("args, message", [
    (["--workdir={w}", "--bogus=1"], "Unrecognized arguments: --bogus=1. `meshtrain sample --help` lists the flags"),
    (["--prompt=hi"], "No --workdir or --checkpoint given: pass exactly one"),
    (["--workdir={w}", "--checkpoint={w}"], "Both --workdir and --checkpoint were given"),
    (["--workdir={w}", "--temperature=hot"], "Argument --temperature: invalid float value: 'hot'"),
    (["--workdir={w}", "--top_p=1.5"], "--top_p=1.5: must be in (0, 1]"),
    (["--workdir={w}", "--top_k=-1"], "--top_k=-1: must be >= 0"),
    (["--workdir={w}", "--num_samples=0"], "--num_samples=0: must be at least 1"),
    (["--workdir={w}", "--max_new_tokens"], "Argument --max_new_tokens: expected one argument"),
    (["--workdir={w}/nowhere"], "nowhere/run.json does not exist"),
    (["--workdir={w}", "--step=3"], "has no committed step 3; it has 4"),
    (["--workdir={w}", "--prompt=" + "x" * 128], "The prompt is 128 tokens, but the model's context is"),
    (["--workdir={w}", "--max_new_tokens=500"], "plus --max_new_tokens=500 is 501 tokens"),
    (["--workdir={empty}"], "No committed checkpoint in"),
])
def test_bad_input(trained, tmp_path, capsys, args, message):
    empty = tmp_path / "compiled_only"  # a run.json but no checkpoint, as train.steps=0 leaves
    empty.mkdir()
    (empty / "run.json").write_text((trained / "run.json").read_text())
    args = [a.format(w=trained, empty=empty) for a in args]
    assert sample.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("meshtrain sample: error:") and "\n" not in err, err
    assert message in err, err


# --- --checkpoint: a converted Hugging Face model --------------------------------------------

HF_NEW = 16
HF_PROMPT = [3, 17, 42, 7, 99]


def _quiet(*_):
    pass


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def hf_ckpt(request, tmp_path_factory):
    """A tiny random HF model (Llama: 4 heads over 2 kv heads) converted without a
    tokenizer, and transformers' greedy continuation of HF_PROMPT. Weights drawn with
    std 0.5 (not 0.02): the logits are peaked, the argmax is never near a tie, and the
    continuation depends on the context."""
    pytest.importorskip("transformers")
    from meshtrain import convert
    root = tmp_path_factory.mktemp(f"hf_{request.param}")
    hf = getattr(hf_models, request.param)(root / "hf", initializer_range=0.5)
    convert.from_hf(hf, root / "ckpt", say=_quiet)
    expected, gap = hf_models.greedy(hf, HF_PROMPT, HF_NEW)
    assert len(expected) == HF_NEW and len(set(expected)) > 4 and gap > 1e-2, (expected, gap)
    return root / "ckpt", expected


def test_checkpoint_greedy_equals_transformers_on_one_device(hf_ckpt, capsys):
    ckpt, expected = hf_ckpt
    assert sample.main([f"--checkpoint={ckpt}", f"--prompt={','.join(map(str, HF_PROMPT))}",
                        f"--max_new_tokens={HF_NEW}", "--temperature=0"]) == 0
    out = capsys.readouterr()
    assert samples(out.out) == [HF_PROMPT + expected]
    # data:1 (the default) on the first of the 8 test devices; vocabulary 300 padded to 384.
    assert "mesh data:1 (the first 1 of 8 devices" in out.err and "layout dp |" in out.err, out.err
    assert "converted from" in out.err and "vocab 384" in out.err and "params float32" in out.err


def test_checkpoint_greedy_equals_transformers_under_dp2_tp4(hf_ckpt, capsys):
    ckpt, expected = hf_ckpt
    assert sample.main([f"--checkpoint={ckpt}", f"--prompt={' '.join(map(str, HF_PROMPT))}",
                        f"--max_new_tokens={HF_NEW}", "--temperature=0", "--num_samples=3",
                        "--mesh=data:2,tensor:4", "--layout=dp_tp"]) == 0
    out = capsys.readouterr()
    assert samples(out.out) == [HF_PROMPT + expected] * 3
    assert "mesh data:2,tensor:4" in out.err and "layout dp_tp" in out.err and "3 sample(s) in 4 rows" in out.err


def test_checkpoint_cli_samples_text_with_its_tokenizer(tmp_path, capsys):
    """A converted Llama with its tokenizer.json, whose post-processor puts "<s>" (BOS)
    first: the prompt is encoded as transformers' tokenizer encodes it (BOS included),
    and the greedy sample is transformers' generate, decoded."""
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from meshtrain import convert
    from meshtrain.data.tokenizers import make_tokenizer
    hf = hf_models.llama(tmp_path / "hf", initializer_range=0.5)
    hf_models.add_tokenizer(hf, eos="</s>", bos=True)
    convert.from_hf(hf, tmp_path / "ckpt", say=_quiet)
    spec = init_from.read(tmp_path / "ckpt").tokenizer
    assert spec == f"hf:{tmp_path / 'ckpt' / 'tokenizer'}"
    text = "hello world, the quick"
    prompt = AutoTokenizer.from_pretrained(hf)(text).input_ids
    tok = make_tokenizer(spec)
    assert prompt == [tok.hf.token_to_id("<s>")] + [int(i) for i in tok.encode(text)]
    expected, _ = hf_models.greedy(hf, prompt, 8)
    assert sample.main([f"--checkpoint={tmp_path / 'ckpt'}", f"--prompt={text}", "--max_new_tokens=8",
                        "--temperature=0", "--num_samples=2", "--mesh=data:2", "--dtype=float32"]) == 0
    out = capsys.readouterr()
    samples = out.out.split(sample.SEPARATOR + "\n")
    assert samples == [tok.decode(prompt + expected) + "\n"] * 2 + [""], out.out
    assert samples[0].startswith("<s>" + text) and "prompt 7 tokens + 8 new" in out.err
    # Sampling (not greedy) runs too; an empty prompt is just BOS.
    assert sample.main([f"--checkpoint={tmp_path / 'ckpt'}", "--max_new_tokens=8", "--top_k=20"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("<s>") and out.out.endswith(sample.SEPARATOR + "\n")
    assert "prompt 1 tokens + 8 new" in out.err


def test_llama31_samples_past_its_trained_context_as_transformers(tmp_path, capsys):
    """A Llama 3.1-style model (rope_type llama3 from 32 original positions, 256 supported)
    samples --max_len=200 positions past its seq_len of 32: greedy, token for token what
    transformers' generate gives, on one device and under dp_tp; past 256 is refused."""
    pytest.importorskip("transformers")
    from meshtrain import convert
    scaling = dict(hf_models.LLAMA3_SCALING, original_max_position_embeddings=32)
    # seed 5: over 195 greedy steps the top two logits never come closer than 5e-3.
    hf = hf_models.llama(tmp_path / "hf", seed=5, scaling=scaling, max_position_embeddings=256,
                         initializer_range=0.5)
    convert.from_hf(hf, tmp_path / "ckpt", say=_quiet)
    expected, gap = hf_models.greedy(hf, HF_PROMPT, 200 - len(HF_PROMPT))
    assert len(set(expected)) > 8 and gap > 1e-3, (expected, gap)
    args = [f"--checkpoint={tmp_path / 'ckpt'}", f"--prompt={','.join(map(str, HF_PROMPT))}", "--temperature=0"]
    for where in ([], ["--mesh=data:1,tensor:2", "--layout=dp_tp"]):
        assert sample.main(args + ["--max_len=200", *where]) == 0
        out = capsys.readouterr()
        assert samples(out.out) == [HF_PROMPT + expected]
        assert "seq_len 32 (supports 256)" in out.err and "prompt 5 tokens + 195 new" in out.err, out.err
    assert sample.main(args + ["--max_len=257"]) == 2
    err = capsys.readouterr().err
    assert "--max_len=257 is longer than this model can decode: this llama supports " \
           "max_position_embeddings=256 positions, its RoPE stretched from 32" in err and "--max_len=256 or less" in err
    assert sample.main(args + ["--max_new_tokens=40"]) == 2  # without --max_len: model.seq_len, as before
    err = capsys.readouterr().err
    assert "more than the model's context, model.seq_len=32" in err and "longer --max_len (up to 256)" in err, err


def test_max_len_past_the_positions_is_refused(hf_ckpt, capsys):
    """GPT-2's learned position table ends at n_positions (64); a plain Llama converted
    with max_position_embeddings 64 goes no further either."""
    ckpt, _ = hf_ckpt
    assert sample.main([f"--checkpoint={ckpt}", "--prompt=1,2", "--max_len=65"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("meshtrain sample: error: --max_len=65 is longer than this model can decode: ")
    assert "\n" not in err and err.endswith("Use --max_len=64 or less.")
    assert ("position table (wpe) has model.seq_len=64 rows" in err or
            "this llama supports max_position_embeddings=64 positions" in err), err


@pytest.mark.parametrize("args, message", [
    (["--checkpoint={ckpt}", "--workdir={ckpt}"], "Both --workdir and --checkpoint were given"),
    (["--checkpoint={ckpt}/nowhere"], "nowhere' does not exist. Give the --out directory of"),
    (["--checkpoint={ckpt}", "--dtype=int8"], "Argument --dtype: invalid choice: 'int8' (choose from"),
    (["--checkpoint={ckpt}", "--mesh=data:16"], "needs 16 x 1 x 1 x 1 x 1 x 1 = 16 devices, more than the 8"),
    (["--checkpoint={ckpt}", "--layout=nope"], "Unknown layout 'nope'"),
    (["--checkpoint={ckpt}"], "holds no meshtrain checkpoint"),
])
def test_checkpoint_bad_input(tmp_path, capsys, args, message):
    args = [a.format(ckpt=tmp_path) for a in args]  # an empty directory
    assert sample.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("meshtrain sample: error:") and "\n" not in err, err
    assert message in err, err
