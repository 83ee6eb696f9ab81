"""Builtin ``markov``: text from a fixed random order-k Markov chain over English words, with a known entropy floor.

A row: prompt "Continue the text: w1 ... wP", completion "wP+1 ... wP+n." (words joined by spaces, a final "."). The
language is one fixed random chain: for every context (the last ``order`` words) ``branch`` successor words drawn
from the first ``vocab`` words of ``WORDS``, with Zipf weights ``1 / rank**zipf``; the successors and their ranks
come from a hash of (``chain``, context), so the language is the same in every split, seed and process, and a
different ``chain`` is a different language. The prompt's first ``order`` words are uniform, the rest follow the
chain. The completion continues it; after each completion word the row stops with probability ``1 / mean_len``
(at least one word; always at ``max_len`` words).

Why it exists: a larger synthetic *text* set for loss-curve studies (issue 28's FP8 numerics), where the loss
should fall smoothly toward a known floor instead of in the sudden drops of a task that is learnt all at once
(arithmetic). Hence order 1 by default: on the CPU the ``small`` preset (lr 1e-3, 2048-token steps) went down
steadily on it (held-out 5.05, 4.10, 3.44, 2.95, 2.78, 2.75 nats per token at steps 20-120), while with ``order=2,
vocab=64, branch=8`` it sat at the one-word-context level (~3.25) from step 40 to 80: using the word before the last
takes attention to earlier tokens, which a model tends to pick up at once, late.

The floor: every context's successor distribution has the same shape, so the chain's entropy is
``word_entropy(params)`` nats per completion word in every state (2.88 nats for the default ``branch=32, zipf=1``),
plus the stop decisions (``h(1/mean_len)`` per word). ``completion_nll(row, params)`` is the chain's own negative
log-likelihood of a row's completion: summed over held-out rows and divided by their trained tokens it is the loss
the true distribution gets on them, the floor no model beats in expectation (a text has exactly one tokenisation,
so the token sequence carries the same information as the words; the "." and the end-of-turn token are
deterministic and only add tokens). With the ``*-shape`` presets' tokenizer the defaults give ~186 tokens a row and
a floor of ~1.28 nats per trained token (the words average ~2 tokens).

Parameters: ``vocab`` (words used, default and at most ``len(WORDS)`` = 494), ``order`` (context words, 1-4, default
1), ``branch`` (successors per context, default 32), ``zipf`` (weight exponent, default 1.0; 0 is uniform),
``prompt_words`` (default 8, at least ``order``), ``mean_len`` (mean completion words, default 64), ``max_len``
(default 256), ``chain`` (which language, default 0). The checker accepts any completion made of the language's
words that ends in "." (a well-formedness check: the continuation is random, there is no single right answer).
Not here: real text, grammar beyond the chain's contexts.
"""

from __future__ import annotations

import functools
import hashlib
import math
import random

from polyrl.errors import ConfigError

# 494 common English words, lowercase letters only (the first ones are mostly one token of the project's own BPE
# tokenizer); ``vocab`` takes the first N.
WORDS = """the of and to in is it you that he was for on are with as his they be at one have this from or had by
word but what some we can out other were all there when up use your how said an each she which do their time if
will way about many then them write would like so these her long make thing see him two has look more day could go
come did number sound no most people my over know water than call first who may down side been now find any new
work part take get place made live where after back little only round man year came show every good me give our
under name very through just form great think say help low line turn cause much mean before move right boy old too
same tell does set three want air well also play small end put home read hand port large spell add even land here
must big high such follow act why ask men change went light kind off need house picture try us again animal point
mother world near build self earth father head stand own page should country found answer school grow study still
learn plant cover food sun four thought let keep eye never last door between city tree cross since hard start might
story saw far sea draw left late run while press close night real life few stop open seem together next white
children begin got walk example ease paper often always music those both mark book letter until mile river car feet
care second group carry took rain eat room friend began idea fish mountain north once base hear horse cut sure watch
color face wood main enough plain girl usual young ready above ever red list though feel talk bird soon body dog
family direct pose leave song measure state product black short numeral class wind question happen complete ship
area half rock order fire south problem piece told knew pass farm top whole king size heard best hour better true
during hundred am remember step early hold west ground interest reach fast five sing listen six table travel less
morning ten simple several vowel toward war lay against pattern slow center love person money serve appear road map
science rule govern pull cold notice voice fall power town fine certain fly unit lead cry dark machine note wait
plan figure star box noun field rest correct able pound done beauty drive stood contain front teach week final gave
green oh quick develop sleep warm free minute strong special mind behind clear tail produce fact street inch lot
nothing course stay wheel full force blue object decide surface deep moon island foot yet busy test record boat
common gold possible plane age dry wonder laugh thousand ago ran check game shape yes hot miss brought heat snow bed
bring sit perhaps fill east weight language among""".split()

DEFAULTS = {
    "vocab": 494,
    "order": 1,
    "branch": 32,
    "zipf": 1.0,
    "prompt_words": 8,
    "mean_len": 64,
    "max_len": 256,
    "chain": 0,
}
PROMPT = "Continue the text: "
_LIMITS = {"order": (1, 4), "branch": (1, None), "prompt_words": (1, None), "max_len": (1, None)}


def _ints(params: dict) -> dict:
    """Typed copy of the chain parameters (spec values arrive as strings)."""
    merged = {**DEFAULTS, **{k: v for k, v in params.items() if k in DEFAULTS}}
    try:
        out = {k: int(merged[k]) for k in ("vocab", "order", "branch", "prompt_words", "max_len", "chain")}
        out["zipf"], out["mean_len"] = float(merged["zipf"]), float(merged["mean_len"])
    except ValueError as exc:
        raise ConfigError(
            f"builtin:markov: bad parameter value ({exc}); zipf and mean_len are numbers, the rest integers"
        ) from None
    return out


def validate(params: dict) -> None:
    p = _ints(params)
    if not 2 <= p["vocab"] <= len(WORDS):
        raise ConfigError(f"builtin:markov vocab={p['vocab']} must be between 2 and {len(WORDS)}; use e.g. vocab=128")
    for key, (lo, hi) in _LIMITS.items():
        if p[key] < lo or (hi is not None and p[key] > hi):
            bound = f"between {lo} and {hi}" if hi is not None else f">= {lo}"
            raise ConfigError(f"builtin:markov {key}={p[key]} must be {bound}; default {DEFAULTS[key]}")
    if p["branch"] > p["vocab"]:
        raise ConfigError(f"builtin:markov branch={p['branch']} must be <= vocab={p['vocab']}; use e.g. branch=8")
    if p["prompt_words"] < p["order"]:
        raise ConfigError(f"builtin:markov prompt_words={p['prompt_words']} must be >= order={p['order']}")
    if p["zipf"] < 0 or p["mean_len"] < 1:
        raise ConfigError(
            f"builtin:markov zipf={p['zipf']} must be >= 0 and mean_len={p['mean_len']} >= 1; e.g. zipf=1&mean_len=64"
        )


class _Chain:
    """The language of one (vocab, order, branch, zipf, chain): successor lists built on first use per context."""

    def __init__(self, vocab: int, order: int, branch: int, zipf: float, chain: int) -> None:
        self.vocab, self.order, self.branch, self.chain = vocab, order, branch, chain
        weights = [1.0 / (r + 1) ** zipf for r in range(branch)]
        total = sum(weights)
        self.probs = [w / total for w in weights]
        self.cum = [sum(self.probs[: r + 1]) for r in range(branch)]
        self.cum[-1] = 1.0
        self._succ: dict[tuple[int, ...], list[int]] = {}

    def successors(self, ctx: tuple[int, ...]) -> list[int]:
        """The context's successor word ids, most likely first."""
        found = self._succ.get(ctx)
        if found is None:
            key = f"polyrl-markov:{self.chain}:{self.vocab}:{','.join(map(str, ctx))}".encode()
            found = random.Random(hashlib.sha256(key).digest()).sample(range(self.vocab), self.branch)
            self._succ[ctx] = found
        return found

    def draw(self, rng: random.Random, ctx: tuple[int, ...]) -> int:
        return rng.choices(self.successors(ctx), cum_weights=self.cum)[0]

    def prob(self, ctx: tuple[int, ...], word: int) -> float:
        succ = self.successors(ctx)
        return self.probs[succ.index(word)] if word in succ else 0.0


@functools.lru_cache(maxsize=8)
def _chain(vocab: int, order: int, branch: int, zipf: float, chain: int) -> _Chain:
    return _Chain(vocab, order, branch, zipf, chain)


def _chain_of(p: dict) -> _Chain:
    return _chain(p["vocab"], p["order"], p["branch"], p["zipf"], p["chain"])


def generate(rng: random.Random, params: dict) -> dict:
    p = _ints(params)
    chain, k = _chain_of(p), p["order"]
    words = [rng.randrange(p["vocab"]) for _ in range(k)]
    while len(words) < p["prompt_words"]:
        words.append(chain.draw(rng, tuple(words[-k:])))
    n_prompt, stop = len(words), 1.0 / p["mean_len"]
    while True:
        words.append(chain.draw(rng, tuple(words[-k:])))
        n = len(words) - n_prompt
        if n >= p["max_len"] or rng.random() < stop:
            break
    prompt = PROMPT + " ".join(WORDS[w] for w in words[:n_prompt])
    completion = " ".join(WORDS[w] for w in words[n_prompt:]) + "."
    return {"prompt": prompt, "answer": completion}


def word_entropy(params: dict) -> float:
    """Nats per word of the chain given its context (the same in every state): the Zipf weights' entropy."""
    return -sum(q * math.log(q) for q in _chain_of(_ints(params)).probs if q > 0)


def completion_nll(row: dict, params: dict) -> float:
    """The chain's negative log-likelihood (nats) of ``row``'s completion given its prompt: the words, each
    continuation and the stop. ``inf`` when a word is impossible in its context (text not from this chain)."""
    p = _ints(params)
    chain, k, index = _chain_of(p), p["order"], {w: i for i, w in enumerate(WORDS[: p["vocab"]])}
    prompt = row["prompt"].removeprefix(PROMPT).split()
    text = str(row["completion"] if "completion" in row else row["answer"])
    if not text.endswith("."):
        return math.inf
    completion = text[:-1].split()
    try:
        words = [index[w] for w in prompt + completion]
    except KeyError:
        return math.inf
    if len(prompt) < k or not completion:
        return math.inf
    stop, nll = 1.0 / p["mean_len"], 0.0
    for i in range(len(prompt), len(words)):
        q = chain.prob(tuple(words[i - k : i]), words[i])
        if q <= 0:
            return math.inf
        nll -= math.log(q)
    n = len(completion)
    if n > p["max_len"]:
        return math.inf
    if n > 1:
        nll -= (n - 1) * math.log1p(-stop) if stop < 1 else math.inf
    if n < p["max_len"]:
        nll -= math.log(stop)
    return nll


def wrong_answer(rng: random.Random, example: dict) -> str:
    """The reference continuation with one word swapped for another word (almost always impossible there)."""
    words = example["answer"][:-1].split()
    i = rng.randrange(len(words))
    words[i] = rng.choice([w for w in WORDS[:16] if w != words[i]])
    return " ".join(words) + "."


def check(completion_text: str, answer: str) -> bool:
    """Well-formed: words of the language (any ``vocab``) separated by spaces, ending in "."."""
    text = completion_text.strip()
    if not text.endswith(".") or text == ".":
        return False
    known = set(WORDS)
    return all(w in known for w in text[:-1].split())
