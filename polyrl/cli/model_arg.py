"""The ``--model`` of commands that load a full model only (``generate``, ``serve``): a PEFT adapter folder (the
``final/`` of a ``--lora`` run) is refused naming its base and the command that does take it, instead of the loader's
"config.json not found"."""

from __future__ import annotations

import json
from pathlib import Path

from polyrl.errors import UserError
from polyrl.models.lora.peft_io import ADAPTER_CONFIG, is_adapter_dir


def adapter_base(path: str | Path) -> str:
    """``base_model_name_or_path`` of an adapter folder's config, or ``BASE`` when it does not say."""
    try:
        base = json.loads((Path(path) / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        base = None
    return base if isinstance(base, str) and base else "BASE"


def refuse_adapter(model: str, command: str) -> None:
    """A UserError when ``model`` is a PEFT adapter folder without a config.json of its own: it says how ``command``
    runs it (``serve``: the base with ``--lora NAME=DIR``) and how to merge it into a full model."""
    if not is_adapter_dir(model) or (Path(model) / "config.json").is_file():
        return
    base = adapter_base(model)
    folder = Path(model.rstrip("/") or model)
    if folder.name in ("", ".."):  # ".": the current folder by its name
        folder = folder.resolve()
    # runs/lora/final -> runs/lora-merged; a bare "final" -> its absolute run folder (not ".-merged")
    stem = folder.parent if folder.name in ("final", "best") else folder
    merged = f"{stem.resolve() if stem.name in ('', '..') else stem}-merged"
    merge = f"polyrl export --adapter {model} --merge --out {merged}"
    if command == "serve":
        how = (
            f"serve it on its base with `polyrl serve --model {base} --lora NAME={model}` (requests pick it with "
            f"model=NAME), or merge it first: `{merge}`"
        )
    else:
        how = f"merge the adapter into one first, `{merge}`, and give that folder"
    raise UserError(
        f"--model {model} is a PEFT adapter folder (LoRA adapters on the base {base}); polyrl {command} needs a full "
        f"model: {how}"
    )


# the files a tokenizer is read from (fast, sentencepiece, byte-level BPE, WordPiece, Mistral's tekken; *.tiktoken)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "tekken.json")


def require_tokenizer(model: str) -> None:
    """A UserError when the model folder ``model`` holds weights but no tokenizer file: transformers then builds an
    empty tokenizer from config.json alone, and every prompt encodes to nothing ("the prompt is empty", "no prompt
    fits the context"). A missing folder or config.json is left to the loader's own message."""
    folder = Path(model)
    if not (folder / "config.json").is_file():
        return
    if any((folder / f).is_file() for f in TOKENIZER_FILES) or any(folder.glob("*.tiktoken")):
        return
    raise UserError(
        f"--model {model} has no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...); copy the tokenizer files of "
        "the model it came from into it (e.g. `tokenizer.save_pretrained(DIR)` in transformers)"
    )
