"""Errors a user can fix. Every package may raise these; the CLI prints them as one sentence plus
what to do, exit code 2, without a traceback. Anything else is a bug and keeps its traceback."""


class UserError(Exception):
    """Bad input (config, data, checkpoint, environment): the message says what to change."""


class ConfigError(UserError):
    """An invalid configuration value, reported before any model is loaded."""


class DataError(UserError):
    """A bad dataset row or source: names the file, the row and the problem."""


class CheckpointError(UserError):
    """A missing, mismatched or corrupted checkpoint: lists what is wrong by name."""


class RunStopped(KeyboardInterrupt):
    """A run stopped on a signal after saving a checkpoint of its last step (``polyrl.run.stop_signal``; the message
    says which signal and where the checkpoint is); ``exit_code``: 128 + the signal's number."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


# other trainers' names (TRL, verl, HF TrainingArguments) -> polyrl's, for did_you_mean (setting names and flags,
# underscores; a tuple: the first of them that is known)
FOREIGN_NAMES: dict[str, str | tuple[str, ...]] = {
    "learning_rate": "lr",
    "num_generations": "samples_per_prompt",
    "rollout_n": "samples_per_prompt",
    "max_completion_length": "max_new_tokens",
    "response_length": "max_new_tokens",
    "max_prompt_length": "max_prompt_len",
    "max_length": "max_seq_len",
    "num_train_epochs": "epochs",
    "total_epochs": "epochs",
    "total_training_steps": "max_steps",
    "max_grad_norm": "grad_clip",
    "output_dir": "out",
    "model_name_or_path": "model",
    "dataset_name": "data",
    "resume_from_checkpoint": "resume",
    "gradient_checkpointing": "activation_checkpointing",
    "save_steps": ("every_n_steps", "save_every"),
    "save_total_limit": ("keep_last_k", "keep_last"),
    "logging_steps": "log_every",
    "eval_steps": "eval_every",
    "lr_scheduler_type": ("decay", "lr_decay"),
    "load_in_4bit": "qlora",
    "per_device_train_batch_size": ("micro_batch_tokens", "prompts_per_step"),
    "gradient_accumulation_steps": "tokens_per_step",
    "epsilon": "clip_low",
    "epsilon_high": "clip_high",
    "clip_ratio_low": "clip_low",
    "clip_ratio_high": "clip_high",
    "num_iterations": "ppo_epochs",
    "loss_type": "loss_agg",
    "loss_agg_mode": "loss_agg",
    "beta": "kl_coef",
    "kl_loss_coef": "kl_coef",
    "use_peft": "lora",
    "lora_r": "r",
    "lora_alpha": "alpha",
    "lora_dropout": "dropout",
}


def did_you_mean(names: list[str] | str, known: list[str] | set[str], fmt: str = "{}") -> str:
    """`` (did you mean X?)`` for the closest of ``known`` to each of ``names`` (typos, ``-``/``_`` and case
    differences, another trainer's name in ``FOREIGN_NAMES``), each formatted with ``fmt``; '' when none is close.
    For the unknown-setting and unknown-flag errors."""
    # lazy: difflib is only needed when an error is being worded
    import difflib

    names = [names] if isinstance(names, str) else list(names)
    by_norm = {k.lower().replace("-", "_"): k for k in known}
    found = []
    for name in names:
        norm = name.lower().replace("-", "_")
        if norm in by_norm:
            close = [norm]
        elif any(alias in by_norm for alias in _aliases(norm)):
            close = [next(alias for alias in _aliases(norm) if alias in by_norm)]
        else:
            close = difflib.get_close_matches(norm, list(by_norm), n=1, cutoff=0.75)
        found += [fmt.format(by_norm.get(c, c)) for c in close if fmt.format(by_norm.get(c, c)) not in found]
    return f" (did you mean {' or '.join(found)}?)" if found else ""


def _aliases(name: str) -> tuple[str, ...]:
    value = FOREIGN_NAMES.get(name, ())
    return (value,) if isinstance(value, str) else value
