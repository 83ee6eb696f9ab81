"""Partial rollouts (``partial_rollouts``, ``polyrl.run.async_rollout.PartialRollouts``, ``LLM.swap_weights``) on
the CPU with tiny models: a weight update between two decode steps splits the sequences in flight exactly (earlier
tokens version v, later ones v + 1, in every decode mode); the behaviour log-probs are those of each token's own
version wherever that is exactly checkable; an async run with partial rollouts trains no token older than K
versions, mixes versions inside samples and resumes bit for bit (reproducible swap step); the refusals are clear
(agentic runs with partial rollouts: ``test_async_agentic``)."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from _async_runs import raw_config as _raw
from _async_runs import records as _records
from _async_runs import run as _run
from _async_runs import without_clocks, write_reward

from polyrl.algorithms.rl_batch import Sample, completion_logprobs, pack_samples
from polyrl.infer import LLM, RolloutConfig, SamplingParams

PROMPTS = [[3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13, 14]]


@pytest.fixture()
def reward(tmp_path):
    return write_reward(tmp_path)


def _plain(rec):
    """A record without wall-clock values (the weight sync's seconds and GB/s among them; its bytes stay)."""
    return without_clocks(rec, ("weight_sync/seconds", "weight_sync/gbps"))


def _engine(model, overlap: bool, decode_steps: int) -> LLM:
    cfg = RolloutConfig(num_blocks=64, block_size=4, max_num_seqs=8, overlap_decode=overlap, decode_steps=decode_steps)
    return LLM(model, None, cfg)


def _perturbed(model, head_only: bool = False, scale: float = 0.05):
    """A copy of ``model`` with every weight (``head_only``: the final norm and the untied lm_head only) moved."""
    new = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in new.named_parameters():
            if not head_only or name.startswith(("lm_head", "norm.")):
                p.add_(torch.randn(p.shape, generator=g) * scale)
    return new


def _generate(llm: LLM, new, swap_at: int | None, max_tokens: int = 10):
    """Generate PROMPTS (2 samples each, seeded, no EOS stop) with version 0, loading ``new``'s weights as version 1
    after engine step ``swap_at`` of the call."""

    def between_steps(engine: LLM, steps: int) -> None:
        if steps == swap_at:

            def load() -> None:
                with torch.no_grad():
                    for a, b in zip(engine.model.parameters(), new.parameters()):
                        a.copy_(b)

            engine.swap_weights(load, 1)

    llm.policy_version = 0
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=max_tokens, n=2, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, between_steps=between_steps)
    return [(o.prompt_token_ids, c) for o in outs for c in o.outputs]


# overlap off: one token per step (the prefill samples the first); one ahead: the swap reads the step in flight
# first, so still one token per step; 4 decode steps per launch: 1 + 4 + 4 tokens computed by the end of step 3
@pytest.mark.parametrize(("overlap", "decode_steps", "old"), [(False, 1, 3), (True, 1, 3), (True, 4, 9)])
def test_a_swap_between_decode_steps_splits_the_sequences_in_flight(tiny_model, overlap, decode_steps, old):
    model = tiny_model("qwen3", tie_word_embeddings=False).eval()
    new = _perturbed(model)
    plain = _generate(_engine(copy.deepcopy(model), overlap, decode_steps), new, swap_at=None)
    llm = _engine(copy.deepcopy(model), overlap, decode_steps)
    swapped = _generate(llm, new, swap_at=3)
    assert len(swapped) == 6
    for (_, a), (_, b) in zip(plain, swapped):
        assert a.token_versions == [0] * 10
        assert b.token_versions == [0] * old + [1] * (10 - old)  # the exact split, every sequence
        assert b.token_ids[:old] == a.token_ids[:old] and b.logprobs[:old] == a.logprobs[:old]
    assert all(a.logprobs[old:] != b.logprobs[old:] for (_, a), (_, b) in zip(plain, swapped))  # new weights
    assert llm.policy_version == 1 and not llm.has_unfinished_requests() and llm._inflight is None
    # an engine that tracks no version (serving, synchronous RL) reports none
    untracked = _engine(copy.deepcopy(model), overlap, decode_steps)
    out = untracked.generate(PROMPTS[:1], SamplingParams(max_tokens=3, seed=1))[0].outputs[0]
    assert out.token_versions is None


def test_an_update_published_mid_generation_lands_at_the_next_decode_step(tiny_model):
    """The default mode (``partial_swap_step`` 0) through ``PartialRollouts``: the producer thread is held at its
    engine step 2 until the trainer has published version 1; ``weights_updated`` then returns only once the
    producer's engine took it, at that very boundary: 2 tokens of every sequence at version 0, the rest at 1."""
    import threading

    from polyrl.run.async_rollout import PartialRollouts, RolloutBatch

    model = tiny_model("qwen3", tie_word_embeddings=False).eval()
    trained = _perturbed(model)  # the trainer's weights after its update
    llm = _engine(copy.deepcopy(model), False, 1)
    at_step_2 = threading.Event()

    def sync() -> None:
        with torch.no_grad():
            for a, b in zip(llm.model.parameters(), trained.parameters()):
                a.copy_(b)

    def produce(step, version):
        def hook(engine, steps):
            if steps == 2:
                at_step_2.set()
                with src._cv:  # held here until the update is published (no sleep: the source's condition)
                    src._cv.wait_for(lambda: src._published >= 1)
            src.between_steps(engine, steps)

        params = SamplingParams(temperature=1.0, seed=5, max_tokens=6, n=2, ignore_eos=True)
        outs = llm.generate(PROMPTS, params, between_steps=hook)
        samples = [Sample(o.prompt_token_ids, c.token_ids, c.logprobs, "length", "", token_versions=c.token_versions)
                   for o in outs for c in o.outputs]  # fmt: skip
        return RolloutBatch(step, version, samples, [0.0] * len(samples), {}, 0.0)

    src = PartialRollouts(produce, max_staleness=1, sync=sync, engine=llm, version=0)
    try:
        src.submit(1)
        assert at_step_2.wait(60)
        src.weights_updated(1)  # returns once the generation in flight took version 1
        assert llm.policy_version == 1 and src.swaps_total == 1
        batch = src.get(1)
        assert [s.token_versions for s in batch.samples] == [[0, 0, 1, 1, 1, 1]] * 6
        assert batch.version == 0 and {s.policy_version for s in batch.samples} == {0}
    finally:
        src.close()


def _recompute(model, rows) -> list[torch.Tensor]:
    """Per row, the completion tokens' log-probs under ``model`` in one plain forward (T = 1)."""
    samples = [Sample(list(p), list(c.token_ids), list(c.logprobs), "length", "") for p, c in rows]
    lps = [None] * len(samples)
    for b in pack_samples(samples, max_tokens=4096):
        lp, _ = completion_logprobs(model, b, 1.0)
        for j, v in zip(b.sample_ids, b.per_sample(lp)):
            lps[j] = v
    return lps


@torch.no_grad()
def test_behaviour_logprobs_are_each_tokens_versions(tiny_model):
    """The tokens before the swap: exactly the old weights' log-probs (everything they saw was computed by them).
    After it, a token's log-prob comes from the new weights over a KV cache whose earlier positions the OLD weights
    computed (kept, as in AReaL), which no plain forward reproduces: exact only when the update leaves the KV
    unchanged (final norm and lm_head only, checked below); a full update shows the caveat (a plain forward under
    the new weights differs)."""
    model = tiny_model("qwen3", tie_word_embeddings=False).eval()
    for head_only in (True, False):
        new = _perturbed(model, head_only=head_only)
        rows = _generate(_engine(copy.deepcopy(model), False, 1), new, swap_at=4)
        old_lps, new_lps = _recompute(model, rows), _recompute(new, rows)
        gap = 0.0
        for (_, c), lp0, lp1 in zip(rows, old_lps, new_lps):
            got = torch.tensor(c.logprobs)
            v = torch.tensor(c.token_versions)
            assert v.tolist() == [0] * 4 + [1] * 6
            torch.testing.assert_close(got[v == 0], lp0[v == 0], atol=1e-5, rtol=0)
            if head_only:  # the KV is the same under both versions: the new tokens are the new weights' exactly
                torch.testing.assert_close(got[v == 1], lp1[v == 1], atol=1e-5, rtol=0)
                assert (got[v == 1] - lp0[v == 1]).abs().max() > 1e-3  # and not the old weights'
            gap = max(gap, float((got[v == 1] - lp1[v == 1]).abs().max()))
        if not head_only:
            assert gap > 1e-4  # the kept KV of the older weights: not a plain forward of the new ones


def test_partial_rollouts_run_mixes_versions_within_the_staleness_bound(tiny_model_dir, tmp_path, reward):
    out = tmp_path / "partial"
    raw = _raw(tiny_model_dir, out, reward, steps=3, max_staleness=1, async_producer="thread",
               partial_rollouts=True, partial_swap_step=2)  # fmt: skip
    _run(raw)
    recs = _records(out)
    assert recs[0]["async/staleness_max"] == 0.0 and recs[0]["async/mixed_version_samples"] == 0.0
    for r in recs[1:]:
        # batch s was submitted at version s-1 and took version s at its engine step 2: 2 tokens of each sequence
        # at lag 1, the rest (max_new_tokens 4) at lag 0; never older than K = 1
        assert r["async/staleness_max"] == 1.0 and r["async/mixed_version_samples"] > 0
        assert r["async/tokens_lag0"] > 0 and r["async/tokens_lag1"] > 0
        assert r["async/tokens_lag1"] == pytest.approx(r["async/tokens_lag0"], rel=0.5)
        assert r["async/stale_dropped_total"] == 0.0 and "async/is_weight_mean" in r
    assert recs[-1]["async/weight_swaps_total"] == 2.0  # two updates landed in a generation in flight


def test_partial_resume_reproduces_the_uninterrupted_run(tiny_model_dir, tmp_path, reward):
    full = tmp_path / "full"
    raw = _raw(tiny_model_dir, full, reward, algo="gspo", steps=4, save_every=2, max_staleness=2,
               async_producer="thread", partial_rollouts=True, partial_swap_step=2)  # fmt: skip
    _run(raw)
    ckpt = full / "checkpoints" / "step-00000002"
    state = json.loads((ckpt / "trainer_state.json").read_text())["data"]["async"]
    assert state["version"] == 2 and [b["step"] for b in state["queue"]] == [2, 3]
    # the queue carries each token's version: batch 3 (submitted at version 1) took version 2 at its step 2
    tv = [s["token_versions"] for s in state["queue"][1]["samples"]]
    assert any(v[:2] == [1, 1] and v[2:] and set(v[2:]) == {2} for v in tv)
    resumed = tmp_path / "resumed"
    raw2 = json.loads(json.dumps(raw))
    raw2["out"], raw2["resume"] = str(resumed), str(ckpt)
    assert _run(raw2)["resumed_from_step"] == 2
    a, b = _records(full)[2:], _records(resumed)
    assert [r["step"] for r in b] == [3, 4]
    assert [_plain(r) for r in a] == [_plain(r) for r in b]
    assert all(r["async/staleness_max"] <= 2.0 for r in _records(full))
    shutil.rmtree(resumed)


def test_the_decoupled_objective_takes_each_tokens_own_behaviour_logprob(tiny_model_dir, tmp_path, reward):
    """Step 1 of a partial-rollout run trains a batch whose sequences hold version-0 and version-1 tokens: the packed
    fields give every token its own behaviour log-prob (``rollout_logp``: the engine's, of the token's version), the
    proximal one (``old_logp``: the trainer's recompute at version 1) and ``is_w = min(pi_prox / pi_behav, cap)``
    per token."""
    import io

    from polyrl.run import config
    from polyrl.run.online import OnlineRun

    cfg = config.build(_raw(tiny_model_dir, tmp_path / "run", reward, steps=2, max_staleness=1,
                            async_producer="thread", partial_rollouts=True, partial_swap_step=2))  # fmt: skip
    run = OnlineRun(cfg, cfg.spec.hooks(cfg.algo_config), io.StringIO())
    try:
        run.step(0)
        batch = run.source.get(1)
        samples = batch.samples
        assert {tuple(s.token_versions[:2]) for s in samples} == {(0, 0)} and any(
            1 in s.token_versions for s in samples
        )
        adv, keep, _ = run.hooks.advantages(batch.rewards, [s.group for s in samples])
        packed, _ = run.prepare(1, samples, adv, keep)
        prox, _ = run.policy.logprobs(samples, cfg.algo_config.temperature)
        cap = run.is_cap()
        seen = 0
        for b in (b for mb in packed for b in mb):
            for j, beh, old, w in zip(
                b.sample_ids, *(b.per_sample(b.fields[k]) for k in ("rollout_logp", "old_logp", "is_w"))
            ):
                s = samples[j]
                torch.testing.assert_close(beh, torch.tensor(s.logprobs), atol=0, rtol=0)
                torch.testing.assert_close(old, prox[j], atol=1e-5, rtol=0)
                torch.testing.assert_close(w, torch.exp(prox[j] - beh).clamp(max=cap), atol=1e-5, rtol=1e-5)
                seen += len(s.completion_ids)
        assert seen == sum(len(samples[i].completion_ids) for i in keep) > 0
    finally:
        run.source.close()
        if run.pool is not None:
            run.pool.close()


def test_without_partial_rollouts_nothing_changes(tiny_model_dir, tmp_path, reward):
    """partial_rollouts = false (the default): no step-boundary hook, no version stamped on tokens, one version per
    sample and batch, the thread producer waiting for its batch before each sync, as before."""
    out = tmp_path / "plain"
    _run(_raw(tiny_model_dir, out, reward, steps=3, save_every=2, max_staleness=1, async_producer="thread"))
    recs = _records(out)
    assert [r["async/staleness_max"] for r in recs] == [0.0, 1.0, 1.0]
    assert all(r["async/staleness_mean"] in (0.0, 1.0) for r in recs)
    assert not any(k in r for r in recs for k in ("async/mixed_version_samples", "async/weight_swaps_total"))
    state = json.loads((out / "checkpoints" / "step-00000002" / "trainer_state.json").read_text())["data"]["async"]
    assert [b["version"] for b in state["queue"]] == [1]
    assert all(s["token_versions"] is None and s["policy_version"] == 1 for s in state["queue"][0]["samples"])


def test_tokens_older_than_k_are_never_trained_on(tiny_model):
    """An over-eager producer (batches submitted far ahead): a batch holding any token older than K versions is
    dropped whole (its groups stay whole) and generated afresh, counted; a batch whose oldest token is K versions
    old is kept."""
    from polyrl.run.async_rollout import PartialRollouts, RolloutBatch

    llm = _engine(tiny_model("qwen3").eval(), False, 1)
    made = []

    def produce(step, version):
        made.append((step, llm.policy_version))
        v = llm.policy_version
        s = Sample([1], [2, 3], [-0.5, -0.5], "stop", "x", token_versions=[v - 1 if step == 2 else v, v])
        return RolloutBatch(step, version, [s], [1.0], {}, 0.0)

    src = PartialRollouts(produce, max_staleness=1, sync=lambda: None, engine=llm, version=1)
    try:
        src.submit(2)  # its first token one version older than the engine's: version 0
        src.submit(3)
        src.drain()
        src.weights_updated(2)
        b2 = src.get(2)  # oldest token version 0 at step 2: two versions old -> dropped, made afresh at version 2
        assert (src.stale_dropped_total, src.stale_dropped_samples) == (1, 1)
        assert b2.version == 1 and b2.samples[0].token_versions == [1, 2] and b2.samples[0].policy_version == 1
        src.weights_updated(3)
        b3 = src.get(3)  # version 1 at step 3: two versions old -> dropped too
        assert b3.version == 3 and src.stale_dropped_total == 2
        assert made == [(2, 1), (3, 1), (2, 2), (3, 3)]
    finally:
        src.close()


def test_config_and_cli(tiny_model_dir, tmp_path, reward):
    from polyrl.algorithms.grpo import GRPOConfig
    from polyrl.algorithms.gspo import GSPOConfig
    from polyrl.cli.main import main
    from polyrl.errors import ConfigError

    with pytest.raises(ConfigError, match="max_staleness >= 1"):
        GRPOConfig(partial_rollouts=True)
    with pytest.raises(ConfigError, match='async_producer = "thread" or "process".*nothing in flight'):
        GSPOConfig(partial_rollouts=True, max_staleness=1)
    # the process producer takes them too (its workers' engines: tests/run/test_worker_partial.py)
    assert GRPOConfig(partial_rollouts=True, max_staleness=1, async_producer="process").partial_rollouts
    with pytest.raises(ConfigError, match="partial_swap_step"):
        GRPOConfig(partial_swap_step=-1)
    import polyrl.agents  # noqa: F401  (registers the [agent] table)

    raw = _raw(tiny_model_dir, tmp_path / "agent", "exact_match", max_staleness=1, async_producer="thread",
               partial_rollouts=True)  # fmt: skip
    raw["agent"] = {"agent": "my_agent.py:agent", "max_turns": 2, "max_episode_tokens": 128}  # proxy mode
    from polyrl.run import config

    # agent programs through the proxy take them with the thread producer (tests/run/test_async_agentic.py)
    assert config.build(raw).algo_config.partial_rollouts
    out = tmp_path / "cli"
    argv = ["train", "--algo", "ppo", "--model", str(tiny_model_dir), "--data", "builtin:arithmetic?max=9&n=32"]
    argv += ["--out", str(out), "--max-steps", "2", "--reward", reward, "--reward-workers", "0", "--n", "1"]
    argv += ["--prompts-per-step", "4", "--max-new-tokens", "4", "--micro-batch-tokens", "256"]
    argv += ["--max-staleness", "1", "--async-producer", "thread", "--partial-rollouts"]
    argv += ["--set", "ppo.partial_swap_step=1", "--set", "train.save_final_model=false"]
    argv += ["--set", "checkpoint.save_final=false"]
    assert main(argv) == 0
    cfg = json.loads((out / "run_config.json").read_text())
    assert cfg["ppo"]["partial_rollouts"] is True and cfg["ppo"]["partial_swap_step"] == 1
    recs = _records(out)
    assert recs[1]["async/mixed_version_samples"] > 0 and recs[1]["async/staleness_max"] == 1.0


@pytest.mark.gpu
@pytest.mark.parametrize("decode_steps", [1, 4])
def test_a_swap_lands_between_launches_on_the_accelerator(tiny_model, decode_steps):
    """On the GPU: overlapped launches, CUDA graphs (launch graphs with 4 steps per launch) over weights copied in
    place: every sequence splits at the same token, the earlier tokens are the plain run's, the later ones the new
    weights' (their log-probs differ from the plain run's)."""
    from polyrl.platform import device

    dev = device.torch_device()
    model = tiny_model("qwen3", tie_word_embeddings=False).to(dev).eval()
    new = _perturbed(model.cpu()).to(dev)
    model = model.to(dev)
    plain = _generate(_engine(copy.deepcopy(model), True, decode_steps), new, swap_at=None)
    llm = _engine(copy.deepcopy(model), True, decode_steps)
    swapped = _generate(llm, new, swap_at=3)
    splits = {b.token_versions.index(1) for _, b in swapped}
    assert len(splits) == 1
    old = splits.pop()
    assert 0 < old < 10 and llm.stats()["num_steps_ahead"] > 0
    for (_, a), (_, b) in zip(plain, swapped):
        assert b.token_versions == [0] * old + [1] * (10 - old)
        assert b.token_ids[:old] == a.token_ids[:old]
        torch.testing.assert_close(torch.tensor(b.logprobs[:old]), torch.tensor(a.logprobs[:old]), atol=1e-4, rtol=0)
        assert (torch.tensor(b.logprobs[old:]) - torch.tensor(a.logprobs[old:])).abs().max() > 1e-3
