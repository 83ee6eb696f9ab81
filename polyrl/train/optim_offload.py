"""The "offload" updater of ``MasterAdamW`` (``optim.offload = "cpu"``): masters and moments in host memory.

The device keeps only the compute weights and their gradients (``param.grad``, the compute dtype, accumulated by
autograd over micro-batches). The host keeps a copy of every trainable weight (fp32 with ``master_dtype = "fp32"``,
else the compute dtype) and the moments of ``optim.name`` (torch AdamW's fp32 moments, or the 8-bit ones of
``kernels.adamw8bit``, updated by its CPU implementation). One step:

    for each bucket of BUCKET_ELEMS gradient elements (whole 256-blocks of the parameters, large tensors split):
        device grad -> pinned staging (non_blocking; the next bucket's copy is queued before this one is used)
        staging -> fp32, times the pending clip factor, update of the host weights and moments on the CPU
        host weights -> pinned staging in the compute dtype -> device weights (non_blocking, in place)

With ``optim.name = "adamw8bit"`` on an accelerator the host only stores (pinned: masters and 8-bit states, ~6
bytes per parameter): each bucket's host weights and states are copied to a device staging buffer, updated there by
the fused kernel (which also writes the compute weights) and copied back, all on the current stream. That moves 12
bytes per parameter over the bus instead of running several CPU passes, and gives the on-device optimizer's bits.

Two staging buffers per direction alternate, so the copies of one bucket overlap the CPU update of another; the
host waits on a device event before it reads a staging buffer or writes one the device still reads. Only the
staging buffers are pinned (the copies read and write nothing else); pinning the ~12 bytes per parameter of
masters and moments would lock most of the host's memory for nothing. On a CPU "device" the same code runs with
plain copies, so its behaviour is testable there.

The host runs torch's fused CPU AdamW by default (``optim.impl = auto``; one pass over its memory) or the CPU
implementation of the 8-bit update (the reference: correct, but several passes and a binary search per element,
so slower). With one micro-batch per step the update equals the on-device optimizer's for the same ``optim.name``
(bit for bit with the same implementation on both, e.g. ``optim.impl = foreach`` on a CPU device); with k
micro-batches the gradient sum is rounded to the compute dtype k - 1 times, as in pure-bf16 training. Not here:
overlapping the update with the next step's forward (a delayed update changes the numerics), FSDP2 shards
(``MasterAdamW`` refuses them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from polyrl.errors import UserError
from polyrl.kernels.adamw8bit import BLOCK, StepScalars, adamw8bit_step, init_state
from polyrl.platform import device
from polyrl.train.optim_8bit import STATE_KEYS, check_8bit
from polyrl.train.optim_torch import make_torch_adamw

BUCKET_ELEMS = 32 * 1024 * 1024  # 64 MiB of bf16 gradient per bucket; a multiple of BLOCK
STREAM_ON_CPU = False  # tests: run the streamed 8-bit path (made for accelerators) with a CPU "device"


@dataclass(frozen=True)
class Chunk:
    """Elements ``[start, end)`` of parameter ``i`` (flat), at ``off`` in its bucket's staging buffers."""

    i: int
    start: int
    end: int
    off: int


def plan_buckets(sizes: list[int], bucket: int) -> list[list[Chunk]]:
    """Split the flat parameters of ``sizes`` into buckets of at most ``bucket`` elements; a parameter is cut only at
    multiples of ``BLOCK`` (the 8-bit blocks stay whole) and parameters follow each other in order."""
    if bucket % BLOCK:
        raise ValueError(f"offload bucket size {bucket} must be a multiple of {BLOCK}")
    buckets: list[list[Chunk]] = [[]]
    used = 0
    for i, n in enumerate(sizes):
        start = 0  # always 0 or a multiple of BLOCK: only a piece that ends a parameter is not
        while start < n:
            rest, room = n - start, bucket - used
            take = rest if rest <= room else room // BLOCK * BLOCK
            if take == 0:
                buckets.append([])
                used = 0
                continue
            buckets[-1].append(Chunk(i, start, start + take, used))
            used += take
            start += take
    return [b for b in buckets if b]


class HostOffload:
    def __init__(self, opt: Any, bucket: int | None = None) -> None:
        self.opt = opt
        bucket = bucket or BUCKET_ELEMS
        cfg = opt.cfg
        if any(not p.is_contiguous() for p in opt.params):
            raise UserError("optim.offload = cpu needs contiguous parameters (a strided view was given)")
        self.host: list[torch.Tensor] = opt.take_host_copies()
        self.eight_bit = cfg.name == "adamw8bit"
        self.decays = opt.decays()
        self.grad_scale = 1.0  # the clip / unscale factor still to apply (on the host, in fp32)
        sizes = [p.numel() for p in opt.params]
        self.buckets = plan_buckets(sizes, bucket)
        width = max(sum(c.end - c.start for c in b) for b in self.buckets)
        dev = opt.params[0].device
        pin = dev.type != "cpu"
        cdtype = opt.params[0].dtype
        self.grad_stage = [torch.empty(width, dtype=cdtype, pin_memory=pin) for _ in range(2)]
        self.out_stage = [torch.empty(width, dtype=cdtype, pin_memory=pin) for _ in range(2)]
        self.g32 = torch.empty(width, dtype=torch.float32)
        self._out_ready: list = [None, None]  # device events: the H2D copy out of out_stage[k] finished
        # 8-bit on an accelerator: the host only stores (pinned); each bucket streams through the device kernel
        self.streamed = self.eight_bit and (dev.type != "cpu" or STREAM_ON_CPU)
        if self.eight_bit:
            self.states = [init_state(n, "cpu") for n in sizes]
            self.steps = [0] * len(sizes)
        if self.streamed:
            self._init_streaming(width, dev)
        elif not self.eight_bit:
            self.moments = [(torch.zeros_like(h), torch.zeros_like(h)) for h in self.host]
            self.views: dict[Chunk, torch.Tensor] = {}  # the host weights' chunk views torch's AdamW steps
            self.inners = [self._bucket_adamw(b) for b in self.buckets]

    def _init_streaming(self, width: int, dev: torch.device) -> None:
        if dev.type != "cpu":  # the copies below are asynchronous only from and to pinned memory
            self.host = [h.pin_memory() for h in self.host]
            self.states = [{k: t.pin_memory() for k, t in st.items()} for st in self.states]
        blocks = max(sum(-(-(c.end - c.start) // BLOCK) for c in b) for b in self.buckets)
        hdt = self.host[0].dtype
        self.dev_stage = [
            {
                "w": torch.empty(width, dtype=hdt, device=dev),
                "g": torch.empty(width, dtype=torch.float32, device=dev),
                "qm": torch.empty(width, dtype=torch.uint8, device=dev),
                "qs": torch.empty(width, dtype=torch.uint8, device=dev),
                "am": torch.empty(blocks, dtype=torch.float32, device=dev),
                "as": torch.empty(blocks, dtype=torch.float32, device=dev),
            }
            for _ in range(2)
        ]

    # ---- torch AdamW over the chunk views of one bucket ---------------------------------------
    def _view(self, t: torch.Tensor, c: Chunk) -> torch.Tensor:
        return t.view(-1)[c.start : c.end]

    def _bucket_adamw(self, chunks: list[Chunk]) -> torch.optim.AdamW:
        views = {c: self._view(self.host[c.i], c) for c in chunks}
        self.views.update(views)
        groups = [
            {"params": [views[c] for c in chunks if self.decays[c.i] > 0], "weight_decay": self.opt.cfg.weight_decay},
            {"params": [views[c] for c in chunks if self.decays[c.i] == 0], "weight_decay": 0.0},
        ]
        inner = make_torch_adamw([g for g in groups if g["params"]], self.opt.cfg, "cpu", cpu_auto="fused")
        for c, v in views.items():  # the moments are views of whole per-parameter tensors (one state_dict entry each)
            m, s = self.moments[c.i]
            inner.state[v] = {"step": torch.tensor(0.0), "exp_avg": self._view(m, c), "exp_avg_sq": self._view(s, c)}
        return inner

    # ---- the step -----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, lr: float) -> None:
        params = self.opt.params
        active = [p.grad is not None for p in params]
        if self.eight_bit:
            self.steps = [s + int(a) for s, a in zip(self.steps, active)]
        work = [(k, [c for c in b if active[c.i]]) for k, b in enumerate(self.buckets)]
        work = [(k, b) for k, b in work if b]
        if self.streamed:
            for j, (_, chunks) in enumerate(work):
                self._stream_bucket(chunks, self.dev_stage[j % 2], lr)
            self.grad_scale = 1.0
            return
        ready = [self._to_host(work[j][1], j % 2) for j in range(min(2, len(work)))]
        for j, (k, chunks) in enumerate(work):
            slot = j % 2
            if ready[slot] is not None:
                ready[slot].synchronize()
            n = chunks[-1].end - chunks[-1].start + chunks[-1].off
            g32 = self.g32[:n]
            g32.copy_(self.grad_stage[slot][:n])
            if j + 2 < len(work):
                ready[slot] = self._to_host(work[j + 2][1], slot)  # this staging buffer is free again
            if self.grad_scale != 1.0:
                g32.mul_(self.grad_scale)
            self._update(k, chunks, g32, lr)
            self._to_device(chunks, slot)
        self.grad_scale = 1.0

    def _stream_bucket(self, chunks: list[Chunk], stage: dict[str, torch.Tensor], lr: float) -> None:
        """Host weights + 8-bit states of ``chunks`` -> device staging, the fused kernel (which also writes the compute
        weights), and back; all on the current stream, whose order keeps the two alternating stagings safe."""
        cfg = self.opt.cfg
        b1, b2 = cfg.betas
        boff = 0
        for c in chunks:
            n, nb = c.end - c.start, -(-(c.end - c.start) // BLOCK)
            p = self.opt.params[c.i]
            host_st = {key: self._state_view(t, key, c) for key, t in self.states[c.i].items()}
            dev_st = {key: stage[key][c.off : c.off + n] for key in ("qm", "qs")}
            dev_st.update({key: stage[key][boff : boff + nb] for key in ("am", "as")})
            for key, t in dev_st.items():
                t.copy_(host_st[key], non_blocking=True)
            g = stage["g"][c.off : c.off + n]
            g.copy_(p.grad.reshape(-1)[c.start : c.end])
            if self.grad_scale != 1.0:
                g.mul_(self.grad_scale)
            sc = StepScalars.at(self.steps[c.i], lr, b1, b2, cfg.eps, self.decays[c.i])
            pv = self._view(p.data, c)
            if self._separate(c.i):
                w = stage["w"][c.off : c.off + n]
                w.copy_(self._view(self.host[c.i], c), non_blocking=True)
                adamw8bit_step(w, g, dev_st, sc, pv)
                self._view(self.host[c.i], c).copy_(w, non_blocking=True)
            else:  # the compute weights are the masters: update them in place, keep the host copy in step
                adamw8bit_step(pv, g, dev_st, sc)
                self._view(self.host[c.i], c).copy_(pv, non_blocking=True)
            for key, t in dev_st.items():
                host_st[key].copy_(t, non_blocking=True)
            boff += nb

    def _to_host(self, chunks: list[Chunk], slot: int):
        stage = self.grad_stage[slot]
        for c in chunks:
            g = self.opt.params[c.i].grad.reshape(-1)[c.start : c.end]
            stage[c.off : c.off + c.end - c.start].copy_(g, non_blocking=True)
        return _record()

    def _to_device(self, chunks: list[Chunk], slot: int) -> None:
        if self._out_ready[slot] is not None:
            self._out_ready[slot].synchronize()  # the device has read this buffer's previous bucket
        stage = self.out_stage[slot]
        for c in chunks:
            stage[c.off : c.off + c.end - c.start].copy_(self._view(self.host[c.i], c))
        for c in chunks:
            self._view(self.opt.params[c.i].data, c).copy_(stage[c.off : c.off + c.end - c.start], non_blocking=True)
        self._out_ready[slot] = _record()

    def _update(self, k: int, chunks: list[Chunk], g32: torch.Tensor, lr: float) -> None:
        cfg = self.opt.cfg
        if self.eight_bit:
            b1, b2 = cfg.betas
            for c in chunks:
                sc = StepScalars.at(self.steps[c.i], lr, b1, b2, cfg.eps, self.decays[c.i])
                st = {key: self._state_view(t, key, c) for key, t in self.states[c.i].items()}
                adamw8bit_step(self._view(self.host[c.i], c), g32[c.off : c.off + c.end - c.start], st, sc)
            return
        inner = self.inners[k]
        for group in inner.param_groups:
            group["lr"] = lr
        for c in chunks:
            v = self.views[c]
            v.grad = g32[c.off : c.off + c.end - c.start].to(v.dtype)
        inner.step()
        for group in inner.param_groups:
            for v in group["params"]:
                v.grad = None

    @staticmethod
    def _state_view(t: torch.Tensor, key: str, c: Chunk) -> torch.Tensor:
        if key in ("am", "as"):  # one absmax per BLOCK; chunks start on a block
            return t[c.start // BLOCK : -(-c.end // BLOCK)]
        return t[c.start : c.end]

    # ---- state --------------------------------------------------------------------------------
    def _separate(self, i: int) -> bool:
        return self.host[i].dtype != self.opt.params[i].dtype

    def state_dict(self) -> dict[str, torch.Tensor]:
        if self.streamed:
            device.synchronize()  # the last step's copies back to the host have landed
        out: dict[str, torch.Tensor] = {}
        for i, name in enumerate(self.opt.names):
            if self._separate(i):
                out[f"master/{name}"] = self.host[i]
            step = self._step_of(i)
            if not step:
                continue
            out[f"step/{name}"] = torch.tensor(float(step), dtype=torch.float32)
            if self.eight_bit:
                for prefix, key in STATE_KEYS.items():
                    out[f"{prefix}/{name}"] = self.states[i][key]
            else:
                out[f"exp_avg/{name}"], out[f"exp_avg_sq/{name}"] = self.moments[i]
        return out

    def _step_of(self, i: int) -> int:
        if self.eight_bit:
            return self.steps[i]
        k, c = next((k, c) for k, b in enumerate(self.buckets) for c in b if c.i == i)
        return int(self.inners[k].state[self.views[c]]["step"].item())

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        opt = self.opt
        if self.streamed:
            device.synchronize()
        missing = [n for i, n in enumerate(opt.names) if self._separate(i) and f"master/{n}" not in state]
        if missing:
            raise KeyError(f"optimizer state lacks master weights for: {', '.join(missing[:5])}")
        if self.eight_bit:
            check_8bit(state, opt.names)
        elif any(f"exp_avg_q/{n}" in state for n in opt.names):
            raise KeyError("the checkpoint holds 8-bit moments (optim.name = adamw8bit), this run uses adamw")
        for i, (name, p) in enumerate(zip(opt.names, opt.params)):
            src = state[f"master/{name}"] if self._separate(i) else p.detach()
            self.host[i].copy_(src.reshape(self.host[i].shape))
            step = int(state[f"step/{name}"].item()) if f"step/{name}" in state else 0
            if self.eight_bit:
                fresh = init_state(p.numel(), "cpu")
                for prefix, key in STATE_KEYS.items():
                    self.states[i][key].copy_(state[f"{prefix}/{name}"].reshape(-1) if step else fresh[key])
                self.steps[i] = step
            else:
                m, s = self.moments[i]
                m.copy_(state[f"exp_avg/{name}"].reshape(m.shape)) if step else m.zero_()
                s.copy_(state[f"exp_avg_sq/{name}"].reshape(s.shape)) if step else s.zero_()
                for k, b in enumerate(self.buckets):
                    for c in b:
                        if c.i == i:
                            self.inners[k].state[self.views[c]]["step"].fill_(float(step))
            if self._separate(i):
                p.data.copy_(self.host[i].to(p.dtype).to(p.device))


def _record():
    """A device event recorded on the current stream (None on the CPU: its copies are already done)."""
    ev = device.event(enable_timing=False)
    if ev is not None:
        ev.record()
    return ev
