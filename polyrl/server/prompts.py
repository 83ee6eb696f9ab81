"""Turning a request's prompt into token ids without letting one request stall the server.

The endpoints call these functions in the server's prep thread pool (``ServerState.prep``), never on the
event loop. ``tokenize_capped`` stops early when a text is certainly longer than the token budget the
request has (the context minus ``max_tokens``), so a maximal-size prompt is refused after a bounded amount of
tokenisation. ``render_request_template`` renders a chat template that came *in the request* (only when the
server allows it): in a child process, in Jinja's immutable sandbox, with a time limit (the child is killed),
a memory limit and an output-size limit. Not here: the HTTP layer, the sampling parameters (``params.py``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from polyrl.server.api_errors import bad_request

# A text longer than this many characters per allowed token is first measured on a prefix (see tokenize_capped).
PROBE_CHARS_PER_TOKEN = 16
PROBE_MARGIN = 16  # tokens: special tokens the encoder adds, normaliser effects at the cut

# apply_chat_template's own arguments: a request may not set them through chat_template_kwargs.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tokenize",
        "add_generation_prompt",
        "continue_final_message",
        "return_dict",
        "return_tensors",
        "return_assistant_tokens_mask",
        "padding",
        "truncation",
        "max_length",
        "tokenizer_kwargs",
        "tools",
        "documents",
    }
)


class PromptTooLong(Exception):
    """The prompt has more than ``limit`` tokens (``at_least`` were counted; ``exact`` when all were)."""

    def __init__(self, at_least: int, exact: bool) -> None:
        super().__init__(at_least)
        self.at_least, self.exact = at_least, exact


def _cut_before_word(text: str, end: int) -> int:
    """The last position <= ``end`` where a non-space is followed by a space: a boundary that byte-level BPE
    pre-tokenisers (and SentencePiece's whitespace split) never merge across, so the tokens of ``text[:cut]``
    are a prefix of the tokens of ``text``. 0 when there is none."""
    i = end
    while i > 0 and not (text[i].isspace() and not text[i - 1].isspace()):
        i -= 1
    return i


def tokenize_capped(tokenizer: Any, text: str, limit: int, add_special_tokens: bool) -> list[int]:
    """``tokenizer.encode(text)``, or ``PromptTooLong`` once the text is known to exceed ``limit`` tokens.

    A text much longer than ``limit`` tokens could need is measured on a prefix cut at a word boundary first
    (its tokens are a prefix of the whole text's), so an 8 MiB prompt for a 4k context is refused after
    tokenising about 64k characters, not 8 MiB."""
    window = (limit + PROBE_MARGIN + 1) * PROBE_CHARS_PER_TOKEN
    if len(text) > 2 * window:
        cut = _cut_before_word(text, window)
        if cut > 0:
            head = tokenizer.encode(text[:cut], add_special_tokens=add_special_tokens)
            if len(head) > limit + PROBE_MARGIN:
                raise PromptTooLong(len(head) - PROBE_MARGIN, exact=False)
    ids = list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
    if len(ids) > limit:
        raise PromptTooLong(len(ids), exact=True)
    return ids


def decode_prompts(tokenizer: Any, prompts: list[list[int]]) -> list[str]:
    """``[tokenizer.decode(ids) for ids in prompts]`` (the echoed text of token-id prompts), in one call to a fast
    tokenizer's Rust ``decode_batch`` when that is what ``decode`` computes (no clean-up of tokenisation spaces):
    transformers' ``decode`` spends most of its time checking the ids in Python (lm-eval sends 64 prompts of ~100
    ids per request)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if len(prompts) > 1 and backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        return list(backend.decode_batch(prompts, skip_special_tokens=False))
    return [tokenizer.decode(ids) for ids in prompts]


def template_kwargs(req: Any, allow_request_template: bool) -> tuple[str | None, dict[str, Any]]:
    """(the request's own chat template or None, the other template variables), or a 400.

    A request-supplied template (``chat_template``, top level as vLLM takes it, or inside
    ``chat_template_kwargs``) is refused unless the server runs with ``--allow-request-chat-template``:
    rendering arbitrary Jinja costs arbitrary time."""
    kwargs = dict(req.chat_template_kwargs or {})
    template = kwargs.pop("chat_template", None)
    param = "chat_template_kwargs.chat_template"
    if req.chat_template is not None:
        template, param = req.chat_template, "chat_template"
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
    if reserved:
        raise bad_request(
            f"chat_template_kwargs may not set {', '.join(reserved)}: the server sets these itself",
            f"chat_template_kwargs.{reserved[0]}",
            "invalid_value",
        )
    if template is None:
        return None, kwargs
    if not allow_request_template:
        raise bad_request(
            "request-supplied chat templates are disabled on this server (start it with "
            "--allow-request-chat-template to allow them); leave chat_template unset to use the model's",
            param,
            "unsupported",
        )
    if not isinstance(template, str) or not template:
        raise bad_request("chat_template must be a non-empty string", param, "invalid_value")
    return template, kwargs


# The child process: reads {"template", "context", "max_chars"} as JSON on stdin, writes {"text"} or {"error"}.
_CHILD = r"""
import json, resource, sys
from datetime import datetime
try:
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
except (ValueError, OSError):
    pass
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

def out(**kw):
    sys.stdout.write(json.dumps(kw))
    sys.stdout.flush()

def raise_exception(message):
    raise ValueError(message)

try:
    job = json.loads(sys.stdin.read())
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    template = env.from_string(job["template"])
    parts, size = [], 0
    for piece in template.generate(**job["context"]):
        size += len(piece)
        if size > job["max_chars"]:
            out(error=f"the rendered prompt is longer than {job['max_chars']} characters")
            break
        parts.append(piece)
    else:
        out(text="".join(parts))
except MemoryError:
    out(error="rendering ran out of memory")
except Exception as exc:
    out(error=f"{type(exc).__name__}: {exc}")
"""


def render_request_template(
    template: str, messages: list[dict], kwargs: dict[str, Any], tokenizer: Any, timeout_s: float, max_chars: int
) -> str:
    """Render a request-supplied chat template (as transformers would, with the generation prompt) in a
    sandboxed child process; 400 when it fails, runs longer than ``timeout_s`` or renders more than
    ``max_chars`` characters."""
    special = {k: v for k, v in getattr(tokenizer, "special_tokens_map", {}).items() if isinstance(v, str)}
    context = {**special, **kwargs, "messages": messages, "add_generation_prompt": True}
    job = json.dumps({"template": template, "context": context, "max_chars": max_chars})
    try:
        done = subprocess.run(
            [sys.executable, "-I", "-c", _CHILD], input=job, capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        raise bad_request(
            f"the request's chat_template did not finish rendering within {timeout_s:g}s", "chat_template"
        ) from None
    try:
        result = json.loads(done.stdout)
    except ValueError:
        result = {"error": f"the renderer exited with status {done.returncode}"}
    if "error" in result:
        raise bad_request(f"the request's chat_template failed: {result['error']}", "chat_template")
    return result["text"]
