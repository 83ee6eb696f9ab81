"""Pieces without a server: the fastapi-free import, ServeConfig checks, the Prometheus text format, the
`polyrl serve` argument mapping (with POLYRL_API_KEY), and error-body parameter names."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from polyrl.errors import ConfigError


def test_import_without_fastapi_then_clear_error_on_build():
    code = (
        "import sys\n"
        "sys.modules['fastapi'] = None  # what an install without the [serve] extra looks like to import\n"
        "import polyrl.server as s\n"
        "assert not {'uvicorn', 'starlette', 'pydantic'} & set(sys.modules)\n"
        "from polyrl.errors import UserError\n"
        "try:\n"
        "    s.build_app(None)\n"
        "except UserError as e:\n"
        "    print('ERR', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "ERR" in out.stdout and "pip install -e '.[serve]'" in out.stdout and "fastapi" in out.stdout


@pytest.mark.parametrize(
    "kw",
    [
        dict(port=70000),
        dict(served_model_name=""),
        dict(api_key="  "),
        dict(max_queue=-1),
        dict(max_queue=0),
        dict(max_n=0),
        dict(max_request_bytes=10),
        dict(body_timeout_s=0),
        dict(default_max_tokens=0),
        dict(chat_template_timeout_s=-1),
    ],
)
def test_serve_config_rejects(kw):
    from polyrl.server import ServeConfig

    with pytest.raises(ConfigError):
        ServeConfig(**kw)


def test_prometheus_text_format():
    from polyrl.server.metrics import Counter, Histogram, ServerMetrics

    c = Counter("x_total", "help", ("endpoint", "status"))
    c.inc(1, "/a", "200")
    c.inc(2, "/a", "200")
    c.inc(1, '/b"q', "400")
    text = "\n".join(c.render())
    assert "# TYPE x_total counter" in text
    assert 'x_total{endpoint="/a",status="200"} 3' in text
    assert 'x_total{endpoint="/b\\"q",status="400"} 1' in text
    h = Histogram("lat_seconds", "help", (0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 3.0):
        h.observe(v)
    lines = h.render()
    assert 'lat_seconds_bucket{le="0.1"} 2' in lines  # le is inclusive
    assert 'lat_seconds_bucket{le="1"} 3' in lines
    assert 'lat_seconds_bucket{le="+Inf"} 4' in lines
    assert "lat_seconds_count 4" in lines and "lat_seconds_sum 3.65" in lines
    m = ServerMetrics()
    m.update_engine({"waiting_requests": 3, "running_requests": 2, "kv_cache_usage": 0.25})
    body = m.render()
    assert "polyrl_queue_depth 3" in body and "polyrl_running_requests 2" in body
    assert "polyrl_kv_cache_usage 0.25" in body and body.endswith("\n")


def test_serve_cli_arguments(monkeypatch):
    from polyrl.cli import serve

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    monkeypatch.setenv("POLYRL_API_KEY", "from-env")
    args = parser.parse_args(["--model", "m/dir", "--port", "0", "--max-queue", "4", "--kv-cache-blocks", "32"])
    cfg, eng = serve.build_configs(args)
    assert cfg.api_key == "from-env" and cfg.served_model_name == "m/dir" and cfg.max_queue == 4 and cfg.port == 0
    assert eng.num_blocks == 32 and eng.max_num_seqs == 256 and eng.enable_prefix_caching
    args = parser.parse_args(
        ["--model", "m", "--api-key", "flag", "--served-model-name", "nice", "--no-prefix-caching"]
    )
    cfg, eng = serve.build_configs(args)
    assert cfg.api_key == "flag" and cfg.served_model_name == "nice" and not eng.enable_prefix_caching
    assert cfg.max_request_bytes == 8 * 1024 * 1024 and cfg.default_max_tokens == 1024
    assert not cfg.allow_request_chat_template
    args = parser.parse_args(
        ["--model", "m", "--max-request-bytes", "4096", "--default-max-tokens", "7", "--allow-request-chat-template"]
    )
    cfg, _ = serve.build_configs(args)
    assert cfg.max_request_bytes == 4096 and cfg.default_max_tokens == 7 and cfg.allow_request_chat_template
    from polyrl.platform import envvars

    assert envvars.POLYRL_API_KEY in envvars.ALL


def test_serve_cli_missing_model_is_a_user_error(tmp_path):
    from polyrl.cli.main import main

    assert main(["serve", "--model", str(tmp_path / "nope")]) == 2


def test_validation_param_names_drop_union_tags():
    from polyrl.server.api_errors import validation_message

    msg, param = validation_message(
        [
            {"loc": ("body", "stop", "str"), "msg": "Input should be a valid string"},
            {"loc": ("body", "stop", "list[str]", 0), "msg": "Input should be a valid string"},
        ]
    )
    assert param == "stop" and msg.startswith("stop: Input should be a valid string")


def test_decode_prompts_is_the_tokenizers_decode(tiny_model_dir):
    """Token-id prompts' echoed texts, decoded in one Rust ``decode_batch`` call, are what ``tokenizer.decode`` gives
    for each (special tokens kept, split multi-byte characters); with clean-up of tokenisation spaces on (the batch
    call would skip it) the tokenizer's own ``decode`` runs."""
    from transformers import AutoTokenizer

    from polyrl.server.prompts import decode_prompts

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    prompts = [list(range(i, tok.vocab_size, 97)) for i in range(40)] + [[tok.eos_token_id, 300, 301], [5]]
    prompts.append(tok.encode("héllo wörld ☃ , . !") + [tok.eos_token_id])
    want = [tok.decode(p) for p in prompts]
    assert tok.clean_up_tokenization_spaces is False
    assert decode_prompts(tok, prompts) == want
    tok.clean_up_tokenization_spaces = True
    assert decode_prompts(tok, prompts) == [tok.decode(p) for p in prompts]


def test_token_text_fill_is_decode_of_each_id(tiny_model_dir):
    """``TokenText.fill`` decodes new ids in one batch call: each string is ``tokenizer.decode([id])`` (special
    tokens kept), its JSON text what ``json.dumps`` writes, its length the string's; ids seen before stay."""
    import json

    from transformers import AutoTokenizer

    from polyrl.server.logprobs import TokenText

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    text_of = TokenText(tok)
    first = text_of(300)
    ids = list(range(len(tok))) + [tok.eos_token_id, 5]
    text_of.fill(ids)
    for t in set(ids):
        s = tok.decode([t], skip_special_tokens=False)
        assert text_of(t) == s and text_of.length[t] == len(s)
        assert text_of.json[t] == json.dumps(s, ensure_ascii=False)
    assert text_of(300) is first
    no_tokenizer = TokenText(None)
    no_tokenizer.fill([7, 7, 3])
    assert no_tokenizer.json == {3: '"token_id:3"', 7: '"token_id:7"'}
