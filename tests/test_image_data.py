"""Image data (data.kind=images, synthetic images): shapes, determinism, exact resume under
another process count, the digits split, synthetic best accuracy against a learned
classifier, ImageFolder -> prepare -> TFDS -> batches, augmentation bounds, and errors."""

import io
import json

import ml_collections
import numpy as np
import pytest
import tensorflow_datasets as tfds
from PIL import Image

from meshtrain import config as config_lib
from meshtrain.data import image_transforms as transforms, make_source
from meshtrain.data.image_source import DIGITS_TEST_FRACTION, digits_split, upscale
from meshtrain.data.prepare import main as prepare
from meshtrain.data.synthetic_images import LABEL_NOISE, ImagePatterns
from meshtrain.errors import UserError

SIZE = 16
CLASSES = ("ant", "bee", "cow")
PER_CLASS = 6  # files per class in the test's image folder


def _cfg(**kw):
    d = dict(config_lib.base().data)
    d.update(kw)
    return ml_collections.ConfigDict(d)


def _source(cfg, *, classes=10, size=SIZE, channels=3, seed=0):
    return make_source(cfg, vocab_size=classes, seq_len=0, seed=seed, task="classify",
                       image_size=size, image_channels=channels)


def _digits(**kw):
    return _source(_cfg(kind="images", name="digits", eval_split="test", **kw))


def _take(it, n):
    return [next(it) for _ in range(n)]


def _equal(a, b):
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def _concat(parts):
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


@pytest.fixture(scope="module")
def digits():
    return _digits()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny ImageFolder of distinct 16x16 PNGs (and one 40x30 JPEG) and its dataset."""
    tmp = tmp_path_factory.mktemp("folder")
    rng = np.random.default_rng(7)
    pixels = {}
    for k, c in enumerate(CLASSES):
        (tmp / "in" / c).mkdir(parents=True)
        for i in range(PER_CLASS):
            arr = rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)
            Image.fromarray(arr).save(tmp / "in" / c / f"{i:02d}.png")
            pixels[(c, i)] = arr
    Image.fromarray(rng.integers(0, 256, (30, 40, 3), dtype=np.uint8)).save(
        tmp / "in" / "bee" / "zz.jpg")
    assert prepare([f"--images={tmp / 'in'}", "--name=bugs", f"--data_dir={tmp / 'd'}",
                    "--val_fraction=0.34"]) == 0
    return tmp, pixels


def test_digits_batches(digits):
    info = digits.info
    assert digits.vocab_size == digits.num_classes == info["num_classes"] == 10
    assert info["augment"] == "" and info["image_size"] == SIZE and info["channels"] == 3
    json.dumps(info)
    b = next(digits.train_batches(32))
    assert b["images"].shape == (32, SIZE, SIZE, 3) and b["images"].dtype == np.uint8
    assert b["labels"].shape == (32,) and b["labels"].dtype == np.int32
    assert 0 <= b["labels"].min() and b["labels"].max() < 10
    # Grey digits: every channel the same; the stats are the training pixels'.
    assert np.array_equal(b["images"][..., 0], b["images"][..., 2])
    np.testing.assert_allclose(info["mean"], [info["mean"][0]] * 3)
    e1, e2 = list(digits.eval_batches(32, 2)), list(digits.eval_batches(32, 2))
    assert all(_equal(a, c) for a, c in zip(e1, e2))
    grey = next(_source(_cfg(kind="images", name="digits", eval_split="test"),
                        channels=1).train_batches(4))
    assert grey["images"].shape == (4, SIZE, SIZE, 1)


def test_digits_split():
    from sklearn.datasets import load_digits
    labels = load_digits().target
    train, test = digits_split(labels)
    assert (len(train), len(test)) == (1438, 359)
    assert len(np.intersect1d(train, test)) == 0 and len(train) + len(test) == len(labels)
    for k in range(10):  # stratified: 20% of every class, rounded
        assert (labels[test] == k).sum() == round(DIGITS_TEST_FRACTION * (labels == k).sum())
    # The split does not follow train.seed.
    a, b = _digits(), _source(_cfg(kind="images", name="digits", eval_split="test"), seed=9)
    assert _equal(next(a.eval_batches(64, 1)), next(b.eval_batches(64, 1)))
    assert a.info["train_examples"] == 1438 and a.info["eval_examples"] == 359


def test_upscale_is_bilinear():
    x = np.arange(16.0).reshape(1, 4, 4)
    ref = np.asarray(Image.fromarray(x[0].astype(np.float32), "F").resize((8, 8), Image.BILINEAR))
    np.testing.assert_allclose(upscale(x, 8)[0], ref, atol=1e-4)
    np.testing.assert_allclose(upscale(x, 4), x)


def test_deterministic_and_batch_size_free():
    a, b = _digits(augment="crop_flip"), _digits(augment="crop_flip")
    big = _take(a.train_batches(16), 2)
    small = _take(b.train_batches(8), 4)
    for k in range(2):  # the same positions give the same pixels, whatever the batch size
        assert _equal(big[k], _concat(small[2 * k: 2 * k + 2]))
    other = next(_source(_cfg(kind="images", name="digits", eval_split="test",
                              augment="crop_flip"), seed=1).train_batches(16))
    assert not np.array_equal(other["images"], big[0]["images"])


@pytest.mark.parametrize("processes", [2, 4])
def test_process_rows_make_the_global_batch(digits, processes):
    whole = _take(digits.train_batches(8), 3)
    parts = [_take(digits.train_batches(8, process_index=p, process_count=processes), 3)
             for p in range(processes)]
    for k in range(3):
        assert all(len(parts[p][k]["labels"]) == 8 // processes for p in range(processes))
        assert _equal(whole[k], _concat([parts[p][k] for p in range(processes)]))
    ev = [next(digits.eval_batches(8, 1, process_index=p, process_count=processes))
          for p in range(processes)]
    assert _equal(next(digits.eval_batches(8, 1)), _concat(ev))


def test_resume_under_another_process_count(folder):
    """A state saved mid-stream by one process restores on two; 13 training images in
    batches of 6 cross epoch boundaries (reshuffled) and keep the crops and flips."""
    tmp, _ = folder
    src = _source(_cfg(kind="images", name="bugs", data_dir=str(tmp / "d")))
    assert src.info["augment"] == "crop_flip"
    it = src.train_batches(6)
    _take(it, 4)
    state = json.loads(json.dumps(it.get_state()))
    want = _take(it, 5)
    resumed = [src.train_batches(6, process_index=p, process_count=2) for p in range(2)]
    for r in resumed:
        r.set_state(state)
    got = [_concat([next(r) for r in resumed]) for _ in range(5)]
    assert all(_equal(w, g) for w, g in zip(want, got))
    other = _source(_cfg(kind="images", name="bugs", data_dir=str(tmp / "d"), augment="flip"))
    with pytest.raises(UserError, match="another window stream"):
        other.train_batches(6).set_state(state)


@pytest.mark.slow
def test_worker_processes_give_the_same_batches_and_state(folder):
    """The TFDS records, the shuffle and the transforms travel to grain's workers."""
    src = _source(_cfg(kind="images", name="bugs", data_dir=str(folder[0] / "d")))
    want = _take(src.train_batches(6), 6)
    it = src.train_batches(6, workers=1)
    got = _take(it, 3)
    resumed = src.train_batches(6, workers=1)
    resumed.set_state(it.get_state())
    got += _take(resumed, 3)
    assert all(_equal(a, b) for a, b in zip(want, got))


def test_synthetic_best_accuracy():
    """A nearest-mean classifier learned from noisy labels reaches best_accuracy (and the
    exact classifier recovers every true class), on many samples."""
    pat = ImagePatterns(10, 8, 1, seed=3)
    train = pat.examples(0, np.arange(3000))
    test = pat.examples(1, np.arange(20_000))
    x = train["images"].reshape(3000, -1).astype(np.float64)
    means = np.stack([x[train["labels"] == k].mean(0) for k in range(10)])
    xt = test["images"].reshape(20_000, -1).astype(np.float64)
    guess = ((xt[:, None, :] - means[None]) ** 2).sum(-1).argmin(1)
    src = _source(_cfg(kind="synthetic"), classes=10, size=8, channels=1, seed=3)
    best = src.info["best_accuracy"]
    assert best == 1 - LABEL_NOISE
    sigma = np.sqrt(best * (1 - best) / 20_000)
    assert abs((guess == test["labels"]).mean() - best) < 4 * sigma
    assert np.array_equal(pat.classify(test["images"]), test["classes"])
    assert np.array_equal(guess, test["classes"])
    # The source reads the same stream, and its mean and std are the pixels'.
    b = next(src.train_batches(64))
    assert _equal(b, {k: v[:64] for k, v in train.items() if k != "classes"})
    px = test["images"] / 255
    assert abs(px.mean() - src.info["mean"][0]) < 2e-3 and abs(px.std() - src.info["std"][0]) < 2e-3


def test_synthetic_is_deterministic_and_held_out():
    a = _source(_cfg(kind="synthetic"), classes=5, seed=1)
    b = _source(_cfg(kind="synthetic"), classes=5, seed=1)
    assert _equal(next(a.train_batches(8)), next(b.train_batches(8)))
    assert not np.array_equal(next(a.train_batches(8))["images"],
                              next(a.eval_batches(8, 1))["images"])
    assert next(a.train_batches(8))["images"].shape == (8, SIZE, SIZE, 3)


def test_image_folder_round_trip(folder):
    tmp, pixels = folder
    out = tmp / "d" / "bugs" / "1.0.0"
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["format"] == "meshtrain.images/1" and meta["classes"] == list(CLASSES)
    # The last third of every class's sorted files are held out: ant and cow 04 and 05,
    # bee 05 and zz.jpg (its seventh file).
    assert meta["num_examples"] == {"train": 13, "validation": 6}
    ds = tfds.data_source("bugs", data_dir=str(tmp / "d"))  # plain TFDS reads it
    assert ds["train"].dataset_info.features["label"].names == list(CLASSES)
    stored = [(CLASSES[r["label"]], r["image"].tobytes()) for r in ds["validation"]]
    held = {(c, pixels[(c, i)].tobytes()) for c, i in
            (("ant", 4), ("ant", 5), ("bee", 5), ("cow", 4), ("cow", 5))}
    assert held <= set(stored) and len(stored) == 6
    assert sorted(c for c, _ in stored) == ["ant", "ant", "bee", "bee", "cow", "cow"]
    # meshtrain reads the same pixels back: no augmentation, 16x16 files at 16 px.
    src = _source(_cfg(kind="images", name="bugs", data_dir=str(tmp / "d"), augment=""))
    assert src.num_classes == 3 and src.info["eval_examples"] == 6
    b = next(src.eval_batches(6, 1))
    assert held <= {(CLASSES[lab], img.tobytes()) for img, lab in zip(b["images"], b["labels"])}
    assert _equal(b, next(src.eval_batches(6, 1)))  # the same each call
    # An epoch of training reads every training image once, and the next one reshuffles.
    one, two = _take(src.train_batches(13), 2)
    assert np.bincount(one["labels"], minlength=3).tolist() == [4, 5, 4]
    assert sorted(map(bytes, one["images"])) == sorted(map(bytes, two["images"]))
    assert not np.array_equal(one["labels"], two["labels"])


def test_random_resized_crop_bounds():
    rng = np.random.default_rng(0)
    n = 4000
    h = rng.integers(8, 400, n)
    w = rng.integers(8, 400, n)
    u = transforms.uniforms(5, np.arange(n))
    boxes = transforms.crop_boxes(h, w, u, 0.08)
    bw, bh = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
    eps = 1e-9
    assert (boxes[:, :2] >= -eps).all()
    assert (boxes[:, 2] <= w + eps).all() and (boxes[:, 3] <= h + eps).all()
    assert (bw > 0).all() and (bh > 0).all()
    ratio, area = bw / bh, bw * bh / (h * w)
    assert (ratio >= 3 / 4 - eps).all() and (ratio <= 4 / 3 + eps).all()
    square = h == w  # every square image fits a first or later try: area in [0.08, 1]
    assert (area[square] >= 0.08 - eps).all() and (area <= 1 + eps).all()
    assert 0.3 < area.mean() < 0.7  # uniform in [0.08, 1] where tries fit
    assert abs(transforms.flips(u).mean() - 0.5) < 0.03
    # Counter-based: a position's draws do not depend on its neighbours; seeds differ.
    np.testing.assert_array_equal(transforms.uniforms(5, np.array([17, 3]))[0], u[17])
    assert not np.array_equal(transforms.uniforms(6, np.arange(n)), u)
    assert (u >= 0).all() and (u < 1).all() and abs(u.mean() - 0.5) < 0.01
    # Eval: the centred square of 0.875 of the shorter side.
    c = transforms.centre_boxes(np.array([200]), np.array([300]), transforms.EVAL_CROP)[0]
    np.testing.assert_allclose(c, [62.5, 12.5, 237.5, 187.5])


def test_flip_and_render():
    arr = np.random.default_rng(1).integers(0, 256, (20, 30, 3), dtype=np.uint8)
    img = transforms.from_array(arr)
    box = np.array([[0, 0, 30, 20], [0, 0, 30, 20]], np.float64)
    out = transforms.render_batch([img, img], box, np.array([False, True]), 10, 3)
    assert out.shape == (2, 10, 10, 3) and out.dtype == np.uint8
    np.testing.assert_array_equal(out[1], out[0][:, ::-1])
    same = transforms.render(transforms.from_array(arr[:16, :16]), [0, 0, 16, 16], 16, 3)
    np.testing.assert_array_equal(same, arr[:16, :16])  # nothing to crop or resize


def test_jpeg_is_decoded_at_a_reduced_scale_faithfully():
    """A box of a large JPEG: the reduced-scale (draft) decode is close to the full one."""
    yy, xx = np.mgrid[0:600, 0:800]
    arr = np.stack([xx * 255 // 800, yy * 255 // 600, (xx + yy) % 256], -1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=95)
    box = np.array([100.0, 50.0, 700.0, 550.0])
    fast = transforms.render(transforms.open_encoded(buf.getvalue()), box, 32, 3)
    full = Image.open(io.BytesIO(buf.getvalue()))
    full.load()
    slow = np.asarray(full.convert("RGB").resize((32, 32), Image.BILINEAR, box=tuple(box)))
    assert np.abs(fast.astype(int) - slow.astype(int)).mean() < 2.0


def test_user_errors(tmp_path, folder, capsys):
    with pytest.raises(UserError, match="data.kind=images holds images"):
        make_source(_cfg(kind="images", name="digits"), vocab_size=10, seq_len=8, seed=0)
    for kind in ("text", "tfds"):
        with pytest.raises(UserError, match=f"data.kind={kind} gives token windows"):
            _source(_cfg(kind=kind))
    with pytest.raises(UserError, match="data.augment='rotate'"):
        _digits(augment="rotate")
    with pytest.raises(UserError, match="data.crop_scale=0"):
        _digits(crop_scale=0)
    with pytest.raises(UserError, match="model.image_size"):
        _source(_cfg(kind="synthetic"), size=0)
    with pytest.raises(UserError, match="1 \\(grey\\) or 3"):
        _source(_cfg(kind="synthetic"), channels=2)
    with pytest.raises(UserError, match="splits 'train'"):
        _source(_cfg(kind="images", name="digits", eval_split="validation"))
    with pytest.raises(UserError, match="data.name is not set"):
        _source(_cfg(kind="images", name=""))
    with pytest.raises(UserError, match="prepare --name=nope --data_dir=DIR --images=DIR"):
        _source(_cfg(kind="images", name="nope", data_dir=str(tmp_path)))
    with pytest.raises(UserError, match="no split 'test'"):
        _source(_cfg(kind="images", name="bugs", data_dir=str(folder[0] / "d"), eval_split="test"))
    with pytest.raises(UserError, match="at least 2 classes"):
        _source(_cfg(kind="synthetic"), classes=1)
    with pytest.raises(UserError, match="too few for 300 distinct classes"):
        _source(_cfg(kind="synthetic"), classes=300, size=2, channels=1)
    (tmp_path / "one" / "only").mkdir(parents=True)
    Image.fromarray(np.zeros((4, 4), np.uint8)).save(tmp_path / "one" / "only" / "a.png")
    args = [f"--data_dir={tmp_path / 'd'}", "--name=x"]
    for argv, message in (
            ([f"--images={tmp_path / 'one'}"], "needs at least 2 classes"),
            ([f"--images={tmp_path / 'one'}", "--input=a.txt"], "pass exactly one of them"),
            ([f"--images={tmp_path / 'one'}", "--tokenizer=char"], "Leave them out with --images"),
            ([f"--images={tmp_path / 'none'}"], "is not a directory")):
        assert prepare([*argv, *args]) == 2
        assert message in capsys.readouterr().err
    (tmp_path / "one" / "other").mkdir()
    Image.fromarray(np.ones((4, 4), np.uint8)).save(tmp_path / "one" / "other" / "b.png")
    assert prepare([f"--images={tmp_path / 'one'}", *args]) == 2
    assert "holds out no image" in capsys.readouterr().err
    (tmp_path / "one" / "other" / "c.png").write_text("not an image")
    assert prepare([f"--images={tmp_path / 'one'}", *args]) == 2
    assert "is not an image PIL can read" in capsys.readouterr().err
