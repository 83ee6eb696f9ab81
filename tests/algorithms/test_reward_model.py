"""Issue 29 (3): ``polyrl train --algo rm`` (Bradley-Terry on preference pairs) raises the chosen-vs-rejected
accuracy and writes a folder that transformers' ``AutoModelForSequenceClassification`` loads and scores exactly as
polyrl's ``ModelScorer`` does (fp32, 1e-4, one row and a right-padded batch)."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from polyrl.algorithms.reward_sources import RewardConfig, open_rewards
from polyrl.algorithms.reward_sources.model import ModelScorer, load_reward_model
from polyrl.cli.main import main
from polyrl.errors import CheckpointError, ConfigError

GOOD = ["great", "kind", "smart", "brave", "fun", "clever"]
BAD = ["awful", "rude", "dull", "mean", "lazy", "boring"]


def preference_rows(n: int, seed: int) -> list[dict]:
    """Pairs a reward model can separate: a kind description is preferred to an unkind one of the same friend."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        k = rng.randint(1, 99)
        rows.append(
            {
                "prompt": f"Describe friend number {k}.",
                "chosen": f"Friend {k} is {rng.choice(GOOD)}.",
                "rejected": f"Friend {k} is {rng.choice(BAD)}.",
            }
        )
    return rows


def accuracy(folder, rows) -> float:
    scorer = ModelScorer(str(folder), RewardConfig(), device="cpu")
    wins = 0
    for r in rows:
        ex = {"messages": [{"role": "user", "content": r["prompt"]}]}
        c, j = scorer.score_ids([scorer.encode(r["chosen"], ex), scorer.encode(r["rejected"], ex)])
        wins += c > j
    return wins / len(rows)


@pytest.fixture(scope="module")
def rm_run(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("rm")
    data = root / "pref.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in preference_rows(32, seed=0)))
    out = root / "run"
    argv = ["train", "--algo", "rm", "--model", str(tiny_model_dir), "--data", str(data), "--out", str(out)]
    argv += ["--max-steps", "12", "--lr", "3e-3", "--micro-batch-tokens", "512", "--log-every", "100"]
    assert main([*argv, "--report-to", "none"]) == 0
    return out


def test_rm_training_raises_held_out_accuracy(rm_run, tiny_model_dir):
    held_out = preference_rows(24, seed=1)
    before = accuracy(tiny_model_dir, held_out)  # the causal LM with a fresh seeded head
    after = accuracy(rm_run / "final", held_out)
    assert after >= 0.9 and after > before + 0.2, (before, after)
    recs = [json.loads(x) for x in (rm_run / "metrics.jsonl").read_text().splitlines()]
    assert recs[-1]["loss"] < 0.5 * recs[0]["loss"] and recs[-1]["rewards/accuracies"] > recs[0]["rewards/accuracies"]


def test_transformers_scores_equal_ours(rm_run):
    from transformers import AutoModelForSequenceClassification

    folder = rm_run / "final"
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForSequenceClassification"] and cfg["num_labels"] == 1
    hf = AutoModelForSequenceClassification.from_pretrained(str(folder), dtype=torch.float32).eval()
    scorer = ModelScorer(str(folder), RewardConfig(), device="cpu")
    ex = {"messages": [{"role": "user", "content": "Describe friend number 5."}]}
    ids = [scorer.encode(c, ex) for c in ("Friend 5 is great.", "Friend 5 is awful.", "something else entirely")]
    ours = torch.tensor(scorer.score_ids(ids))
    with torch.no_grad():
        single = torch.tensor([hf(torch.tensor([x])).logits[0, 0].item() for x in ids])
        pad = hf.config.pad_token_id
        longest = max(map(len, ids))
        batch = torch.tensor([x + [pad] * (longest - len(x)) for x in ids])
        padded = hf(batch, attention_mask=(batch != pad).long()).logits[:, 0]
    assert torch.allclose(ours, single, atol=1e-4) and torch.allclose(ours, padded, atol=1e-4)
    assert ours[0] > ours[1]  # it learned the preference


def test_reward_model_as_a_reward_source(rm_run):
    cfg = RewardConfig(model=str(rm_run / "final"), model_batch_size=2)
    ex = {"prompt": "Describe friend number 7.", "messages": [{"role": "user", "content": "Describe friend number 7."}]}
    with open_rewards("model", cfg, device="cpu") as scorer:
        res = scorer.score(["Friend 7 is kind.", "Friend 7 is rude.", "Friend 7 is fun."], [ex] * 3)
    assert res.num_failures == 0 and res.rewards[0] > res.rewards[1] and res.rewards[2] > res.rewards[1]
    assert res.metrics()["reward/model"] == pytest.approx(sum(res.rewards) / 3)


def test_bad_reward_model_folders(tmp_path, tiny_model_dir):
    with pytest.raises(ConfigError, match="has no config.json"):
        ModelScorer(str(tmp_path), RewardConfig())
    two = tmp_path / "two"
    shutil.copytree(tiny_model_dir, two)
    cfg = json.loads((two / "config.json").read_text())
    cfg.update(architectures=["Qwen3ForSequenceClassification"], num_labels=2)
    (two / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="num_labels=2; a reward model has one score"):
        load_reward_model(two)
