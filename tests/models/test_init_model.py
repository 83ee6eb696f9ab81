"""`polyrl init-model`: presets load in transformers (model and tokenizer), match our model, are deterministic."""

from __future__ import annotations

import json

import pytest
import torch
from model_helpers import hf_logits, logits, packed

from polyrl.models.checkpoint import SINGLE_FILE, load_model, load_tokenizer
from polyrl.models.decoder import DecoderLM, build_model
from polyrl.models.presets import PRESETS, preset_config
from polyrl.models.tokenizer import IM_END, IM_START, train_bpe

transformers = pytest.importorskip("transformers")


def test_tiny_folder_loads_in_transformers_and_matches_ours(tiny_model_dir):
    names = {p.name for p in tiny_model_dir.iterdir()}
    assert {"config.json", "generation_config.json", SINGLE_FILE, "tokenizer.json", "tokenizer_config.json"} <= names
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    assert (cfg["model_type"], cfg["hidden_size"], cfg["num_hidden_layers"], cfg["tie_word_embeddings"]) == (
        "qwen3",
        64,
        2,
        True,
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager").eval()
    ours = load_model(tiny_model_dir).eval()
    ids, pos, meta = packed([8, 5], cfg["vocab_size"])
    assert (logits(ours, ids, pos, meta) - hf_logits(hf, ids, [8, 5])).abs().max().item() <= 1e-4
    std = ours.model.layers[0].mlp.up_proj.weight.std().item()
    assert std == pytest.approx(0.02, rel=0.05)  # HF-style init, initializer_range 0.02
    assert torch.equal(ours.model.norm.weight, torch.ones(64))


def test_tiny_tokenizer_chat_template_and_special_ids(tiny_model_dir):
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    auto = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    tok = load_tokenizer(tiny_model_dir)
    assert len(auto) == len(tok) == cfg["vocab_size"] == 2048
    assert tok.eos_token == IM_END and tok.eos_token_id == cfg["eos_token_id"]
    assert tok.pad_token_id == cfg["pad_token_id"] != tok.eos_token_id
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12 + 7?"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        f"{IM_START}system\nBe brief.{IM_END}\n{IM_START}user\nWhat is 12 + 7?{IM_END}\n{IM_START}assistant\n"
    )
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text and ids.count(tok.convert_tokens_to_ids(IM_START)) == 3
    digits = tok.convert_ids_to_tokens(tok("12345")["input_ids"])
    assert digits == ["1", "2", "3", "4", "5"]  # one token per digit


def test_tiny_weights_are_deterministic_per_seed(tiny_model_dir):
    loaded = load_model(tiny_model_dir)
    again = build_model(preset_config("tiny"), seed=0)
    other = build_model(preset_config("tiny"), seed=1)
    for (name, a), b, c in zip(loaded.state_dict().items(), again.state_dict().values(), other.state_dict().values()):
        assert torch.equal(a, b), name
        if "norm" not in name:
            assert not torch.equal(a, c), name


def test_cli_writes_a_loadable_checkpoint(tmp_path, tiny_model_dir):
    from polyrl.cli.main import main

    assert main(["init-model", "--preset", "tiny", "--out", str(tmp_path / "m"), "--seed", "3"]) == 0
    assert (tmp_path / "m" / "tokenizer.json").read_bytes() == (tiny_model_dir / "tokenizer.json").read_bytes()
    model = load_model(tmp_path / "m")
    assert torch.equal(model.lm_head_weight, build_model(preset_config("tiny"), seed=3).lm_head_weight)
    with pytest.raises(SystemExit) as exit_info:
        main(["init-model", "--preset", "huge", "--out", str(tmp_path / "x")])
    assert exit_info.value.code == 2


def test_cli_refuses_to_replace_a_folder_that_is_not_a_model(tmp_path, capsys):
    """init-model replaces its --out; a run directory there (a user's `--out runs/sft`, say) is refused, whole."""
    from polyrl.cli.main import main

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "run_config.json").write_text("{}")
    assert main(["init-model", "--preset", "tiny", "--out", str(run)]) == 2
    err = capsys.readouterr().err
    assert "already holds files that are not a model (checkpoints, run_config.json)" in err
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "run_config.json"]
    assert main(["init-model", "--preset", "tiny", "--out", str(run / "checkpoints")]) == 0  # empty: fine
    assert main(["init-model", "--preset", "tiny", "--out", str(run / "checkpoints"), "--seed", "1"]) == 0  # a model


def test_export_names_the_adapter_of_a_run_and_keeps_the_run(tmp_path, capsys):
    """export --adapter RUN (not RUN/final) names RUN/final; export --out RUN would replace the run: refused."""
    from polyrl.cli.main import main

    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "final" / "adapter_config.json").write_text("{}")
    (run / "run_config.json").write_text("{}")
    assert main(["export", "--adapter", str(run), "--merge", "--out", str(tmp_path / "merged")]) == 2
    assert f"give its model folder {run / 'final'}" in capsys.readouterr().err
    assert main(["export", "--adapter", str(run / "final"), "--merge", "--out", str(run)]) == 2
    assert "export replaces its --out folder" in capsys.readouterr().err
    assert sorted(p.name for p in run.iterdir()) == ["final", "run_config.json"]


# Real models' parameter counts: the shape presets must reproduce them exactly.
SHAPE_PARAMS = {
    "qwen3-0.6b-shape": 596_049_920,
    "qwen3-1.7b-shape": 1_720_574_976,
    "qwen3-8b-shape": 8_190_735_360,
    "llama3.2-1b-shape": 1_235_814_400,
}


@pytest.mark.parametrize("name", list(SHAPE_PARAMS))
def test_shape_presets_have_real_dimensions(name):
    cfg = preset_config(name)
    with torch.device("meta"):
        model = DecoderLM(cfg)
    assert model.num_parameters() == SHAPE_PARAMS[name]
    assert PRESETS[name].dtype == torch.bfloat16
    hf = transformers.AutoConfig.for_model(**cfg.to_hf_dict())
    with torch.device("meta"):
        hf_model = transformers.AutoModelForCausalLM.from_config(hf)
    assert sum(p.numel() for p in hf_model.parameters()) == SHAPE_PARAMS[name]


def test_big_vocab_tokenizer_is_padded_to_the_model_vocab():
    tok = train_bpe(151936)
    assert tok.get_vocab_size(with_added_tokens=True) == 151936
    assert tok.decode([151935]).startswith("<filler_")
    text = "What is 3 + 4? The answer is 7."
    assert tok.encode(text).ids == train_bpe(4096).encode(text).ids  # fillers never change encoding
