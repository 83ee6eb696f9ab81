"""Which part of a training step cannot be captured as a CUDA graph? Each case runs in its own process (a failed
capture can leave the CUDA RNG in capture state): a tiny Qwen3-like model, fp32 masters on bf16 weights, the
engine's causal-LM loss, one eager warm-up, then ``torch.cuda.graph`` around the case. Prints OK or the traceback.

Usage: python scripts/graph_capture_probe.py [CASE ...]   (no argument: every case)
"""

from __future__ import annotations

import os
import subprocess
import sys
import traceback

CASES = {
    "fwd-nograd": "forward of the model only, no autograd",
    "fwd-loss": "forward + fused linear-CE loss, autograd on, no backward",
    "step": "forward + loss + backward (full training)",
    "step-frozen-embed": "step with the embedding frozen",
    "step-triton-attn": "step with the Triton attention kernel forced",
    "step-thread-local": "step, capture_error_mode thread_local",
    "step-relaxed": "step, capture_error_mode relaxed",
    "step-lora-ckpt": "LoRA step under activation checkpointing",
    "recover": "a failing capture (a host sync inside), then a trivial capture and a random op",
}


def _case(name: str) -> None:
    import torch

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "train"))
    from train_helpers import pack, random_seqs, tiny_lm

    from polyrl.train import OptimConfig, ScheduleConfig, StepConfig, TrainEngine, causal_lm_loss

    dev = torch.device("cuda")
    model = tiny_lm(seed=0, hidden=256, heads=8, layers=2).to(dev)
    if name == "step-frozen-embed":
        model.model.embed_tokens.weight.requires_grad_(False)
    ckpt = name == "step-lora-ckpt"
    if ckpt:
        from polyrl.models.lora import LoraConfig, apply_lora

        model = apply_lora(model, LoraConfig(r=8, alpha=16))
    engine = TrainEngine(
        model,
        OptimConfig(lr=1e-3),
        ScheduleConfig(decay="constant"),
        engine=StepConfig(cuda_graphs=False, activation_checkpointing=ckpt),
    )
    batch = pack(random_seqs(4, 128, 64, 0)).to(dev)
    engine.step([batch])  # eager warm-up
    model.train()
    mode = {"step-thread-local": "thread_local", "step-relaxed": "relaxed"}.get(name, "global")

    def body():
        if name == "fwd-nograd":
            with torch.no_grad():
                return causal_lm_loss(model, batch)[0]
        loss, _ = causal_lm_loss(model, batch)
        if name == "fwd-loss":
            return loss
        if name == "recover":
            loss.item()
        loss.backward()
        return loss

    for m in engine.optimizer.masters:
        m.grad = torch.zeros_like(m)
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g, capture_error_mode=mode):
            body()
        g.replay()
        torch.cuda.synchronize()
        print(f"{name}: OK")
    except Exception:
        print(f"{name}: FAILED")
        traceback.print_exc(limit=-12)
        if name == "recover":
            try:
                g2 = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g2):
                    torch.zeros(4, device=dev).add_(1)
                torch.randn(3, device=dev)
                print("recover: a trivial capture after the failure restored the RNG")
            except Exception:
                traceback.print_exc(limit=-4)
                try:
                    torch.randn(3, device=dev)
                    print("recover: RNG fine without the trivial capture")
                except Exception as exc:
                    print(f"recover: RNG still broken ({exc})")


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        _case(sys.argv[2])
        return 0
    for name in sys.argv[1:] or list(CASES):
        print(f"--- {name}: {CASES[name]}", flush=True)
        env = dict(os.environ)
        if name == "step-triton-attn":
            env["POLYRL_KERNELS"] = "attention:triton"
        subprocess.run([sys.executable, __file__, "--one", name], env=env, timeout=180, check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
