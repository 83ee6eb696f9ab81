"""Trainer -> rollout weight sync (``polyrl.run.weight_sync``): the bucket plan; the bucketed broadcast over a real
gloo process group of 3 processes (one sender, two receivers) gives the source exactly (fp32 wire) or the source
cast to bf16 (bf16 wire) across bucket boundaries and for a tensor larger than a bucket; LoRA-only syncs move the
adapter tensors alone (bytes counted); the in-process copy writes into the copy's own tensors; plans that differ
are refused; a progress deadline lets a slow sync finish and stops one whose peers hang (``SyncTimeout``), and is
refused off gloo; the bench's rows."""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from polyrl.errors import ConfigError
from polyrl.run.weight_sync import (
    BucketedBroadcast,
    InProcessSync,
    SyncStats,
    SyncTimeout,
    plan_buckets,
    sync_tensors,
)


class Toy(nn.Module):
    """Parameters of awkward sizes (bytes in fp32: 28, 1200, 4, 40000, 396) and a buffer."""

    def __init__(self, dtype: torch.dtype = torch.float32, big: int = 10000) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(7, dtype=dtype))
        self.b = nn.Parameter(torch.randn(20, 15, dtype=dtype))
        self.c = nn.Parameter(torch.randn(1, dtype=dtype))
        self.big = nn.Parameter(torch.randn(big, dtype=dtype))  # larger than the 0.01 MiB bucket: sent alone
        self.d = nn.Parameter(torch.randn(3, 33, dtype=dtype))
        self.register_buffer("steps", torch.arange(5, dtype=torch.int64))


BUCKET_MB = 0.01  # 10485 bytes: a, b, c share a bucket; big is alone; d and the buffer follow


def _group(port: int, rank: int, size: int):
    """Rank ``rank``'s gloo group, its store a client of the server the test process holds on ``port``."""
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=datetime.timedelta(seconds=60))
    return store, dist.ProcessGroupGloo(store, rank, size, datetime.timedelta(seconds=60))


def _scenario(pg, rank: int, model: nn.Module, wire: str, **kw) -> dict:
    before = [t.data_ptr() for t in model.parameters()]
    sync = BucketedBroadcast(model, pg, src=0, rank=rank, dtype=wire, bucket_mb=kw.pop("bucket_mb", BUCKET_MB), **kw)
    stats = [sync.sync(), sync.sync()]  # twice: the reused bucket buffers and the checked plan
    return {
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "bytes": [s.bytes for s in stats],
        "tensors": stats[0].tensors,
        "n": len(sync.buckets),
        "in_place": [t.data_ptr() for t in model.parameters()] == before,
    }


def _session(rank: int, port: int, size: int, out: str) -> None:
    """Every broadcast scenario in one 3-process gloo group (rank 0 sends), results saved per rank."""
    torch.set_num_threads(1)
    store, pg = _group(port, rank, size)
    res = {}
    torch.manual_seed(100 + rank)  # every rank starts from different values
    res["fp32"] = _scenario(pg, rank, Toy(), "fp32")
    res["bf16"] = _scenario(pg, rank, Toy(torch.float32 if rank == 0 else torch.bfloat16), "bf16")
    res["bf16_into_fp32"] = _scenario(pg, rank, Toy(), "bf16")
    lora = _tiny_lora(seed=rank)  # different base and adapters on each rank
    base = {n: t.clone() for n, t, _ in sync_tensors(lora) if "lora_" not in n}
    res["lora"] = _scenario(pg, rank, lora, "fp32", lora_only=True, bucket_mb=256)
    after = {n: t for n, t, _ in sync_tensors(lora)}
    res["lora"]["base_unchanged"] = all(torch.equal(base[n], after[n]) for n in base)
    try:  # rank 2 holds a model of another shape: every rank refuses before any tensor moves
        BucketedBroadcast(Toy(big=10000 + (rank == 2)), pg, 0, rank, dtype="fp32", bucket_mb=BUCKET_MB).sync()
        res["mismatch"] = ""
    except RuntimeError as exc:
        res["mismatch"] = str(exc)
    res["deadline"] = _deadline_scenario(store, pg, rank)
    torch.save(res, out)
    if rank > 0:  # stay connected until rank 0's lone sync timed out (a closed connection fails it another way)
        store.wait(["timed_out"])


class _Slow(BucketedBroadcast):
    """The sender pauses ``pause`` seconds before each bucket's broadcast: a sync that is slow but progresses."""

    pause = 0.0

    def _broadcast(self, t):
        if self.sending:
            time.sleep(self.pause)
        return super()._broadcast(t)


SLOW_S, DEADLINE_S = 0.3, 1.0


def _deadline_scenario(store, pg, rank: int) -> dict:
    """Every rank syncs with a 1 s progress deadline while the sender takes 0.3 s per bucket (4 buckets: the sync
    takes longer than the deadline, each wait does not): it completes. Then rank 0 syncs alone (ranks 1 and 2 never
    post their receives, as hung processes): ``SyncTimeout`` at the first bucket after about the deadline."""
    torch.manual_seed(200 + rank)
    model = Toy()
    sync = _Slow(model, pg, 0, rank, dtype="fp32", bucket_mb=BUCKET_MB, deadline_s=DEADLINE_S)
    sync.pause = SLOW_S
    out = {"slow": sync.sync().seconds, "state": {k: v.clone() for k, v in model.state_dict().items()}}
    if rank == 0:
        sync.pause = 0.0
        t0 = time.monotonic()
        try:
            sync.sync()
            out["lone"] = "no error"
        except SyncTimeout as exc:
            out["lone"] = f"{type(exc).__name__}: {exc} | {exc.what}"
        out["lone_s"] = time.monotonic() - t0
        out["abandoned"] = len(sync.abandoned)
        store.set("timed_out", "1")
    return out


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    tmp, size = tmp_path_factory.mktemp("wsync"), 3
    # the store's server here, on a port it binds itself: a port probed free and bound later by a rank may be taken
    # by another process in between
    server = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)
    outs = [str(tmp / f"rank{r}.pt") for r in range(size)]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_session, args=(r, server.port, size, outs[r])) for r in range(size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * size
    return [torch.load(o) for o in outs]


def test_plan_buckets_splits_at_the_bucket_size_and_sends_oversize_alone():
    f32, bf = torch.float32, torch.bfloat16
    shapes = [(torch.Size([7]), f32), (torch.Size([20, 15]), f32), (torch.Size([1]), f32)]
    shapes += [(torch.Size([10000]), f32), (torch.Size([3, 33]), f32), (torch.Size([5]), torch.int64)]
    plan = plan_buckets(shapes, 10485)
    assert [b.items for b in plan] == [(0, 1, 2), (3,), (4,), (5,)]
    assert [b.offsets for b in plan] == [(0, 7, 307), (0,), (0,), (0,)]
    assert [b.nbytes for b in plan] == [308 * 4, 40000, 99 * 4, 40]
    # a bucket fills exactly to the limit, the next tensor opens a new one
    plan = plan_buckets([(torch.Size([4]), bf)] * 5, 16)
    assert [b.items for b in plan] == [(0, 1), (2, 3), (4,)] and all(b.dtype == bf for b in plan)


def test_broadcast_fp32_equals_the_source_exactly(session):
    got = [r["fp32"] for r in session]
    src = got[0]["state"]
    assert got[0]["n"] == 4  # [a, b, c], [big] (oversize), [d], [steps] (int64)
    for r in (1, 2):
        assert got[r]["in_place"]
        for k, v in src.items():
            assert torch.equal(got[r]["state"][k], v), k
        assert got[r]["bytes"] == got[0]["bytes"] == [(7 + 300 + 1 + 10000 + 99) * 4 + 5 * 8] * 2


def test_broadcast_bf16_equals_the_source_cast_to_bf16(session):
    # bf16 receivers: their tensors hold exactly source.to(bf16); the wire carries half the bytes
    got = [r["bf16"] for r in session]
    src = got[0]["state"]
    for r in (1, 2):
        assert got[r]["in_place"]
        for k, v in src.items():
            want = v.to(torch.bfloat16) if v.is_floating_point() else v
            assert got[r]["state"][k].dtype == want.dtype and torch.equal(got[r]["state"][k], want), k
        assert got[r]["bytes"][0] == (7 + 300 + 1 + 10000 + 99) * 2 + 5 * 8
    assert not torch.equal(src["big"].to(torch.bfloat16).float(), src["big"])  # the cast is a real rounding


def test_broadcast_bf16_wire_into_fp32_receivers(session):
    # fp32 receivers, bf16 wire: the source rounded to bf16 and widened back; big (fp32, not the wire dtype) goes
    # through a buffer of its own on both sides
    got = [r["bf16_into_fp32"] for r in session]
    for k, v in got[0]["state"].items():
        want = v.to(torch.bfloat16).float() if v.is_floating_point() else v
        assert torch.equal(got[1]["state"][k], want) and torch.equal(got[2]["state"][k], want), k


def test_the_deadline_spares_a_slow_sync_and_stops_one_whose_peers_hang(session):
    got = [r["deadline"] for r in session]
    # 4 buckets at 0.3 s each: longer than the 1 s deadline in all, yet every wait ended in time and the values came
    for r in (1, 2):
        assert got[r]["slow"] >= 4 * SLOW_S > DEADLINE_S
        for k, v in got[0]["state"].items():
            assert torch.equal(got[r]["state"][k], v), k
    assert got[0]["lone"] == (
        "SyncTimeout: weight sync: bucket 1 of 4 (1232 bytes) did not complete within deadline_s = 1 s (the peer "
        "hangs) | bucket 1 of 4 (1232 bytes)"
    )
    # at the deadline, not before; the upper bound only tells it from the group's 60 s timeout
    assert DEADLINE_S - 0.05 <= got[0]["lone_s"] < DEADLINE_S + 20 and got[0]["abandoned"] == 1


def test_a_deadline_needs_a_gloo_group_and_seconds():
    class NotGloo:  # what an NCCL group is to the check: not gloo
        def name(self):
            return "nccl"

    with pytest.raises(ConfigError, match="deadline_s needs a gloo group"):
        BucketedBroadcast(Toy(), NotGloo(), 0, 0, deadline_s=5.0)
    assert BucketedBroadcast(Toy(), NotGloo(), 0, 0).deadline_s is None  # no deadline: any group, as before
    gloo = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=5))
    for bad in (0, -1.0, True, "5"):
        with pytest.raises(ConfigError, match="deadline_s must be a number of seconds > 0"):
            BucketedBroadcast(Toy(), gloo, 0, 0, deadline_s=bad)
    sync = BucketedBroadcast(Toy(), gloo, 0, 0, deadline_s=5.0)
    sync.deadline_s = -1  # set later (as rollout_workers does per push): checked when the sync starts
    with pytest.raises(ConfigError, match="deadline_s must be"):
        sync.sync()


def test_different_models_are_refused_before_any_tensor_moves(session):
    assert all("tensors differ" in r["mismatch"] for r in session)


def _tiny_lora(seed: int):
    from polyrl.models.config import ModelConfig
    from polyrl.models.decoder import build_model
    from polyrl.models.lora import LoraConfig, apply_lora

    hf = dict(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True)  # fmt: skip
    model = build_model(ModelConfig.from_hf_dict(hf), seed=seed)
    apply_lora(model, LoraConfig(r=4, alpha=8, targets=["q_proj", "v_proj"]), seed=seed)
    with torch.no_grad():
        for _, t, _ in sync_tensors(model, lora_only=True):
            t.normal_()  # lora_B starts at zero: make both adapter matrices non-trivial
    return model


def test_lora_only_sync_moves_the_adapters_alone(session):
    model = _tiny_lora(seed=0)
    adapters = sync_tensors(model, lora_only=True)
    names = [n for n, _, _ in adapters]
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    adapter_bytes = sum(t.numel() * t.element_size() for _, t, _ in adapters)
    full_bytes = sum(t.numel() * t.element_size() for _, t, _ in sync_tensors(model))
    assert adapter_bytes < full_bytes / 5
    # in process
    copy = _tiny_lora(seed=1)
    st = InProcessSync(model, copy, lora_only=True).sync()
    assert (st.bytes, st.tensors) == (adapter_bytes, len(adapters))
    for (n, a, _), (_, b, _) in zip(adapters, sync_tensors(copy, lora_only=True)):
        assert torch.equal(a, b), n
    assert not torch.equal(model.model.layers[0].mlp.up_proj.weight, copy.model.layers[0].mlp.up_proj.weight)
    # over gloo: the receivers' bases stay their own, their adapters become the sender's, the bytes are the adapters'
    send = session[0]["lora"]
    assert send["bytes"] == [adapter_bytes] * 2 and send["tensors"] == len(adapters)
    for recv in (session[1]["lora"], session[2]["lora"]):
        assert recv["base_unchanged"] and recv["bytes"] == send["bytes"]
        for n, _, _ in adapters:
            assert torch.equal(recv["state"][n], send["state"][n]), n
        emb = "model.embed_tokens.weight"  # the frozen base differs (different seeds): untouched by the sync
        assert not torch.equal(recv["state"][emb], send["state"][emb])


def test_lora_only_without_adapters_is_refused():
    from polyrl.errors import ConfigError

    with pytest.raises(ConfigError, match="LoRA adapters"):
        sync_tensors(Toy(), lora_only=True)


def test_in_process_sync_copies_into_the_rollout_copy_in_place():
    torch.manual_seed(0)
    src, dst = Toy(), Toy(torch.bfloat16)
    ptrs = [t.data_ptr() for t in dst.parameters()]
    st = InProcessSync(src, dst).sync()
    assert [t.data_ptr() for t in dst.parameters()] == ptrs
    for (n, a), b in zip(src.state_dict().items(), dst.state_dict().values()):
        assert torch.equal(b, a.to(b.dtype)), n
    assert st.bytes == (7 + 300 + 1 + 10000 + 99) * 2 + 5 * 8 and st.tensors == 6
    assert SyncStats(0.5, 10**9).metrics() == {
        "weight_sync/seconds": 0.5,
        "weight_sync/bytes": 1e9,
        "weight_sync/gbps": 2.0,
    }
    with pytest.raises(ValueError, match="big"):
        InProcessSync(Toy(big=3), Toy())


def test_bench_rows_over_gloo_and_the_skipped_nccl_row(tmp_path, capsys):
    import json

    from polyrl.cli.main import main

    out = tmp_path / "ws.json"
    argv = ["bench", "weight-sync", "--shape", "tiny", "--dtype", "bf16", "--bucket-mb", "0.25", "--reps", "1"]
    assert main([*argv, "--backend", "gloo", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["mode"] for r in rows] == ["in-process cpu", "broadcast gloo cpu->cpu"]
    assert rows[1]["receiver_equal"] is True and rows[1]["buckets"] > 1  # 0.25 MiB: several buckets
    assert rows[0]["gb"] == rows[1]["gb"] > 0 and all(r["seconds"] > 0 for r in rows)
    if torch.cuda.device_count() < 2:  # on a machine without 2 GPUs the NCCL row says why it is not there
        assert main(argv) == 0
        assert "skipped: NCCL broadcast needs 2+ CUDA devices" in capsys.readouterr().out


@pytest.mark.gpu
def test_in_process_sync_on_the_gpu_is_exact():
    torch.manual_seed(0)
    src, dst = Toy().cuda(), Toy(torch.bfloat16).cuda()
    st = InProcessSync(src, dst).sync()
    for (n, a), b in zip(src.state_dict().items(), dst.state_dict().values()):
        assert torch.equal(b, a.to(b.dtype)), n
    assert st.seconds > 0


@pytest.mark.multi_gpu
def test_nccl_broadcast_cuda0_to_cuda1_is_exact():
    import argparse

    from polyrl.bench.weight_sync import _broadcast

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    args = argparse.Namespace(dtype="bf16", bucket_mb=0.25, warmup=1, reps=2)
    row = _broadcast("tiny", args, "nccl")
    assert row["status"] == "ok" and row["receiver_equal"] is True and row["buckets"] > 1
