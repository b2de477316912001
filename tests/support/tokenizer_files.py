"""Tokenizer tests' shared pieces: a small corpus, sample texts, a fake GPT-2 vocabulary
directory."""

import json


EOT = "<|endoftext|>"
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "A tokenizer turns text into ids; a model turns ids into text again.",
    "Ünïcödé wörks tóo: café, naïve, Straße, smörgåsbord, jalapeño.",
    "日本語のテキストも大丈夫です。中文也可以。한국어도 됩니다.",
    "Emoji 🙂🚀🎉 and symbols ∑∫√≈ ≠ ∞ — «quotes» “smart” ‘ones’.",
    "def train(step):\n    return step + 1  # code has indentation\n\ttabs too\n",
] * 20


SAMPLES = [
    "",
    "hello world",
    "  leading and trailing spaces  \n\n",
    "Ünïcödé café 日本語 🙂🚀 Straße",
    "text with a literal <|endoftext|> inside",
    "bytes never seen in training: \x00\x01 ǅ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ꙮ",
]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (encoder.py), in its order."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) +
          list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


MERGES = [("h", "e"), ("l", "l"), ("he", "ll"), ("Ġ", "w"), ("Ġw", "o")]  # Ġ is a space


def fake_gpt2_dir(tmp_path):
    """A directory with a tiny encoder.json and vocab.bpe in GPT-2's format."""
    b2u = bytes_to_unicode()
    encoder = {ch: rank for rank, ch in enumerate(b2u.values())}  # ranks follow that order
    for a, b in MERGES:
        encoder[a + b] = len(encoder)
    encoder[EOT] = len(encoder)
    d = tmp_path / "gpt2"
    d.mkdir()
    (d / "encoder.json").write_text(json.dumps(encoder))
    # The loader drops the first (version) line and the last (empty) one.
    (d / "vocab.bpe").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in MERGES))
    return d, encoder
