"""A GRPO run on function-calling prompt rows: each row's OpenAI ``tools`` are in the prompt the policy samples from
(rendered by data.chat_template) and in the example a reward function gets; a template that does not render them
stops the run at start-up, naming the file and the prompt (the tools were dropped silently before)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from polyrl.errors import DataError

# ChatML that writes the row's tool definitions into a system block first (as Qwen2.5's does, in short)
TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t['function'] | tojson }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ADD = {"type": "function", "function": {"name": "add", "description": "Adds two integers", "parameters": {}}}
REWARD = (
    "def sees_tools(completion, example):\n"
    "    tools = example['tools'] or []\n"
    "    return float([t['function']['name'] for t in tools] == ['add'])\n"
)


def _raw(model_dir: Path, out: Path, data: Path, reward: Path, **data_cfg) -> dict:
    return {
        "algo": "grpo",
        "model": str(model_dir),
        "out": str(out),
        "seed": 0,
        "data": {"path": str(data), **data_cfg},
        "engine": {"micro_batch_tokens": 512},
        "train": {"max_steps": 1, "log_every": 100, "report_to": "none"},
        "checkpoint": {"every_n_steps": 0, "keep_last_k": 0, "save_final": False},
        "grpo": {
            "reward": f"{reward}:sees_tools",
            "reward_workers": 0,
            "prompts_per_step": 2,
            "samples_per_prompt": 2,
            "max_new_tokens": 4,
            "max_prompt_len": 256,
            "rollouts_to_save": 4,
        },
    }


def _run(raw: dict) -> dict:
    from polyrl import run as runner
    from polyrl.run import config

    torch.set_num_threads(1)
    return runner.run(config.build(raw))


def test_grpo_prompts_show_the_rows_tools_and_rewards_get_them(tiny_model_dir, tmp_path):
    data = tmp_path / "calls.jsonl"
    rows = [{"prompt": f"{a}+{a}?", "answer": str(2 * a), "tools": [ADD]} for a in range(1, 5)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reward = tmp_path / "r.py"
    reward.write_text(REWARD)
    out = tmp_path / "grpo"
    _run(_raw(tiny_model_dir, out, data, reward, chat_template=TEMPLATE))
    (metrics,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert metrics["reward"] == 1.0  # every sample's example carried the row's tools
    prompts = [json.loads(line)["prompt"] for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert len(prompts) == 4
    for p in prompts:
        assert p.startswith('<|im_start|>system\n# Tools\n{"name": "add", "description": "Adds two integers"')
        assert p.endswith("?<|im_end|>\n<|im_start|>assistant\n")
    # the tiny model's own ChatML template has no tools: refused before any weights load, naming file and prompt
    with pytest.raises(DataError, match=r"calls\.jsonl: prompt 1: the row has tools, but the chat template does not"):
        _run(_raw(tiny_model_dir, tmp_path / "refused", data, reward))
    assert not (tmp_path / "refused" / "metrics.jsonl").exists()


def test_reward_eval_prompts_carry_the_rows_tools(tiny_model_dir, tmp_path):
    """``polyrl eval --data --reward`` (reward_eval) encodes the prompts as the run does: with the row's tools."""
    from polyrl.eval.loading import eval_engine, load_eval_model
    from polyrl.eval.rewards import reward_eval

    data = tmp_path / "calls.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+1?", "tools": [ADD]}) + "\n" for a in range(3)))
    reward = tmp_path / "r.py"
    reward.write_text(REWARD)
    torch.set_num_threads(1)
    model, tok = load_eval_model(tiny_model_dir, "float32", "cpu")
    llm = eval_engine(model, tok)
    with pytest.raises(DataError, match=r"calls\.jsonl: prompt 1: the row has tools, but the chat template does not"):
        reward_eval(llm, str(data), f"{reward}:sees_tools", max_tokens=2, workers=0)
    tok.chat_template = TEMPLATE  # the eval reads the model's own template: one that renders tools
    got = reward_eval(llm, str(data), f"{reward}:sees_tools", max_tokens=2, workers=0)
    assert got.num_prompts == 3 and got.mean_reward == 1.0
