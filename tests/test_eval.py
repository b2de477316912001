"""meshtrain eval: a run's workdir gives that run's last eval_loss, on its own mesh and on
another; a converted Hugging Face GPT-2 dumps the logits transformers computes on the
same tokens; the dumped logits and weights give back the reported loss under either
data.packing; bad input is one paragraph with status 2."""

import json
import math

from support import hf_models  # builds Hugging Face models; imports torch and transformers when called
import numpy as np
import pytest

from meshtrain import eval as eval_cmd, train
from support.processes import metric_rows

# Logits agree to this fraction of the largest logit (float32 on both sides).
LOGIT_TOL = 1e-5


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """The README's tiny run (gpt2_tiny_dp2_tp4, synthetic data), 4 steps, evaluated and
    saved at step 4."""
    w = tmp_path_factory.mktemp("eval_run") / "w"
    assert train.run(["--config=gpt2_tiny_dp2_tp4", f"--workdir={w}", "--config.train.steps=4",
                      "--config.train.eval_every=4", "--config.train.log_every=2"]) == 0
    return w


@pytest.fixture(scope="module")
def hf_ckpt(tmp_path_factory):
    """A tiny random GPT-2 with a tokenizer, converted; a text corpus in its words."""
    pytest.importorskip("transformers")
    from meshtrain import convert
    root = tmp_path_factory.mktemp("eval_hf")
    hf = hf_models.gpt2(root / "hf")
    hf_models.add_tokenizer(hf, eos="<|endoftext|>")
    convert.from_hf(hf, root / "ckpt", say=lambda _: None)
    words = "the quick brown fox jumps over the lazy dog hello world mesh training tokenizer".split()
    rng = np.random.default_rng(0)
    (root / "corpus.txt").write_text("\n".join(" ".join(rng.choice(words, 12)) for _ in range(300)) + "\n")
    return hf, root / "ckpt", root / "corpus.txt"


def _eval_json(capsys, *args) -> tuple[dict, str]:
    capsys.readouterr()
    assert eval_cmd.run([*args, "--json"]) == 0
    out = capsys.readouterr()
    return json.loads(out.out), out.err


def test_workdir_gives_the_runs_last_eval_loss_on_any_mesh(run_dir, capsys):
    rows = metric_rows(run_dir)
    last = [r for r in rows if "eval_loss" in r][-1]
    assert last["step"] == 4
    got, err = _eval_json(capsys, "--workdir", str(run_dir))
    assert abs(got["loss"] - last["eval_loss"]) <= 1e-6, (got, last)
    assert got["perplexity"] == pytest.approx(math.exp(got["loss"]))
    assert {k: got[k] for k in ("batches", "tokens", "split", "step", "layout")} == {
        "batches": 4, "tokens": 4 * 32 * 128, "split": "validation", "step": 4, "layout": "dp_tp"}
    assert got["mesh"] == {"data": 2, "stage": 1, "fsdp": 1, "context": 1, "expert": 1, "tensor": 4} and got["seconds"] > 0
    assert "eval validation [####" in err and "(train.eval_steps)" in err  # the progress bar

    # Another mesh and layout: the same params and batches, another program.
    other, err = _eval_json(capsys, f"--workdir={run_dir}", "--config.mesh.shape=fsdp:8", "--config.layout=fsdp")
    assert other["mesh"]["fsdp"] == 8 and other["layout"] == "fsdp"
    assert other["loss"] == pytest.approx(got["loss"], rel=1e-5)

    # The human line on stdout; fewer batches of the training split.
    assert eval_cmd.run([f"--workdir={run_dir}", "--split=train", "--batches=1"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("eval: loss ") and "| 4,096 tokens in 1 batches of split train | step 4 of" in line


def test_dump_logits_of_a_converted_gpt2_equal_transformers(hf_ckpt, tmp_path, capsys):
    hf, ckpt, corpus = hf_ckpt
    dump = tmp_path / "logits.npz"
    got, err = _eval_json(capsys, f"--checkpoint={ckpt}", "--config.data.kind=text",
                          f"--config.data.path={corpus}", "--config.model.seq_len=32",
                          "--config.train.batch_size=4", "--config.mesh.shape=data:2,tensor:2",
                          "--config.layout=dp_tp", "--batches=0", f"--dump_logits={dump}")
    d = np.load(dump)
    n = got["batches"] * 4
    assert got["batches"] >= 2 and "the whole split" in err and got["step"] == 0
    assert d["tokens"].shape == d["targets"].shape == (n, 32) and d["logits"].shape == (n, 32, hf_models.VOCAB)
    assert d["logits"].dtype == np.float32 and f"wrote {dump}" in err
    np.testing.assert_array_equal(d["tokens"][:, 1:], d["targets"][:, :-1])
    theirs = hf_models.logits(hf, d["tokens"])
    err_rel = np.abs(d["logits"] - theirs).max() / np.abs(theirs).max()
    assert err_rel <= LOGIT_TOL, f"logits differ by {err_rel:.2e} of the largest"
    # The loss is transformers' mean next-token loss on the same windows.
    windows = np.concatenate([d["tokens"], d["targets"][:, -1:]], axis=1)
    assert got["loss"] == pytest.approx(hf_models.loss(hf, windows), rel=1e-5)


@pytest.fixture(scope="module")
def documents_corpus(tmp_path_factory) -> tuple[str, int]:
    """(a glob of 120 one-line files, each a document of 3 to 9 words, so a window of 32
    characters spans several; the char tokenizer's end-of-text id over them)."""
    root = tmp_path_factory.mktemp("eval_docs")
    words = "the quick brown fox jumps over a lazy dog".split()
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(words, rng.integers(3, 10))) for _ in range(120)]
    for i, text in enumerate(texts):
        (root / f"{i:03d}.txt").write_text(text)
    return str(root / "*.txt"), len(set("".join(texts)))  # char ids: the sorted characters, then eot


@pytest.mark.parametrize("packing", ["concat", "documents"])
def test_dumped_logits_and_weights_recompute_the_reported_loss(run_dir, documents_corpus, packing, tmp_path,
                                                                capsys):
    """docs/eval.md's rule: loss = sum(weights * cross entropy(logits, targets)) / weights.size,
    under either data.packing (the logits masked per document as the loss's are)."""
    corpus, eot = documents_corpus
    dump = tmp_path / "logits.npz"
    got, _ = _eval_json(capsys, f"--workdir={run_dir}", "--config.data.kind=text", f"--config.data.path={corpus}",
                        "--config.data.tokenizer=char", f"--config.data.packing={packing}",
                        "--config.model.seq_len=32", "--config.train.batch_size=4", "--batches=2",
                        f"--dump_logits={dump}")
    d = np.load(dump)
    assert d["weights"].shape == d["targets"].shape == (8, 32) and d["weights"].dtype == np.float32
    # The target after an end-of-text id is the next document's first: it weighs 0 under documents.
    boundary = d["tokens"] == eot
    assert boundary.sum() >= 8, "the windows should cross several documents"
    np.testing.assert_array_equal(d["weights"], np.where(boundary, 0.0, 1.0) if packing == "documents" else 1.0)
    z = d["logits"].astype(np.float64)
    top = z.max(-1, keepdims=True)
    nll = (np.log(np.exp(z - top).sum(-1)) + top[..., 0]
           - np.take_along_axis(z, d["targets"][..., None], -1)[..., 0])
    recomputed = (d["weights"] * nll).sum() / d["weights"].size
    assert abs(recomputed - got["loss"]) <= 1e-6, (packing, recomputed, got["loss"])


@pytest.mark.parametrize("args, message", [
    ([], "No --workdir or --checkpoint given: pass exactly one"),
    (["--workdir={w}", "--checkpoint={w}"], "Both --workdir and --checkpoint were given"),
    (["--workdir={w}", "--step=3"], "has no committed step 3; it has 4"),
    (["--checkpoint={ckpt}", "--step=5"], "has no committed step 5; its steps are 0"),
    (["--workdir={w}", "--batches=-1"], "--batches=-1: must be >= 0"),
    (["--workdir={w}", "--batches=0"], "--batches=0 evaluates the whole split, but data.kind='synthetic'"),
    (["--workdir={w}", "--dump_logits={w}/nowhere/x.npz"], "nowhere' does not exist. Create it first"),
    (["--workdir={w}", "--split=test"], "--split='test' does not exist: the splits are validation"),
    (["--workdir={w}", "--config.train.batch_szie=4"], "Unknown config key 'train.batch_szie'"),
    (["--workdir={w}/nowhere"], "nowhere/run.json does not exist"),
    (["--checkpoint={w}/nowhere"], "nowhere' does not exist. Give the --out directory"),
])
def test_bad_input_is_one_paragraph_with_status_2(run_dir, hf_ckpt, capsys, args, message):
    args = [a.format(w=run_dir, ckpt=hf_ckpt[1]) for a in args]
    capsys.readouterr()
    assert eval_cmd.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("meshtrain eval: error: ") and "\n" not in err and "Traceback" not in err, err
    assert message in err, err
