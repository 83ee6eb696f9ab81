"""A small byte-level BPE tokenizer trained here, for the project's own random-initialised checkpoints.

No model hub is reachable, so ``polyrl init-model`` trains a BPE with the ``tokenizers`` library on text
this module generates (digits, arithmetic, simple English, punctuation, chat role words). Digits are
split one per token (as Qwen does), which keeps arithmetic tasks learnable by tiny models. The vocabulary
is padded with filler entries (never produced by encoding, decodable) to exactly the model's vocab size,
so ``len(tokenizer) == config.vocab_size`` and any sampled id decodes. ChatML special tokens and chat
template; eos is ``<|im_end|>``.

Not here: loading tokenizers of real checkpoints (``checkpoint.load_tokenizer`` uses AutoTokenizer).
"""

from __future__ import annotations

import json
import random

from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers, processors, trainers
from tokenizers import models as tokenizer_models

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]
EOS_TOKEN, PAD_TOKEN = IM_END, ENDOFTEXT

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_WORDS = """the a an is are was were be to of and in on at for with from by as it this that these those
what which who how why when where yes no not all some many few more most less one two three four five six
seven eight nine ten zero hundred thousand number numbers sum total plus minus times divided equals equal
answer question result add subtract multiply divide count left right first second last next before after
cat dog bird fish tree house car road city book water food apple orange red blue green black white big small
good bad new old long short hot cold happy sad fast slow day night year time today tomorrow people man woman
child friend teacher student school work play run walk eat drink read write see look find give take make
think know say tell ask help want need like love can could will would should may might must have has had do
does did go goes went come came get got put keep let begin end start stop open close turn show try call
please thank thanks hello hi sorry okay sure correct wrong true false because so but or if then than also
system user assistant tool you your we our they their he she his her me my i am helpful harmless honest
solve problem step steps explain final therefore check compute value each per half double twice""".split()

_PUNCT = list(".,;:!?'\"()[]{}-+*/=<>%$#@&_|\\~^`")


def generate_corpus(lines: int = 6000, seed: int = 0) -> list[str]:
    """Deterministic training text: arithmetic, number words, sentences, chat-formatted turns."""
    rng = random.Random(seed)
    out: list[str] = []
    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    for i in range(lines):
        kind = i % 5
        a, b = rng.randint(0, 999), rng.randint(0, 99)
        op = rng.choice(list(ops))
        if kind == 0:
            out.append(f"{a} {op} {b} = {ops[op](a, b)}")
        elif kind == 1:
            out.append(f"What is {a} {op} {b}? The answer is {ops[op](a, b)}.")
        elif kind == 2:
            words = rng.choices(_WORDS, k=rng.randint(4, 14))
            sentence = " ".join(words).capitalize()
            out.append(sentence + rng.choice([".", "!", "?", ",", ";", ":"]))
        elif kind == 3:
            role = rng.choice(["system", "user", "assistant"])
            content = " ".join(rng.choices(_WORDS, k=rng.randint(3, 10)))
            out.append(f"{IM_START}{role}\n{content}{IM_END}\n")
        else:
            out.append(" ".join(rng.choices(_PUNCT, k=6)) + " " + "".join(rng.choices(_PUNCT, k=4)) + f" {a}.{b}%")
    return out


def train_bpe(vocab_size: int, trained_vocab: int = 4096, seed: int = 0):
    """A ``tokenizers.Tokenizer`` with exactly ``vocab_size`` ids: a byte-level BPE trained up to
    ``min(trained_vocab, vocab_size)`` ids, then filler entries ``<filler_N>`` up to ``vocab_size``."""
    target = min(trained_vocab, vocab_size)
    if target < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be at least {256 + len(SPECIAL_TOKENS)} for a byte-level BPE")
    tok = Tokenizer(tokenizer_models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=target,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(generate_corpus(seed=seed), trainer=trainer)
    return _pad_vocab(tok, vocab_size)


def _pad_vocab(tok, vocab_size: int):
    n = tok.get_vocab_size(with_added_tokens=True)
    if n >= vocab_size:
        return tok
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    next_id = max(max(vocab.values()), max(t["id"] for t in spec["added_tokens"])) + 1
    for i in range(vocab_size - n):
        vocab[f"<filler_{i}>"] = next_id + i
    return Tokenizer.from_str(json.dumps(spec))


def build_tokenizer(vocab_size: int, trained_vocab: int = 4096, seed: int = 0, model_max_length: int = 4096):
    """A ``transformers.PreTrainedTokenizerFast`` with ChatML special tokens and chat template."""
    # lazy: transformers is slow to import; `import polyrl.models` never loads it (package docstring)
    from transformers import PreTrainedTokenizerFast

    tok = train_bpe(vocab_size, trained_vocab, seed)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START],
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf
