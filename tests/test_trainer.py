"""polyrl.trainer.Trainer: colocated rollout + training over the same tensors, log-prob recompute, a GRPO step by
hand, checkpoint save/load with an exact continuation."""

from __future__ import annotations

import pytest
import torch

from polyrl.infer import RolloutConfig, SamplingParams
from polyrl.train import OptimConfig, StepConfig

PROMPTS = [[{"role": "user", "content": "What is 2 + 3?"}], [{"role": "user", "content": "Repeat exactly: abc"}]]


def _trainer(model_dir, **kw):
    from polyrl.trainer import Trainer

    return Trainer(
        model=str(model_dir),
        optim=OptimConfig(lr=1e-2, grad_clip=1.0),
        engine=StepConfig(micro_batch_tokens=256, seed=0),
        rollout=RolloutConfig(max_model_len=64, max_num_seqs=16),
        **kw,
    )


def _grpo_step(tr, seeds):
    from polyrl.algorithms.advantages import group_advantages
    from polyrl.algorithms.grpo import GRPOConfig, make_policy_loss

    samples = tr.rollout_batch(PROMPTS, n=4, sampling=SamplingParams(temperature=1.0, max_tokens=6), seeds=seeds)
    rewards = [float(len(s.completion_ids)) + 0.1 * s.completion_ids[0] % 7 for s in samples]
    adv = group_advantages(rewards, [s.group for s in samples])
    batch = tr.make_batch(samples, {"adv": adv, "old_logp": [s.logprobs for s in samples]})
    tokens = float(sum(b.num_target_tokens for b in batch))
    stats = tr.train(batch, make_policy_loss(GRPOConfig(max_new_tokens=6), tokens, tokens), normalizer=tokens)
    return samples, stats


def test_rollout_and_training_share_the_same_tensors(tiny_model_dir):
    tr = _trainer(tiny_model_dir)
    runner_params = dict(tr.llm.runner.model.named_parameters())
    for name, p in tr.model.named_parameters():
        assert runner_params[name] is p  # the very Parameter objects: no copy, nothing to sync
    before = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
    samples, stats = _grpo_step(tr, seeds=[1, 2])
    assert len(samples) == 8 and {s.group for s in samples} == {0, 1}
    assert all(len(s.logprobs) == len(s.completion_ids) > 0 for s in samples)
    assert not tr.llm.kv.allocated  # KV cache memory handed back for training
    assert stats.grad_norm > 0 and not stats.skipped
    changed = [n for n, p in tr.model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert changed, "the optimizer step must update the weights in place"
    # The next rollout samples from the updated weights: its log-probs agree with a trainer forward.
    after = tr.rollout_batch(PROMPTS, n=2, sampling=SamplingParams(temperature=1.0, max_tokens=6), seeds=[3, 4])
    lps = tr.forward_logprobs(after)
    diff = max(float((torch.tensor(s.logprobs) - lp).abs().max()) for s, lp in zip(after, lps))
    assert diff < 1e-4
    old = tr.forward_logprobs(samples)
    assert max(float((torch.tensor(s.logprobs) - lp).abs().max()) for s, lp in zip(samples, old)) > 1e-3


def test_entropy_and_text_prompts(tiny_model_dir):
    tr = _trainer(tiny_model_dir)
    samples = tr.rollout_batch(["hello", [5, 6, 7]], n=1, sampling=SamplingParams(temperature=0.7, max_tokens=4))
    lps, ents = tr.forward_logprobs(samples, temperature=0.7, entropy=True)
    assert [len(x) for x in lps] == [len(s.completion_ids) for s in samples]
    vocab = tr.model.config.vocab_size
    assert all(0 <= float(e.min()) and float(e.max()) <= torch.log(torch.tensor(float(vocab))) + 1e-4 for e in ents)
    assert samples[1].prompt_ids == [5, 6, 7]


def test_a_prompt_examples_tools_reach_the_chat_template(tiny_model_dir):
    from polyrl.data import PromptExample
    from polyrl.errors import UserError
    from polyrl.models.checkpoint import load_tokenizer

    tok = load_tokenizer(str(tiny_model_dir))
    tr = _trainer(tiny_model_dir, tokenizer=tok)
    add = {"type": "function", "function": {"name": "add", "description": "Adds two integers"}}
    ex = PromptExample(PROMPTS[0], tools=[add])
    # the model's own ChatML template has no tools: refused rather than sampled without them
    with pytest.raises(UserError, match="prompt: the row has tools, but the chat template does not render them"):
        tr.encode(ex)
    tok.chat_template = (
        "{% for t in tools or [] %}<|im_start|>system\n{{ t['function'] | tojson }}<|im_end|>\n{% endfor %}"
        + tok.chat_template
    )
    text = tok.decode(tr.encode(ex))
    assert text.startswith('<|im_start|>system\n{"name": "add", "description": "Adds two integers"}<|im_end|>\n')
    assert text.endswith("What is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")
    assert tr.encode(PromptExample(PROMPTS[0])) == tr.encode(PROMPTS[0]) and len(tr.encode(PROMPTS[0])) < len(
        tr.encode(ex)
    )


def test_save_load_continues_exactly(tiny_model_dir, tmp_path):
    tr = _trainer(tiny_model_dir)
    _grpo_step(tr, seeds=[1, 2])
    path = tr.save(tmp_path / "ckpt")
    assert path.name == "step-00000001"
    _, s_a = _grpo_step(tr, seeds=[5, 6])
    weights_a = {n: p.detach().clone() for n, p in tr.model.named_parameters()}

    tr2 = _trainer(tiny_model_dir)
    loaded = tr2.load(tmp_path / "ckpt")
    assert loaded.step == 1 and tr2.engine.global_step == 1
    _, s_b = _grpo_step(tr2, seeds=[5, 6])
    assert s_b.loss == s_a.loss and s_b.grad_norm == s_a.grad_norm
    for n, p in tr2.model.named_parameters():
        assert torch.equal(p.detach(), weights_a[n]), n


def test_load_without_checkpoint_is_a_clear_error(tiny_model_dir, tmp_path):
    from polyrl.errors import CheckpointError

    tr = _trainer(tiny_model_dir)
    with pytest.raises(CheckpointError, match="holds none"):
        tr.load(tmp_path)
