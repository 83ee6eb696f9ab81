"""polyrl: LLM post-training (SFT, DPO, GRPO/GSPO/PPO) on any accelerator PyTorch reaches.

Importing this package is cheap and side-effect free: it does not import torch's device runtime,
triton, fastapi or transformers. Subpackages are imported where they are used.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
