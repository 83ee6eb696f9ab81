"""HF checkpoint folders: round trips with transformers, sharding, dtype, atomic save, bad checkpoints."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch
from model_helpers import hf_logits, hf_twin, logits, packed, randomize_

from polyrl.errors import CheckpointError, UserError
from polyrl.models.checkpoint import INDEX_FILE, SINGLE_FILE, load_model, save_model

transformers = pytest.importorskip("transformers")
LENS = [6, 9]


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_our_save_transformers_load(tiny_model, tmp_path, family):
    model = randomize_(tiny_model(family), seed=2).eval()
    save_model(model, tmp_path / "ckpt", max_shard_bytes=40_000)  # forces several shards + index
    files = sorted(os.listdir(tmp_path / "ckpt"))
    assert INDEX_FILE in files and sum(f.endswith(".safetensors") for f in files) > 2
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config["model_type"] == family and config["torch_dtype"] == "float32"
    assert config["architectures"] == [model.config.family.architecture]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", attn_implementation="eager").eval()
    assert type(hf).__name__ == model.config.family.architecture
    ids, pos, meta = packed(LENS, model.config.vocab_size)
    ref = hf_logits(hf, ids, LENS)
    assert (logits(model, ids, pos, meta) - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_transformers_save_our_load(tiny_config, tmp_path, family):
    cfg = tiny_config(family)
    hf = hf_twin(cfg, seed=3)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_model(tmp_path / "hf")
    assert ours.config.model_type == family
    ids, pos, meta = packed(LENS, cfg.vocab_size, seed=1)
    assert (logits(ours, ids, pos, meta) - hf_logits(hf, ids, LENS)).abs().max().item() <= 1e-4


def test_save_load_save_is_byte_identical(tiny_model, tmp_path):
    from safetensors.torch import load_file

    model = randomize_(tiny_model("qwen2"), seed=4)
    save_model(model, tmp_path / "a")
    save_model(load_model(tmp_path / "a"), tmp_path / "b")
    a, b = load_file(tmp_path / "a" / SINGLE_FILE), load_file(tmp_path / "b" / SINGLE_FILE)
    assert a.keys() == b.keys() and len(a) == len(model.state_dict())
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    assert (tmp_path / "a" / SINGLE_FILE).read_bytes() == (tmp_path / "b" / SINGLE_FILE).read_bytes()
    assert (tmp_path / "a" / "config.json").read_text() == (tmp_path / "b" / "config.json").read_text()


def test_dtype_cast_on_load_and_save(tiny_model, tmp_path):
    model = tiny_model("qwen3")
    save_model(model, tmp_path / "bf16", dtype=torch.bfloat16)
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    loaded = load_model(tmp_path / "bf16")  # config dtype by default
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    as_fp32 = load_model(tmp_path / "bf16", dtype=torch.float32)
    ref = model.model.embed_tokens.weight.to(torch.bfloat16).float()
    assert torch.equal(as_fp32.model.embed_tokens.weight, ref)


def test_tied_checkpoint_with_redundant_lm_head_loads(tiny_model, tmp_path):
    from safetensors.torch import save_file

    model = tiny_model("qwen3")
    save_model(model, tmp_path / "c")
    state = {n: t.contiguous() for n, t in model.state_dict().items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, str(tmp_path / "c" / SINGLE_FILE), metadata={"format": "pt"})
    loaded = load_model(tmp_path / "c")
    assert loaded.lm_head is None and torch.equal(loaded.lm_head_weight, model.lm_head_weight)


def test_save_replaces_atomically_and_cleans_up_on_failure(tiny_model, tmp_path):
    target = tmp_path / "ckpt"
    save_model(tiny_model("qwen3", seed=1), target)
    first = (target / SINGLE_FILE).read_bytes()

    class BrokenTokenizer:
        def save_pretrained(self, path):
            raise OSError("disk full")

    with pytest.raises(CheckpointError, match=f"could not write the model folder {target}: disk full; its previous"):
        save_model(tiny_model("qwen3", seed=2), target, tokenizer=BrokenTokenizer())
    assert (target / SINGLE_FILE).read_bytes() == first  # old checkpoint intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temp folders left
    save_model(tiny_model("qwen3", seed=2), target)
    assert (target / SINGLE_FILE).read_bytes() != first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_folder_that_cannot_be_made_is_a_checkpoint_error(tiny_model, tmp_path, monkeypatch):
    """Making the folders is part of the write: an out under a file, or a full disk when the temporary folder is
    made, was a FileExistsError / OSError traceback (only failures inside the temporary folder were worded). A
    LoRA model goes the same way through save_adapter."""
    import errno

    from polyrl.models import hf_io
    from polyrl.models.lora import LoraConfig, apply_lora

    (tmp_path / "a-file").write_text("x")
    lora = apply_lora(tiny_model("qwen3"), LoraConfig(r=2, targets=["q"]))
    for model, name in ((tiny_model("qwen3"), "model"), (lora, "adapter")):
        out = tmp_path / "a-file" / name
        said = f"could not write the model folder {out}: {tmp_path / 'a-file'} is a file, not a folder; nothing was "
        with pytest.raises(CheckpointError, match=said + "written there; free disk space or choose another folder"):
            save_model(model, out)

    def disk_full(out):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(out.parent / f".{out.name}.tmp"))

    monkeypatch.setattr(hf_io, "make_temp_dir", disk_full)  # both writers go through hf_io.atomic_folder
    for model, name in ((tiny_model("qwen3"), "model"), (lora, "adapter")):
        with pytest.raises(CheckpointError, match=f"could not write the model folder {tmp_path / name}: No space"):
            save_model(model, tmp_path / name)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


# ----- bad checkpoints ----------------------------------------------------------------------------


@pytest.fixture
def saved(tiny_model, tmp_path):
    save_model(tiny_model("qwen3"), tmp_path / "ok", max_shard_bytes=60_000)
    return tmp_path / "ok"


def test_missing_folder_config_and_weights(saved, tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "absent")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text((saved / "config.json").read_text())
    with pytest.raises(CheckpointError, match="no weights"):
        load_model(empty)
    shards = sorted(saved.glob("model-*.safetensors"))
    shards[1].unlink()
    with pytest.raises(CheckpointError, match=f"missing.*{shards[1].name}"):
        load_model(saved)


def test_wrong_shapes_missing_and_unexpected_in_one_error(tiny_model, tmp_path):
    from safetensors.torch import save_file

    model = tiny_model("qwen3")
    save_model(model, tmp_path / "c")
    state = dict(model.state_dict())
    state["model.layers.7.mlp.up_proj.weight"] = state.pop("model.layers.1.mlp.up_proj.weight")
    state["model.norm.weight"] = torch.ones(3)
    save_file(state, str(tmp_path / "c" / SINGLE_FILE))
    with pytest.raises(CheckpointError) as err:
        load_model(tmp_path / "c")
    msg = str(err.value)
    assert "missing (1): model.layers.1.mlp.up_proj.weight" in msg
    assert "unexpected (1): model.layers.7.mlp.up_proj.weight" in msg
    assert "wrong shape (1): model.norm.weight (checkpoint [3], model [64])" in msg


def test_config_mismatching_weights_lists_every_tensor(saved):
    config = json.loads((saved / "config.json").read_text())
    config["vocab_size"] += 5
    (saved / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"model.embed_tokens.weight \(checkpoint \[131, 64\], model \[136, 64\]"):
        load_model(saved)


def test_unsupported_model_type(saved):
    config = json.loads((saved / "config.json").read_text())
    config["model_type"] = "gpt_neox"
    (saved / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="gpt_neox.*llama, mistral, mixtral, olmoe, qwen2, qwen2_moe, qwen3, qwen3_moe"):
        load_model(saved)


@pytest.mark.parametrize("keep", [4, 100, -200])
def test_truncated_safetensors_names_the_file(tiny_model, tmp_path, keep):
    save_model(tiny_model("qwen3"), tmp_path / "t")
    f = tmp_path / "t" / SINGLE_FILE
    data = f.read_bytes()
    f.write_bytes(data[:keep])
    with pytest.raises(CheckpointError, match=f"{SINGLE_FILE}.*corrupted or truncated"):
        load_model(tmp_path / "t")


def test_pickled_weights_are_never_unpickled(saved, tmp_path):
    folder = tmp_path / "pickled"
    folder.mkdir()
    (folder / "config.json").write_text((saved / "config.json").read_text())
    marker = tmp_path / "unpickled"

    class Boom:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (folder / "pytorch_model.bin").write_bytes(pickle.dumps(Boom()))
    with pytest.raises(CheckpointError, match="never unpickles.*safetensors"):
        load_model(folder)
    assert not marker.exists()
