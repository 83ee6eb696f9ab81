"""The "adamw8bit" updater of ``MasterAdamW``: AdamW with both moments blockwise 8-bit, on the masters' device.

Per trainable parameter it keeps the four tensors of ``kernels.adamw8bit.init_state`` (``qm``/``qs`` uint8 of the
parameter's size, ``am``/``as`` fp32 block absmaxes: ~2.03 bytes per element instead of 8) and a step count, and
calls the fused ``kernels.adamw8bit_step`` once per parameter (Triton on CUDA, the reference elsewhere). With fp32
masters the kernel also writes the new bf16/fp16 compute weights in the same pass, so no separate master -> weight
copy runs. With ``master_dtype = "none"`` the compute weights are updated directly.

Checkpoint keys, by parameter name: ``master/<name>`` (separate masters), ``exp_avg_q/<name>`` (uint8),
``exp_avg_absmax/<name>``, ``exp_avg_sqrt_q/<name>`` (uint8: the code of sqrt(v)), ``exp_avg_sqrt_absmax/<name>``,
``step/<name>``; loading copies them into place, so a resumed run continues bit for bit. Not here: FSDP2 shards
(``MasterAdamW`` refuses them), fp32 moments for small tensors.
"""

from __future__ import annotations

from typing import Any

import torch

from polyrl.kernels.adamw8bit import StepScalars, adamw8bit_step, init_state

# checkpoint key prefix -> key of the kernel's state dict
STATE_KEYS = {"exp_avg_q": "qm", "exp_avg_absmax": "am", "exp_avg_sqrt_q": "qs", "exp_avg_sqrt_absmax": "as"}


class AdamW8bit:
    def __init__(self, opt: Any) -> None:
        self.opt = opt
        self.states = [init_state(m.numel(), m.device) for m in opt.masters]
        self.steps = [0] * len(opt.masters)
        self.decays = opt.decays()

    @torch.no_grad()
    def step(self, lr: float) -> None:
        cfg = self.opt.cfg
        b1, b2 = cfg.betas
        for i, (p, m) in enumerate(zip(self.opt.params, self.opt.masters)):
            if m.grad is None:
                continue
            self.steps[i] += 1
            sc = StepScalars.at(self.steps[i], lr, b1, b2, cfg.eps, self.decays[i])
            adamw8bit_step(m, m.grad.contiguous(), self.states[i], sc, p if p is not m else None)

    def state_dict(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        opt = self.opt
        for i, (name, p, m) in enumerate(zip(opt.names, opt.params, opt.masters)):
            if m is not p:
                out[f"master/{name}"] = m.detach()
            if self.steps[i]:
                for prefix, key in STATE_KEYS.items():
                    out[f"{prefix}/{name}"] = self.states[i][key]
                out[f"step/{name}"] = torch.tensor(float(self.steps[i]), dtype=torch.float32)
        return out

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        opt = self.opt
        opt.missing_masters(state)
        check_8bit(state, opt.names)
        opt.load_masters(state)
        for i, name in enumerate(opt.names):
            if f"step/{name}" not in state:
                self.states[i] = init_state(opt.masters[i].numel(), opt.masters[i].device)
                self.steps[i] = 0
                continue
            for prefix, key in STATE_KEYS.items():
                self.states[i][key].copy_(state[f"{prefix}/{name}"].reshape(-1))
            self.steps[i] = int(state[f"step/{name}"].item())
        opt.sync_params()


def check_8bit(state: dict[str, torch.Tensor], names: list[str]) -> None:
    """KeyError when ``state`` holds torch-AdamW moments (a checkpoint of optim.name = adamw)."""
    if any(f"exp_avg/{n}" in state for n in names):
        raise KeyError(
            "the checkpoint holds fp32 AdamW moments (optim.name = adamw), this run uses optim.name = adamw8bit; "
            "resume with the optimizer the checkpoint was written with"
        )
