"""Hugging Face checkpoint folders in and out: safetensors only (single or sharded with an index).

``load_model`` checks every tensor name and shape against the model before reading any data and reports
all missing, unexpected and mis-shaped tensors in one ``CheckpointError``; a corrupted or truncated file
is named in a ``CheckpointError`` too. Weights go straight to the target device and dtype (the model is
built on the meta device, so nothing is allocated twice). Pickled ``.bin``/``.pt`` files are never
opened. ``save_model`` writes config.json, generation_config.json, (sharded) safetensors and tokenizer
files into a temporary folder next to the target and renames it into place, so a crash never leaves a
half-written checkpoint under the target name; a write that fails (``OSError``: a full disk) removes the temporary
folder and raises a ``CheckpointError`` saying so. MoE experts load from the hub's per-expert layout or the fused one
and are saved per expert (``moe_layout.py``).

Not here: training-state checkpoints (optimizer, RNG, step: ``polyrl.train``), gathering sharded
(FSDP) parameters before saving (callers pass a model with full tensors), downloading from a hub.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from polyrl.errors import CheckpointError
from polyrl.models.config import ModelConfig
from polyrl.models.decoder import DecoderLM
from polyrl.models.hf_io import (
    atomic_folder,
    open_safetensors,
    save_tokenizer,
    write_json,
    write_safetensors,
)
from polyrl.models.moe_layout import Stack, fill, hub_state, missing_parts, read_plan

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
# Tensors some checkpoints carry that the model recomputes; they are ignored on load.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
_PICKLE_PATTERNS = ("pytorch_model*.bin", "*.bin", "*.pt", "*.pth", "*.ckpt")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_LIST_LIMIT = 20


def dtype_from_name(name: str | torch.dtype | None, default: torch.dtype = torch.float32) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name in (None, "auto"):
        return default
    key = str(name).removeprefix("torch.")
    if key not in _DTYPES:
        raise CheckpointError(f"unsupported dtype {name!r}; use one of {', '.join(_DTYPES)}")
    return _DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ----- loading -----------------------------------------------------------------------------------


def weight_files(path: Path) -> dict[str, Path]:
    """tensor name -> shard file, from the index, the single file, or the folder's safetensors files."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, UnicodeDecodeError) as exc:
            raise CheckpointError(
                f"{index} is not a valid safetensors index ({exc!r}); restore or re-save it"
            ) from None
        files = {name: path / fname for name, fname in weight_map.items()}
        absent = sorted({str(f.name) for f in files.values() if not f.is_file()})
        if absent:
            raise CheckpointError(f"{index} names shard files that are missing in {path}: {', '.join(absent)}")
        return files
    shards = [path / SINGLE_FILE] if (path / SINGLE_FILE).is_file() else sorted(path.glob("*.safetensors"))
    if shards:
        return {name: shard for shard in shards for name in open_safetensors(shard).keys()}
    pickled = sorted({p.name for pat in _PICKLE_PATTERNS for p in path.glob(pat)})
    if pickled:
        raise CheckpointError(
            f"{path} holds only pickled weights ({', '.join(pickled[:3])}), which polyrl never unpickles; convert "
            "them to safetensors first, e.g. in transformers: model.save_pretrained(dir, safe_serialization=True)"
        )
    raise CheckpointError(f"no weights in {path}: expected {SINGLE_FILE} or {INDEX_FILE} with its shards")


def _problems(expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]], tied: bool) -> list[str]:
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(n for n in set(found) - set(expected) if not _ignorable(n, tied))
    shapes = sorted(
        f"{n} (checkpoint {list(found[n])}, model {list(expected[n])})"
        for n in set(expected) & set(found)
        if tuple(found[n]) != tuple(expected[n])
    )
    problems = []
    for label, names in (("missing", missing), ("unexpected", unexpected), ("wrong shape", shapes)):
        if names:
            more = f" ... and {len(names) - _LIST_LIMIT} more" if len(names) > _LIST_LIMIT else ""
            problems.append(f"{label} ({len(names)}): {', '.join(names[:_LIST_LIMIT])}{more}")
    return problems


def _ignorable(name: str, tied: bool) -> bool:
    return name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight")


def load_config(path: str | Path) -> ModelConfig:
    return ModelConfig.from_pretrained(_folder(path))


def _folder(path: str | Path) -> Path:
    p = Path(path)
    if not p.is_dir():
        raise CheckpointError(f"model folder {p} does not exist (give a Hugging Face model folder with config.json)")
    return p


def load_model(
    path: str | Path,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str = "cpu",
    config: ModelConfig | None = None,
) -> DecoderLM:
    """Load an HF safetensors folder into a ``DecoderLM`` on ``device`` in ``dtype`` (None: the dtype in
    config.json, else float32). Raises ``CheckpointError`` listing every mismatched tensor by name."""
    folder = _folder(path)
    cfg = config or ModelConfig.from_pretrained(folder)
    dtype = dtype_from_name(dtype if dtype is not None else cfg.torch_dtype)
    device = torch.device(device)
    files = weight_files(folder)
    with torch.device("meta"):
        model = DecoderLM(cfg)
    model = model.to(dtype)
    expected = {n: tuple(t.shape) for n, t in model.state_dict().items()}

    handles = {f: open_safetensors(f, _safetensors_device(device)) for f in sorted(set(files.values()))}
    found = {}
    for name, file in files.items():
        try:
            found[name] = handles[file].shape(name)
        except CheckpointError:
            raise
        except Exception:  # noqa: BLE001 - the index names a tensor its shard does not hold
            raise CheckpointError(
                f"{INDEX_FILE} in {folder} maps {name!r} to {file.name}, which does not hold it"
            ) from None
    # MoE: per-expert keys (the hub layout) become one fused tensor each, by name and shape before any read.
    virtual, sources = read_plan(found, cfg)
    problems = _problems(expected, virtual, cfg.tie_word_embeddings)
    parts = [k for n in sorted(set(expected) - set(virtual)) for k in missing_parts(n, found, cfg)]
    if parts:
        problems.append(f"missing expert tensors ({len(parts)}): {', '.join(parts[:_LIST_LIMIT])}")
    if problems:
        raise CheckpointError(
            f"checkpoint {folder} does not match its config.json ({cfg.model_type}, {cfg.num_layers} layers, "
            f"hidden {cfg.hidden_size}, vocab {cfg.vocab_size}): " + "; ".join(problems)
        )

    def read(key: str) -> torch.Tensor:
        return handles[files[key]].tensor(key)

    state = {}
    for name in expected:
        src = sources[name]
        if isinstance(src, Stack):  # assembled in place on the target device, one expert matrix at a time
            state[name] = fill(torch.empty(src.shape, dtype=dtype, device=device), src, read)
        else:
            state[name] = read(src).to(device=device, dtype=dtype)
    model.load_state_dict(state, assign=True, strict=True)
    # Non-persistent parts (none today) and any parameter the state dict did not assign stay on meta: check.
    leftover = [n for n, p in model.named_parameters() if p.is_meta]
    if leftover:
        raise CheckpointError(f"parameters not loaded from {folder}: {', '.join(leftover)}")
    return model


def _safetensors_device(device: torch.device) -> str:
    """safe_open reads straight onto cpu or a cuda index; other devices get a cpu read then a copy."""
    if device.type == "cuda":
        return f"cuda:{device.index or 0}"
    return "cpu"


def load_tokenizer(path: str | Path):
    """The folder's tokenizer through ``transformers.AutoTokenizer`` (chat template included)."""
    # lazy: transformers is heavy and only needed to read a tokenizer (importing polyrl.models never loads it)
    from transformers import AutoTokenizer

    folder = _folder(path)
    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as exc:  # noqa: BLE001 - transformers raises many types for a bad folder
        raise CheckpointError(f"cannot load a tokenizer from {folder}: {exc}") from None


# ----- saving ------------------------------------------------------------------------------------


def save_model(
    model: DecoderLM,
    out_dir: str | Path,
    tokenizer: Any = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    dtype: torch.dtype | None = None,
    generation_config: dict[str, Any] | None = None,
) -> Path:
    """Write an HF folder that transformers loads, atomically. ``tokenizer``: an object with
    ``save_pretrained`` or a folder whose tokenizer files are copied. ``dtype`` casts on the way out.
    A model with LoRA adapters is written as a PEFT adapter folder (``polyrl.models.lora.save_adapter``)."""
    if getattr(model, "lora_config", None) is not None:
        # lazy: polyrl.models.lora builds on this module (its package imports lora.load, which imports load_model)
        from polyrl.models.lora.peft_io import save_adapter

        return save_adapter(model, out_dir, tokenizer=tokenizer, dtype=dtype)
    out = Path(out_dir)
    with atomic_folder(out) as tmp:
        # MoE experts are written per expert (the hub layout every reader takes; see moe_layout.hub_state).
        state = hub_state({n: _cpu(t, dtype) for n, t in model.state_dict().items()}, model.config)
        saved_dtype = dtype or _dominant_dtype(state)
        _write_weights(state, tmp, max_shard_bytes)
        write_json(tmp / "config.json", _hf_config(model.config, saved_dtype))
        write_json(tmp / "generation_config.json", _generation_config(model.config, generation_config))
        if tokenizer is not None:
            save_tokenizer(tokenizer, tmp)
    return out


def _cpu(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    t = t.detach()
    if dtype is not None and t.is_floating_point():
        t = t.to(dtype)
    return t.to("cpu").contiguous()


def _dominant_dtype(state: dict[str, torch.Tensor]) -> torch.dtype:
    counts: dict[torch.dtype, int] = {}
    for t in state.values():
        counts[t.dtype] = counts.get(t.dtype, 0) + t.numel()
    return max(counts, key=counts.get) if counts else torch.float32


def _write_weights(state: dict[str, torch.Tensor], folder: Path, max_shard_bytes: int) -> None:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        write_safetensors(shards[0], folder / SINGLE_FILE)
        return
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(shard, folder / fname)
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(t.numel() * t.element_size() for t in state.values())
    write_json(folder / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})


def _hf_config(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    d = cfg.to_hf_dict()
    d["architectures"] = [cfg.family.architecture]
    d["torch_dtype"] = dtype_name(dtype)  # transformers 4.x
    d["dtype"] = dtype_name(dtype)  # transformers 5.x
    return dict(sorted(d.items()))


def _generation_config(cfg: ModelConfig, overrides: dict[str, Any] | None) -> dict[str, Any]:
    d: dict[str, Any] = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id}
    if cfg.pad_token_id is not None:
        d["pad_token_id"] = cfg.pad_token_id
    d.update(overrides or {})
    return d
