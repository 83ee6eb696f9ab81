"""polyrl.eval: evaluate a model - lm-eval-harness tasks through the rollout engine, and reward-based evaluation.

- ``harness.py``: ``PolyrlLM``, an lm-eval model registered as ``polyrl`` (``lm_eval --model polyrl`` after
  ``import polyrl.eval.harness``, or ``polyrl eval --tasks ...``): log-likelihoods from one batched scoring call on
  the engine's model and KV cache (``infer/scoring.py``: a document's choices sharing their context, only the
  continuation tokens through the LM head), generation through continuous batching.
- ``bundled.py``: polyrl's own small tasks (YAML + jsonl, no hub), for tests, the validate gate and the demo.
- ``rewards.py``: ``reward_eval``: sample ``n`` completions per prompt of any data the trainer reads, score them
  with a reward function, and report mean reward, pass@1, unbiased pass@k and mean length.

Layer: beside ``server`` (both above ``trainer``, never each other); ``cli``, ``validate`` and ``bench`` use it.
lm-eval itself is optional (the ``eval`` extra) and imported only by ``harness.py``.
"""
