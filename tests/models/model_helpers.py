"""Helpers for the model tests: HF twins of our tiny models and packed inputs."""

from __future__ import annotations

import torch

from polyrl.models.attention_metadata import AttnMetadata


def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Give every parameter (norms and biases too, which HF inits to 1 / 0) a random value, so parity
    tests see every tensor's effect."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=gen))
    return model


def hf_twin(cfg, seed: int = 0):
    """A transformers model (eager attention, fp32) built from our config, randomised."""
    import transformers

    hcfg = transformers.AutoConfig.for_model(**cfg.to_hf_dict())
    model = transformers.AutoModelForCausalLM.from_config(hcfg, attn_implementation="eager")
    return randomize_(model, seed).eval()


def packed(lens: list[int], vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, AttnMetadata]:
    """Random token ids ``[T]``, position ids restarting per sequence, and the training metadata."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (sum(lens),), generator=gen)
    pos = torch.cat([torch.arange(n) for n in lens])
    return ids, pos, AttnMetadata.from_seqlens(lens)


def logits(model, ids: torch.Tensor, pos: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
    with torch.no_grad():
        return model.compute_logits(model(ids, pos, meta))


def hf_logits(hf, ids: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """HF logits of each sequence run alone, concatenated ``[T, V]``."""
    out, start = [], 0
    with torch.no_grad():
        for n in lens:
            out.append(hf(ids[start : start + n][None]).logits[0].float())
            start += n
    return torch.cat(out)
