"""Configuration dataclasses of the training engine, each validated in ``__post_init__``.

Every invalid value raises ``polyrl.errors.ConfigError`` with a message that names the field and says
what to change, so a bad run config fails before any model is loaded. The dataclasses hold plain
Python values only (str, int, float, tuples), so they round-trip through TOML/JSON with ``asdict``.
This module does not resolve anything that needs a device (``precision.resolve_compute_dtype`` does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from polyrl.data.packing import DEFAULT_MICRO_BATCH_TOKENS
from polyrl.errors import ConfigError

DECAYS = ("cosine", "linear", "constant")
COMPUTE_DTYPES = ("auto", "bf16", "fp32", "fp16")
# torch / transformers spellings taken for compute_dtype (``torch_dtype="bfloat16"``), stored as the short name
COMPUTE_DTYPE_ALIASES = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}
LINEAR_PRECISIONS = ("default", "fp8")
FP8_SCALINGS = ("tensorwise", "rowwise")
MASTER_DTYPES = ("fp32", "none")
DECAY_PARAMS = ("matrices", "all")
OPTIM_IMPLS = ("auto", "fused", "foreach", "loop")
OPTIM_NAMES = ("adamw", "adamw8bit")
OPTIM_OFFLOADS = ("none", "cpu")


def _positive(section: str, name: str, value: float, hint: str) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{section}.{name} must be a positive number, got {value!r}; {hint}")


def _non_negative_int(section: str, name: str, value: int, hint: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"{section}.{name} must be a non-negative integer, got {value!r}; {hint}")


def _choice(section: str, name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{section}.{name} must be one of {', '.join(choices)}, got {value!r}")


@dataclass
class OptimConfig:
    """AdamW hyper-parameters. ``weight_decay`` applies to ``decay_params``: "matrices" (>= 2-D weights:
    linear layers and embeddings; norms and biases are not decayed) or "all". ``grad_clip`` is the max
    global L2 norm (None or 0 disables clipping; the norm is still reported). ``master_dtype`` "fp32"
    keeps fp32 master weights and moments when the compute weights are bf16/fp16; "none" updates the
    compute weights directly (moments in the compute dtype). ``impl``: torch AdamW kernel choice.
    ``name``: "adamw" (fp32 moments, torch's AdamW) or "adamw8bit" (both moments blockwise 8-bit, the fused
    ``kernels.adamw8bit`` update; docs/optim8.md). ``offload``: "cpu" keeps master weights and moments in host
    memory and runs the update there (grads copied out in buckets, new weights copied back); "none" keeps all on
    the device."""

    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0
    decay_params: str = "matrices"
    grad_clip: float | None = 1.0
    master_dtype: str = "fp32"
    impl: str = "auto"
    name: str = "adamw"
    offload: str = "none"

    def __post_init__(self) -> None:
        _positive("optim", "lr", self.lr, "use e.g. lr = 1e-5 for full fine-tuning")
        self.betas = tuple(self.betas)  # type: ignore[assignment]  # TOML/JSON give lists
        if len(self.betas) != 2 or not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(
                f"optim.betas must be two numbers in [0, 1), got {self.betas!r}; e.g. betas = [0.9, 0.95]"
            )
        _positive("optim", "eps", self.eps, "use e.g. eps = 1e-8")
        if not isinstance(self.weight_decay, (int, float)) or not (0.0 <= self.weight_decay < 1.0):
            raise ConfigError(f"optim.weight_decay must be in [0, 1), got {self.weight_decay!r}; e.g. 0.0 or 0.1")
        _choice("optim", "decay_params", self.decay_params, DECAY_PARAMS)
        if self.grad_clip is not None:
            if not isinstance(self.grad_clip, (int, float)) or self.grad_clip < 0 or not math.isfinite(self.grad_clip):
                raise ConfigError(
                    f"optim.grad_clip must be a positive max norm or 0/None to disable, got {self.grad_clip!r}"
                )
            if self.grad_clip == 0:
                self.grad_clip = None
        _choice("optim", "master_dtype", self.master_dtype, MASTER_DTYPES)
        _choice("optim", "impl", self.impl, OPTIM_IMPLS)
        _choice("optim", "name", self.name, OPTIM_NAMES)
        _choice("optim", "offload", self.offload, OPTIM_OFFLOADS)
        if self.name == "adamw8bit" and self.impl != "auto":
            raise ConfigError(
                f"optim.impl = {self.impl!r} picks torch's AdamW kernel, which optim.name = adamw8bit does not use "
                "(its kernel comes from the registry; POLYRL_KERNELS=adamw8bit:reference forces the reference); leave "
                "optim.impl = auto"
            )


@dataclass
class ScheduleConfig:
    """Learning-rate schedule: linear warmup over ``warmup_steps`` (or ``warmup_ratio`` of the total
    steps when set), then ``decay`` from lr down to ``min_lr_ratio * lr`` at the last step."""

    warmup_steps: int = 0
    warmup_ratio: float | None = None
    decay: str = "cosine"
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        _non_negative_int("schedule", "warmup_steps", self.warmup_steps, "use 0 for no warmup")
        if self.warmup_ratio is not None:
            if not isinstance(self.warmup_ratio, (int, float)) or not (0.0 <= self.warmup_ratio <= 1.0):
                raise ConfigError(f"schedule.warmup_ratio must be in [0, 1], got {self.warmup_ratio!r}")
            if self.warmup_steps:
                raise ConfigError("schedule.warmup_steps and schedule.warmup_ratio are both set; keep only one of them")
        _choice("schedule", "decay", self.decay, DECAYS)
        if not isinstance(self.min_lr_ratio, (int, float)) or not (0.0 <= self.min_lr_ratio <= 1.0):
            raise ConfigError(f"schedule.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}; e.g. 0.1")


@dataclass
class CheckpointConfig:
    """Checkpoint every ``every_n_steps`` optimizer steps (0: only at the end) into ``dir`` (None: the
    run directory's ``checkpoints/``), keeping the newest ``keep_last_k`` (0 keeps all)."""

    every_n_steps: int = 0
    keep_last_k: int = 2
    dir: str | None = None
    save_final: bool = True

    def __post_init__(self) -> None:
        _non_negative_int("checkpoint", "every_n_steps", self.every_n_steps, "use 0 to save only at the end")
        _non_negative_int("checkpoint", "keep_last_k", self.keep_last_k, "use 0 to keep every checkpoint")
        if self.dir is not None and (not isinstance(self.dir, str) or not self.dir.strip()):
            raise ConfigError(f"checkpoint.dir must be a directory path or unset, got {self.dir!r}")


@dataclass
class PrecisionConfig:
    """``compute_dtype`` of the weights and activations: "auto" is bf16 on accelerators that support it
    and fp32 on the CPU. Master weights are fp32 unless ``optim.master_dtype = "none"``. fp16 uses a
    dynamic loss scale starting at ``initial_loss_scale``. ``linear = "fp8"`` (CLI ``--precision fp8``) runs the
    decoder's q/k/v/o/gate/up/down projections' forward and backward GEMMs in FP8 (``models/fp8_linear.py``, fp8.md)
    with ``fp8_scaling`` "tensorwise" or "rowwise" (forward only; the gradients' GEMMs are tensor-wise); the rest
    (lm_head, attention, norms, loss), the master weights and the optimizer stay as they are. Refused where the
    device has no FP8 GEMM (``polyrl env``), unless ``POLYRL_KERNELS`` forces the reference (emulation)."""

    compute_dtype: str = "auto"
    initial_loss_scale: float = 2.0**16
    linear: str = "default"
    fp8_scaling: str = "tensorwise"

    def __post_init__(self) -> None:
        if isinstance(self.compute_dtype, str):
            self.compute_dtype = COMPUTE_DTYPE_ALIASES.get(self.compute_dtype, self.compute_dtype)
        _choice("precision", "compute_dtype", self.compute_dtype, COMPUTE_DTYPES)
        _choice("precision", "linear", self.linear, LINEAR_PRECISIONS)
        _choice("precision", "fp8_scaling", self.fp8_scaling, FP8_SCALINGS)
        _positive("precision", "initial_loss_scale", self.initial_loss_scale, "use e.g. 65536")


@dataclass
class StepConfig:
    """How steps run. ``micro_batch_tokens``: token budget of one forward/backward (what the packer
    fills); ``step_tokens``: tokens per optimizer step (gradient accumulation by token budget; None:
    one micro-batch per step); must be >= micro_batch_tokens. ``nan_guard_max_consecutive``: stop
    after this many skipped (non-finite) steps in a row. ``deterministic`` asks torch for
    deterministic kernels (bitwise-reproducible runs on the CPU). ``compile`` compiles each decoder
    layer with torch.compile where that works (falls back to eager with a warning). ``pause_gc`` keeps Python's
    cyclic garbage collector off while a step runs (``platform.host.gc_paused``: its passes stall the host that
    launches kernels; it runs between steps instead). ``cuda_graphs``: the forward + backward of a micro-batch shape
    seen twice in a row is captured as a CUDA graph and replayed (``train/graphed_step.py``) where that is possible:
    CUDA, one process, no torch.compile, no dropout, a loss marked ``graph_safe`` (SFT's). None (default): where
    possible, eager elsewhere, and no more captures once two graphs were dropped after a single replay (variable
    packed shapes: ``data.fixed_shapes = true`` pads batches to one shape so one graph replays); False: never; True:
    required (an error says why a step cannot be captured; captures continue whatever the shapes).
    ``checkpoint_layers``: with ``activation_checkpointing``, recompute only the first this-many decoder layers (None:
    all); the others keep their activations, trading memory for less recomputation (Megatron's
    ``recompute_num_layers``, block method). Larger than the model's layer count means all.
    ``moe_aux_loss_coef`` / ``moe_z_loss_coef`` (MoE models only; ``train/moe_loss.py``): the coefficients of the
    router's load-balancing loss and z-loss added to the loss. None (default): the model's config.json decides, as in
    transformers (``router_aux_loss_coef`` only when ``output_router_logits`` is true; ``router_z_loss_coef``,
    0 unless set); a number overrides it (0: report the losses as metrics, add nothing)."""

    micro_batch_tokens: int = DEFAULT_MICRO_BATCH_TOKENS  # the one owner of the packing budget (data, RL batches)
    step_tokens: int | None = None
    activation_checkpointing: bool = False
    checkpoint_layers: int | None = None
    compile: bool = False
    nan_guard_max_consecutive: int = 5
    deterministic: bool = False
    seed: int = 0
    pause_gc: bool = True
    cuda_graphs: bool | None = None
    moe_aux_loss_coef: float | None = None
    moe_z_loss_coef: float | None = None

    def __post_init__(self) -> None:
        for name in ("moe_aux_loss_coef", "moe_z_loss_coef"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0
            ):
                raise ConfigError(f"engine.{name} must be a number >= 0 or unset (the model config's), got {value!r}")
        if self.checkpoint_layers is not None:
            if isinstance(self.checkpoint_layers, bool) or not isinstance(self.checkpoint_layers, int):
                raise ConfigError(
                    f"engine.checkpoint_layers must be a whole number of layers, got {self.checkpoint_layers!r}"
                )
            if self.checkpoint_layers < 0:
                raise ConfigError(f"engine.checkpoint_layers must be >= 0, got {self.checkpoint_layers}")
            if not self.activation_checkpointing:
                raise ConfigError(
                    "engine.checkpoint_layers only applies with activation checkpointing: set "
                    "engine.activation_checkpointing = true (CLI --activation-checkpointing) or drop checkpoint_layers"
                )
        if self.cuda_graphs not in (None, True, False):
            raise ConfigError(f"engine.cuda_graphs must be true, false or unset (auto), got {self.cuda_graphs!r}")
        if not isinstance(self.micro_batch_tokens, int) or self.micro_batch_tokens <= 0:
            raise ConfigError(f"engine.micro_batch_tokens must be a positive integer, got {self.micro_batch_tokens!r}")
        if self.step_tokens is not None:
            if not isinstance(self.step_tokens, int) or self.step_tokens < self.micro_batch_tokens:
                raise ConfigError(
                    f"engine.step_tokens ({self.step_tokens!r}) must be an integer >= engine.micro_batch_tokens "
                    f"({self.micro_batch_tokens}); raise step_tokens or lower micro_batch_tokens"
                )
        if not isinstance(self.nan_guard_max_consecutive, int) or self.nan_guard_max_consecutive < 1:
            raise ConfigError(
                f"engine.nan_guard_max_consecutive must be an integer >= 1, got {self.nan_guard_max_consecutive!r}"
            )
        _non_negative_int("engine", "seed", self.seed, "use e.g. seed = 0")

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per optimizer step implied by the token budgets (at least 1)."""
        if self.step_tokens is None:
            return 1
        return max(1, self.step_tokens // self.micro_batch_tokens)
