"""``PolyrlLM.loglikelihood``'s batched, deduplicated tokenisation hands ``_loglikelihood_tokens`` exactly the
token ids lm-eval's own ``TemplateLM.loglikelihood`` (per-request ``_encode_pair``) does: shared contexts, trailing
spaces moved to the continuation, an all-space context, an empty context (``prefix_token_id``). CPU, < 2 s."""

from __future__ import annotations

import pytest

pytest.importorskip("lm_eval")


class _Req:
    def __init__(self, context: str, continuation: str) -> None:
        self.args = (context, continuation)


def test_batched_tokenisation_equals_lm_evals(tiny_model_dir):
    from lm_eval.api.model import TemplateLM

    from polyrl.eval.harness import PolyrlLM
    from polyrl.eval.loading import eval_engine, load_eval_model

    model, tok = load_eval_model(str(tiny_model_dir), "float32", "cpu")
    lm = PolyrlLM(llm=eval_engine(model, tok, max_model_len=256, num_blocks=64), show_progress=False)
    seen: list = []
    lm._loglikelihood_tokens = lambda reqs, **kw: seen.append(reqs) or [(0.0, True)] * len(reqs)
    reqs = [
        _Req("Question: 2+3=? Answer:", " 5"),
        _Req("Question: 2+3=? Answer:", " 6"),
        _Req("The river mill ", "stands"),  # the trailing space moves to the continuation
        _Req("The river mill ", "was old."),
        _Req("  ", "x"),  # all spaces: the context becomes ""
        _Req("", "hello world"),  # empty: prefix_token_id is the context
        _Req("a\n\n", "b"),
    ]
    out = lm.loglikelihood(reqs)
    TemplateLM.loglikelihood(lm, reqs, disable_tqdm=True)  # lm-eval's per-request path, into the same stub
    ours, theirs = seen
    assert out == [(0.0, True)] * len(reqs)
    assert [(k, list(c), list(n)) for k, c, n in ours] == [(k, list(c), list(n)) for k, c, n in theirs]
    assert ours[5][1] == [lm.prefix_token_id]
    assert len(ours[2][2]) > 0 and ours[0][1] == ours[1][1]
