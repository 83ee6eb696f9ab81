"""PEFT adapter folders with the real ``peft`` library: peft loads our adapter and gives our logits, an adapter
peft saved loads into our model with peft's logits, and broken adapter folders are refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from model_helpers import hf_logits, logits, packed

from polyrl.errors import CheckpointError
from polyrl.models.checkpoint import load_model
from polyrl.models.lora import (
    LoraConfig,
    adapter_parameters,
    apply_lora,
    load_lora_model,
    read_adapter_config,
    save_adapter,
)

peft = pytest.importorskip("peft")
LENS = [6, 11, 4]


def _hf(model_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir), torch_dtype=torch.float32, attn_implementation="eager"
    ).eval()


def _ours_with_random_adapter(model_dir, targets=("q", "k", "v", "o", "gate", "up", "down")):
    model = load_model(model_dir, dtype=torch.float32)
    apply_lora(model, LoraConfig(r=4, alpha=12, targets=list(targets)))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in adapter_parameters(model).values():
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return model


def test_peft_loads_our_adapter_with_our_logits(tiny_model_dir, tmp_path):
    model = _ours_with_random_adapter(tiny_model_dir)
    out = save_adapter(model, tmp_path / "adapter", base_model=str(tiny_model_dir), tokenizer=tiny_model_dir)
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["task_type"] == "CAUSAL_LM" and cfg["r"] == 4
    assert cfg["lora_alpha"] == 12 and cfg["base_model_name_or_path"] == str(tiny_model_dir)
    assert (out / "tokenizer.json").is_file()
    ids, pos, meta = packed(LENS, model.config.vocab_size)
    ours = logits(model, ids, pos, meta)
    hf = _hf(tiny_model_dir)
    base_hf = hf_logits(hf, ids, LENS)
    pm = peft.PeftModel.from_pretrained(hf, str(out)).eval()
    theirs = hf_logits(pm, ids, LENS)
    assert (theirs - base_hf).abs().max().item() > 1e-2  # the adapter was applied
    assert (theirs - ours).abs().max().item() < 1e-4


def test_adapter_saved_by_peft_loads_into_ours(tiny_model_dir, tmp_path):
    hf = _hf(tiny_model_dir)
    pcfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], task_type="CAUSAL_LM")
    pm = peft.get_peft_model(hf, pcfg)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    pm.save_pretrained(str(tmp_path / "peft_adapter"))
    pm.eval()
    cfg, base = read_adapter_config(tmp_path / "peft_adapter")
    assert cfg.targets == ["q_proj", "v_proj", "down_proj"] and cfg.scaling == 2.0
    model = load_lora_model(tmp_path / "peft_adapter", None, torch.float32)  # base from base_model_name_or_path
    assert base == str(tiny_model_dir)
    ids, pos, meta = packed(LENS, model.config.vocab_size, seed=1)
    assert (logits(model, ids, pos, meta) - hf_logits(pm, ids, LENS)).abs().max().item() < 1e-4


def test_broken_adapters_are_refused(tiny_model_dir, tmp_path):
    model = _ours_with_random_adapter(tiny_model_dir, targets=("q", "v"))
    out = save_adapter(model, tmp_path / "a", base_model=str(tiny_model_dir))
    d = json.loads((out / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**d, "use_dora": True}))
    with pytest.raises(CheckpointError, match="use_dora"):
        read_adapter_config(out)
    (out / "adapter_config.json").write_text(json.dumps({**d, "target_modules": ["q_proj", "v_proj", "k_proj"]}))
    with pytest.raises(CheckpointError, match="missing"):
        load_lora_model(out, None, torch.float32)
    (out / "adapter_config.json").write_text(json.dumps({**d, "base_model_name_or_path": str(tmp_path / "nope")}))
    with pytest.raises(CheckpointError, match="is not here.*--base"):
        load_lora_model(out, None, torch.float32)
