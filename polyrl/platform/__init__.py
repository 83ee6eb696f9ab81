"""polyrl.platform: what machine this is and what it can do. The only package that branches on vendor.

- ``probe``: facts, gathered without side effects.
- ``kb``: the platform knowledge base and pitfall rules, as data (``kb/platforms.toml``, ``kb/pitfalls.toml``).
- ``resolve``: a pure function from a probe snapshot to (platform, confidence, evidence).
- ``pitfalls``: the rule engine, one check per rule id: (snapshot, resolution) -> OK / WARN / FAIL / SKIP rows.
- ``device``: the small runtime interface the rest of polyrl calls instead of ``torch.cuda``.
- ``report``: the ``env`` and ``check`` outputs.
"""
