"""Several LoRA adapters on one served base: the request's ``model`` picks the adapter, each adapter's greedy
output equals that adapter's own engine (base + that adapter only), a batch mixing adapters gives each request its
own adapter's output, /v1/models lists them, unknown names are refused, and ``polyrl serve --lora`` parses."""

from __future__ import annotations

import pytest
import torch

from .conftest import make_llm

PROMPTS = ["What is 2 + 3?", "Say something.", "7 * 6 ="]


def _adapter(model_dir, out, seed, targets):
    from polyrl.models.checkpoint import load_model
    from polyrl.models.lora import LoraConfig, adapter_parameters, apply_lora, save_adapter

    model = apply_lora(load_model(model_dir), LoraConfig(r=4, alpha=8, targets=targets))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapter_parameters(model).values():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    return save_adapter(model, out, base_model=str(model_dir))


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {
        "math": str(_adapter(tiny_model_dir, root / "math", 1, ["q", "v", "down"])),
        "chat": str(_adapter(tiny_model_dir, root / "chat", 2, ["q", "k", "v", "o", "gate", "up", "down"])),
    }


def _greedy(llm, prompts, adapter=None):
    from polyrl.infer import SamplingParams

    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, adapter=adapter))
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def expected(tiny_model_dir, adapters):
    """Greedy tokens per model name, each from an engine holding only that adapter (LoRA layers, unmerged)."""
    from polyrl.infer import LLM, RolloutConfig
    from polyrl.models.checkpoint import load_tokenizer
    from polyrl.models.lora import load_lora_model

    tok = load_tokenizer(tiny_model_dir)
    out = {"tiny": _greedy(make_llm(tiny_model_dir), PROMPTS)}
    for name, path in adapters.items():
        model = load_lora_model(path, None, torch.float32)
        llm = LLM(model, tok, RolloutConfig(block_size=16, num_blocks=128, max_num_seqs=8, max_model_len=256))
        out[name] = _greedy(llm, PROMPTS)
    assert out["math"] != out["tiny"] and out["chat"] != out["tiny"] and out["math"] != out["chat"]
    return out


def test_mixed_batch_gives_each_request_its_adapter(tiny_model_dir, adapters, expected):
    from polyrl.errors import UserError
    from polyrl.infer import SamplingParams

    llm = make_llm(tiny_model_dir)
    assert llm.load_adapters(adapters) == ["math", "chat"]
    names = [None, "math", "chat"]
    prompts = [p for p in PROMPTS for _ in names]
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, adapter=a) for _ in PROMPTS for a in names]
    outs = llm.generate(prompts, params)  # one engine batch holding all three models' requests
    for i, o in enumerate(outs):
        name = names[i % 3] or "tiny"
        assert o.outputs[0].token_ids == expected[name][i // 3], (name, i)
    with pytest.raises(UserError, match="unknown LoRA adapter 'nope'"):
        llm.add_request("x", SamplingParams(adapter="nope"))


def test_server_model_field_picks_the_adapter(tiny_model_dir, adapters, expected):
    import openai

    from polyrl.models.checkpoint import load_tokenizer
    from polyrl.server import ServeConfig, start_server

    llm = make_llm(tiny_model_dir)
    llm.load_adapters(adapters)
    tok = load_tokenizer(tiny_model_dir)
    with start_server(llm, ServeConfig(port=0, served_model_name="tiny", log_level="warning")) as handle:
        client = openai.OpenAI(base_url=handle.base_url, api_key="x", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["tiny", "math", "chat"]
        for name in ("tiny", "math", "chat"):
            for i, prompt in enumerate(PROMPTS[:2]):
                r = client.completions.create(model=name, prompt=prompt, max_tokens=8, temperature=0)
                assert r.model == name
                want = tok.decode(expected[name][i], skip_special_tokens=True)
                assert r.choices[0].text == want, (name, prompt)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="other", prompt="hi", max_tokens=2)


def test_serve_cli_parses_adapters(adapters, tmp_path):
    from polyrl.cli.serve import parse_adapters
    from polyrl.errors import UserError

    assert parse_adapters([f"math={adapters['math']}"]) == {"math": adapters["math"]}
    for bad, words in (
        (["math"], "NAME=DIR"),
        ([f"m={adapters['math']}", f"m={adapters['chat']}"], "twice"),
        ([f"m={tmp_path}"], "no adapter_config.json"),
    ):
        with pytest.raises(UserError, match=words):
            parse_adapters(bad)
