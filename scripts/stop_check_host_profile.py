"""Host time of the engine's per-token stop checks (``infer.stopping.check_stop``) on the CPU: no model, no device.

What ``polyrl bench eval --gen-docs 256`` pays per accepted token for its ``until: ["<never-stop>"]`` stop string:
``--seqs`` sequences of ``--tokens`` new tokens each, a stop string that never matches, fed the way the engine's
``_accept`` feeds them (one engine step = one token for every running sequence, each appended to ``seq.tokens`` and
then checked), with the qwen3-0.6b preset's tokenizer (151,936 ids: a 4,096-token byte-level BPE, the rest
``<filler_N>`` entries). Token streams:

- ``random``: ids drawn uniformly from the vocabulary (mostly fillers, which contain ``<`` and ``>``: what a
  random-weight checkpoint emits);
- ``text``: the ids of natural text (the tokenizer's own training text), split into one stream per sequence (its
  special tokens left out: EOS would stop a sequence);
- ``mixed``: the same with multi-byte characters every seventh line (``naïve café — 日本語``: this 4,096-token BPE
  splits most of them over byte tokens, which take the detokenizer's two decodes).

Each stream runs ``--repeats`` times on fresh sequences with one ``Detokenizers``, as an engine holds one (the
first run includes first-use costs: the per-id piece table and the stop screen are filled on first sight of each
id); the script prints us per token of the first run and the best of the others, and checks that no sequence
stopped and that each text equals ``tokenizer.decode`` of its ids (less a trailing incomplete character, which the
detokenizer holds back). On a checkout without ``Detokenizers`` it passes the tokenizer, as the engine then did.

    OMP_NUM_THREADS=1 PYTHONPATH=. python scripts/stop_check_host_profile.py --seqs 256 --tokens 32
"""

from __future__ import annotations

import argparse
import random
import time


def _tokenizer():
    from polyrl.models.presets import get_preset, preset_config
    from polyrl.models.tokenizer import build_tokenizer

    cfg = preset_config("qwen3-0.6b-shape")
    spec = get_preset("qwen3-0.6b-shape")
    return build_tokenizer(cfg.vocab_size, trained_vocab=spec.trained_vocab, seed=0), cfg.vocab_size


def _streams(tok, vocab: int, kind: str, seqs: int, tokens: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    if kind == "random":
        return [[rng.randrange(vocab) for _ in range(tokens)] for _ in range(seqs)]
    from polyrl.models.tokenizer import generate_corpus

    lines = generate_corpus(lines=4 * seqs, seed=seed)
    extra = " naïve café — 日本語 " if kind == "mixed" else ""
    text = " ".join(line + (extra if i % 7 == 0 else "") for i, line in enumerate(lines))
    special = set(tok.all_special_ids)
    ids = [t for t in tok.backend_tokenizer.encode(text, add_special_tokens=False).ids if t not in special]
    need = seqs * tokens
    ids = (ids * (need // len(ids) + 1))[:need]
    return [ids[i * tokens : (i + 1) * tokens] for i in range(seqs)]


def run_once(tok, text_of, streams: list[list[int]], stop: list[str], max_model_len: int) -> float:
    """Seconds inside check_stop for every token of every stream, fed step by step across sequences."""
    from polyrl.infer.sampling_params import SamplingParams
    from polyrl.infer.sequence import Sequence
    from polyrl.infer.stopping import check_stop

    tokens = len(streams[0])
    params = SamplingParams(temperature=0, max_tokens=tokens, stop=stop)
    prompt = tok.encode("the river mill", add_special_tokens=False)
    seqs = [Sequence(i, f"r{i}", 0, prompt, params) for i in range(len(streams))]
    eos = frozenset({tok.eos_token_id})
    clock = time.perf_counter
    total = 0.0
    for step in range(tokens):
        for s, ids in zip(seqs, streams):
            t = ids[step]
            s.tokens.append(t)
            t0 = clock()
            out = check_stop(s, t, eos, max_model_len, text_of)
            total += clock() - t0
            if out is not None and step < tokens - 1:
                raise AssertionError(f"stopped early: {out}")
    for s, ids in zip(seqs, streams):
        want = tok.decode(ids, skip_special_tokens=True)
        if s.detok.text != want and not (want.endswith("\ufffd") and want.startswith(s.detok.text)):
            raise AssertionError(f"text differs: {s.detok.text!r} != {want!r}")
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--stop", default="<never-stop>")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    tok, vocab = _tokenizer()
    try:
        from polyrl.infer.detokenizer import Detokenizers

        text_of = Detokenizers(tok)  # what the engine passes: one per engine, its tables filled as ids are seen
    except ImportError:  # the engine before Detokenizers passed its tokenizer (run on an older checkout)
        text_of = tok
    n = args.seqs * args.tokens
    for kind in ("random", "text", "mixed"):
        streams = _streams(tok, vocab, kind, args.seqs, args.tokens, args.seed)
        times = [run_once(tok, text_of, streams, [args.stop], 4096) for _ in range(args.repeats)]
        first, best = times[0], min(times[1:] or times)
        print(
            f"{kind:6s}: {n} tokens, check_stop first run {first * 1e3:.2f} ms ({first / n * 1e6:.2f} us/token), "
            f"best of the next {len(times) - 1} {best * 1e3:.2f} ms ({best / n * 1e6:.2f} us/token)",
            flush=True,
        )


if __name__ == "__main__":
    main()
