"""A learnable synthetic source: a stationary first-order Markov chain.

The chain has a known entropy rate H (nats per token), so a training curve can be
judged against the best achievable loss: a model that learns the transition table
exactly reaches a mean next-token loss of H, because every target token is drawn
from P(. | previous token) and the first input token is drawn from the stationary
distribution pi (so every position of a window is in the stationary regime).

Structure (built once from a seed, vectorised so V = 50257 takes well under 1 s):
  * each symbol i has K = min(MAX_SUCCESSORS, V) distinct successors;
  * successor (i + 1) % V is always one of them, so the chain is irreducible;
  * the other K - 1 successors are uniform at random among the remaining symbols;
  * the K probabilities of each row come from Dirichlet(DIRICHLET_ALPHA).

Records: window n of a stream is an int32 array of seq_len + 1 tokens, a function
of (seed, stream, n) only, so batches do not depend on batch size or process count.
"""

import functools

import grain
import numpy as np

from meshtrain.data.source import DataSource

# Successors per symbol. Small enough that the table is sparse ([V, K]) at GPT-2's
# vocabulary, large enough that the chain mixes fast and is not trivially learnable.
MAX_SUCCESSORS = 8

# Dirichlet concentration of each row's K probabilities. Below 1 the rows are
# peaked (a few likely successors, a tail of unlikely ones), so the entropy rate
# sits well below log K and a model has something to learn beyond the support.
DIRICHLET_ALPHA = 0.5

# Streams of the record index space: train and eval windows never share uniforms.
TRAIN_STREAM = 0
EVAL_STREAM = 1

# Distinguishes the structure generator from the record generators of the same seed.
_STRUCTURE_TAG = 0x5EED

# Up to this many symbols the stationary distribution is solved densely: a small
# chain can be nearly periodic or nearly reducible, where power iteration crawls.
_DENSE_MAX_VOCAB = 256
# Up to this many symbols successors come from a permutation per row; above it,
# redrawing rows with repeats is cheap because repeats are rare.
_PERMUTE_MAX_VOCAB = 64
_POWER_TOL = 1e-14
_POWER_MAX_ITERS = 20_000


class MarkovChain:
    """The transition table, its stationary distribution and entropies.

    Attributes:
      succ: [V, K] int32, the successors of each symbol (distinct within a row).
      cum: [V, K] float64, cumulative transition probabilities; cum[:, -1] == 1.
      pi: [V] float64, the stationary distribution (pi @ P == pi).
      cum_pi: [V] float64, cumulative pi; cum_pi[-1] == 1.
      entropy_rate: sum_i pi_i H(P_i), nats per token.
      unigram_entropy: H(pi), nats; the loss of a model that ignores context.
    """

    def __init__(self, vocab_size: int, seed: int):
        if vocab_size < 2:
            raise ValueError(f"a Markov chain needs vocab_size >= 2, got {vocab_size}")
        self.vocab_size = vocab_size
        self.seed = seed
        rng = np.random.default_rng([seed, _STRUCTURE_TAG])
        self.succ = _successors(vocab_size, rng)
        k = self.succ.shape[1]
        probs = rng.dirichlet(np.full(k, DIRICHLET_ALPHA), size=vocab_size)
        self.cum = np.cumsum(probs, axis=1)
        # Exact 1 at the end: a uniform u in [0, 1) then always finds a successor.
        self.cum[:, -1] = 1.0
        self.probs = np.diff(self.cum, axis=1, prepend=0.0)  # [V, K] float64
        self.pi = stationary(self.succ, self.probs)
        self.cum_pi = np.cumsum(self.pi)
        self.cum_pi[-1] = 1.0
        self.entropy_rate = float(self.pi @ _row_entropy(self.probs))
        self.unigram_entropy = float(_row_entropy(self.pi[None, :])[0])

    @property
    def num_successors(self) -> int:
        return int(self.succ.shape[1])

    def dense(self) -> np.ndarray:
        """The full transition matrix, [V, V] float64; for small V and tests."""
        v = self.vocab_size
        p = np.zeros((v, v))
        np.add.at(p, (np.repeat(np.arange(v), self.num_successors), self.succ.ravel()),
                  self.probs.ravel())
        return p

    def log_prob(self, tokens: np.ndarray) -> np.ndarray:
        """log P(x_t | x_{t-1}) of each target; [rows, T + 1] -> [rows, T] float64."""
        prev, nxt = tokens[:, :-1], tokens[:, 1:]
        match = self.succ[prev] == nxt[..., None]  # [rows, T, K]; one True at most
        p = np.where(match, self.probs[prev], 0.0).sum(-1)
        with np.errstate(divide="ignore"):
            return np.log(p)

    def sample(self, uniforms: np.ndarray) -> np.ndarray:
        """Walk the chain, one row per window; [rows, T + 1] float64 -> int32.

        Column 0 picks x0 from pi, column t picks x_t from P(. | x_{t-1}). The loop
        runs over time and is vectorised over rows, so each row depends only on its
        own uniforms (a record is the same whatever batch it is read in).
        """
        rows, length = uniforms.shape
        out = np.empty((rows, length), np.int32)
        x = np.searchsorted(self.cum_pi, uniforms[:, 0], side="right")
        out[:, 0] = np.minimum(x, self.vocab_size - 1)
        for t in range(1, length):
            prev = out[:, t - 1]
            slot = (uniforms[:, t, None] >= self.cum[prev]).sum(axis=1)
            out[:, t] = self.succ[prev, slot]
        return out

    def records(self, stream: int, ids: np.ndarray, seq_len: int) -> np.ndarray:
        """Windows `ids` of `stream`; [rows] int -> [rows, seq_len + 1] int32."""
        uniforms = np.stack([
            np.random.default_rng([self.seed, stream, int(n)]).random(seq_len + 1)
            for n in ids
        ]) if len(ids) else np.zeros((0, seq_len + 1))
        return self.sample(uniforms)

    def info(self) -> dict:
        """JSON-serialisable facts for run.json."""
        return {
            "kind": "synthetic",
            "vocab_size": self.vocab_size,
            "seed": self.seed,
            "successors_per_symbol": self.num_successors,
            "dirichlet_alpha": DIRICHLET_ALPHA,
            "entropy_rate": self.entropy_rate,
            "unigram_entropy": self.unigram_entropy,
            # Every target is predicted from its predecessor in the stationary
            # regime, so the best mean loss over any window is the entropy rate.
            "best_loss": self.entropy_rate,
        }


def _successors(v: int, rng: np.random.Generator) -> np.ndarray:
    """[V, K] int32: column 0 is (i + 1) % V, the rest distinct random others."""
    k = min(MAX_SUCCESSORS, v)
    # Offsets d in [1, V - 1] give successor (i + 1 + d) % V, never i + 1 itself.
    if v <= _PERMUTE_MAX_VOCAB:
        # Small V: a random permutation per row; redrawing would rarely succeed.
        offsets = np.argsort(rng.random((v, v - 1)), axis=1)[:, : k - 1] + 1
    else:
        offsets = _distinct_offsets(v, k - 1, rng)
    base = (np.arange(v) + 1) % v
    others = (base[:, None] + offsets) % v
    return np.concatenate([base[:, None], others], axis=1).astype(np.int32)


def _distinct_offsets(v: int, m: int, rng: np.random.Generator) -> np.ndarray:
    """[V, m] distinct-per-row ints in [1, V - 1], by redrawing rows with repeats."""
    offsets = rng.integers(1, v, size=(v, m))
    while True:
        s = np.sort(offsets, axis=1)
        bad = np.flatnonzero((s[:, 1:] == s[:, :-1]).any(axis=1))
        if bad.size == 0:
            return offsets
        offsets[bad] = rng.integers(1, v, size=(bad.size, m))


def stationary(succ: np.ndarray, probs: np.ndarray) -> np.ndarray:
    """The stationary distribution of the sparse chain; [V] float64, sums to 1."""
    v = succ.shape[0]
    if v <= _DENSE_MAX_VOCAB:
        return _stationary_dense(succ, probs)
    return _stationary_power(succ, probs)


def _stationary_dense(succ: np.ndarray, probs: np.ndarray) -> np.ndarray:
    """Solve pi (P - I) = 0 with sum(pi) = 1 (one equation replaced by the sum)."""
    v = succ.shape[0]
    p = np.zeros((v, v))
    np.add.at(p, (np.repeat(np.arange(v), succ.shape[1]), succ.ravel()), probs.ravel())
    a = p.T - np.eye(v)
    a[-1, :] = 1.0
    b = np.zeros(v)
    b[-1] = 1.0
    pi = np.clip(np.linalg.solve(a, b), 0.0, None)
    return _polish(pi / pi.sum(), succ, probs)


def _stationary_power(succ: np.ndarray, probs: np.ndarray) -> np.ndarray:
    """Power iteration on the lazy chain (I + P) / 2: same pi, never periodic."""
    v = succ.shape[0]
    pi = np.full(v, 1.0 / v)
    for _ in range(_POWER_MAX_ITERS):
        new = 0.5 * (pi + _step(pi, succ, probs))
        if np.abs(new - pi).sum() < _POWER_TOL:
            return _polish(new / new.sum(), succ, probs)
        pi = new
    raise RuntimeError(
        f"stationary distribution did not converge in {_POWER_MAX_ITERS} iterations")


def _polish(pi: np.ndarray, succ: np.ndarray, probs: np.ndarray) -> np.ndarray:
    """A few plain steps pi <- pi P to squeeze out solver round-off."""
    for _ in range(3):
        pi = _step(pi, succ, probs)
        pi /= pi.sum()
    return pi


def _step(pi: np.ndarray, succ: np.ndarray, probs: np.ndarray) -> np.ndarray:
    """pi @ P over the sparse table; [V] -> [V]."""
    mass = (pi[:, None] * probs).ravel()
    return np.bincount(succ.ravel(), weights=mass, minlength=succ.shape[0])


def _row_entropy(p: np.ndarray) -> np.ndarray:
    """Entropy in nats of each row of a [rows, n] probability table; [rows]."""
    safe = np.where(p > 0, p, 1.0)
    return -(p * np.log(safe)).sum(axis=1)


@functools.lru_cache(maxsize=4)
def shared_chain(vocab_size: int, seed: int) -> MarkovChain:
    """MarkovChain(vocab_size, seed), built once per process and read-only: every
    experiment of a search, a lint or a notebook builds its source, and the stationary
    distribution of a large vocabulary is most of an abstract build (GPT-2's 50257
    symbols 0.2 CPU-s, Llama 3's 128256 0.6)."""
    chain = MarkovChain(vocab_size, seed)
    for table in (chain.succ, chain.cum, chain.probs, chain.pi, chain.cum_pi):
        table.flags.writeable = False
    return chain


def make_synthetic_source(*, vocab_size: int, seq_len: int, seed: int) -> DataSource:
    """A DataSource of Markov-chain windows; train and eval use disjoint streams."""
    chain = shared_chain(vocab_size, seed)
    # Window n of a stream is its own draw, so the stream order is the identity.
    ids = grain.MapDataset.range(2**62)
    return DataSource(
        vocab_size=vocab_size, seq_len=seq_len, info=chain.info(),
        train_ids=ids, read_train=lambda n: chain.records(TRAIN_STREAM, n, seq_len),
        eval_ids=ids, read_eval=lambda n: chain.records(EVAL_STREAM, n, seq_len),
    )
