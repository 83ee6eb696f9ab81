"""``polyrl bench sft --optim adamw8bit --optim-offload cpu``: the polyrl row trains with those optimizer settings
(header says so, the engine's updater is the offloaded 8-bit one) and the bitsandbytes row is skipped with the reason
where bitsandbytes is absent (run where it is, it trains)."""

from __future__ import annotations

import json

from polyrl.cli.main import main


def test_bench_sft_optim_flags_and_bnb_row(tmp_path, capsys, monkeypatch):
    from polyrl.bench import sft
    from polyrl.train import optim

    seen = []
    real_init = optim.MasterAdamW.__init__

    def spy_init(self, named_params, cfg, *a, **k):
        real_init(self, named_params, cfg, *a, **k)
        seen.append((cfg.name, cfg.offload, type(self.updater).__name__))

    monkeypatch.setattr(optim.MasterAdamW, "__init__", spy_init)
    out = tmp_path / "optim8.json"
    argv = ["bench", "sft", "--shape", "tiny", "--seq", "64", "--batch", "2", "--steps", "1", "--warmup", "1"]
    argv += ["--optim", "adamw8bit", "--optim-offload", "cpu", "--baselines", "hf-bnb8bit", "--numerics", "bf16"]
    assert main([*argv, "--json", str(out)]) == 0
    assert "polyrl optim.name=adamw8bit optim.offload=cpu" in capsys.readouterr().out
    assert seen == [("adamw8bit", "cpu", "HostOffload")]
    by_name = {r["name"]: r for r in json.loads(out.read_text())["results"]}
    assert by_name["polyrl"]["status"] == "ok" and by_name["polyrl"]["loss"] > 0
    bnb = by_name["hf-bnb8bit-bf16"]
    why = sft.bnb_available()
    assert bnb["status"] == ("ok" if why is None else f"skipped: {why}")
