"""FSDP2 data parallelism on the CPU with gloo and 2 real processes, against the one-process engine:
equal loss curves for the same global batch (fp32, 1e-5), resume across world sizes in both directions,
one HF export that transformers loads, and data-parallel greedy rollout equal to one-process rollout."""

from __future__ import annotations

import pytest
import torch
from dist_helpers import PROMPTS, global_batches, read_json, spawn, tiny_lm
from dist_worker import STEPS, new_engine, train_worker

from polyrl.train import save_checkpoint
from polyrl.train.parallel import load_any_checkpoint

TOL = 1e-5


def reference_and_ranks(work, world_size: int = 2, dev: str = "cpu") -> dict:
    """The one-process reference (3 steps, a checkpoint at 2) on ``dev``, then the N-rank run (dist_worker)."""
    model = tiny_lm(0).to(dev)
    engine = new_engine(model)
    single = []
    for step in range(STEPS):
        st = engine.step(global_batches(step))
        single.append(st)
        if step + 1 == 2:
            save_checkpoint(work / "single", 2, model, engine, data_state={"position": 4})
    spawn(train_worker, world_size, str(work))
    return {"work": work, "single": single, "model": model, "dist": read_json(work / "dist.json")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return reference_and_ranks(tmp_path_factory.mktemp("fsdp"))


def test_two_ranks_equal_one_process(runs):
    single, dist = runs["single"], runs["dist"]
    assert dist["losses"] == pytest.approx([s.loss for s in single], abs=TOL)
    assert dist["grad_norms"] == pytest.approx([s.grad_norm for s in single], abs=TOL)
    assert dist["tokens"] == [s.tokens for s in single]  # global tokens, summed over ranks
    assert single[0].grad_norm > 0.5  # the clip (0.5) was active: the sharded norm drives it
    moved = max((a - b).abs().max().item() for a, b in zip(runs["model"].parameters(), tiny_lm(0).parameters()))
    assert moved > 1e-3  # the steps really updated the weights


def test_one_process_checkpoint_resumes_on_two_ranks(runs):
    dist = runs["dist"]
    assert dist["resumed_step"] == 2 and dist["resumed_global_step"] == 3
    assert dist["resumed_loss"] == pytest.approx(runs["single"][2].loss, abs=TOL)


def test_two_rank_checkpoint_resumes_in_one_process(runs):
    ckpt = runs["work"] / "ckpt" / "step-00000002"
    assert (ckpt / "manifest.json").is_file() and (ckpt / "sharded" / ".metadata").is_file()
    model = tiny_lm(5)  # different init: everything must come from the checkpoint
    engine = new_engine(model)
    loaded = load_any_checkpoint(ckpt, model, engine)
    assert loaded.step == 2 and loaded.data_state == {"position": 2} and loaded.manifest["world_size"] == 2
    assert engine.global_step == 2
    stats = engine.step(global_batches(2))
    assert stats.loss == pytest.approx(runs["single"][2].loss, abs=TOL)
    for (name, a), b in zip(model.state_dict().items(), runs["model"].state_dict().values()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)


def test_exported_hf_folder_loads_in_transformers(runs):
    from transformers import AutoModelForCausalLM

    folder = runs["work"] / "hf"
    assert sorted(p.name for p in folder.glob("*.safetensors"))
    hf = AutoModelForCausalLM.from_pretrained(str(folder), torch_dtype=torch.float32).eval()
    ids = torch.tensor([PROMPTS[2] + PROMPTS[4]])
    with torch.no_grad():
        got = hf(ids).logits[0]
        ours = runs["model"]
        from polyrl.models import AttnMetadata

        n = ids.shape[1]
        hidden = ours(ids[0], torch.arange(n), AttnMetadata.from_seqlens([n], torch.device("cpu")))
        want = ours.compute_logits(hidden)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_data_parallel_rollout_equals_one_process(runs):
    from polyrl.infer import LLM, RolloutConfig, SamplingParams

    cfg = RolloutConfig(block_size=4, num_blocks=128, max_num_seqs=4, max_num_batched_tokens=32)
    outs = LLM(runs["model"], None, cfg).generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    )
    assert runs["dist"]["rollout"] == [o.outputs[0].token_ids for o in outs]
    for got, want in zip(runs["dist"]["rollout_logprobs"], [o.outputs[0].logprobs for o in outs]):
        assert got == pytest.approx(want, abs=1e-4)
    # rank 0 alone generating every prompt (async RL's rollout workers under torchrun), broadcast: every rank holds
    # the same outputs; a failure on rank 0 is broadcast instead, so rank 1 raises too rather than waiting
    (tokens0, failed0), (tokens1, failed1) = runs["dist"]["on_root"]
    assert tokens0 == tokens1 == runs["dist"]["rollout"]
    assert failed0 == "ValueError: no engine"
    assert failed1 == "RuntimeError: rank 0's rollout failed: ValueError: no engine"
    # ColocatedPolicy.rollout with remote_on_root: rank 1 takes rank 0's outputs and holds no KV cache for its own
    # engine, which never generates there (kept with release_kv=False on rank 0, the fallback of a dead worker)
    (held0, after0, got0), (held1, after1, got1) = runs["dist"]["idle_kv"]
    assert got0 == got1 == runs["dist"]["rollout"]
    assert held0 and held1 and after0
    assert not after1


@pytest.mark.gpu
@pytest.mark.multi_gpu
def test_two_gpus_nccl_match_one_gpu(tmp_path):
    """The same checks over NCCL on 2 accelerators (fp32 through FSDP2; kernels differ from the CPU's)."""
    from polyrl.platform import device

    if device.count() < 2:
        pytest.fail("needs 2 accelerators; run on a multi-GPU machine (tests/distributed/run_multi_gpu.sh)")
    r = reference_and_ranks(tmp_path, 2, str(device.torch_device(0)))
    assert r["dist"]["losses"] == pytest.approx([s.loss for s in r["single"]], abs=1e-4)
    assert r["dist"]["resumed_loss"] == pytest.approx(r["single"][2].loss, abs=1e-4)
