"""The chat template, rendered under bounds: which ``chat_template_kwargs`` a client may pass, and a sandboxed Jinja
environment with Hugging Face's semantics in which the model's own template runs with a deadline and a cap on the
characters it makes.

A client never supplies template code: ``chat_template`` (and ``documents``, ``messages`` and every other name
not in ``TEMPLATE_KWARGS``) inside ``chat_template_kwargs`` is a 400 naming the key, as it is at the top level of
the body. The allowed keys are the variables that published templates read (Qwen3's ``enable_thinking``,
gpt-oss's ``reasoning_effort``, Llama 3's ``date_string``, ...), and their values are JSON data of at most
``MAX_KWARGS_CHARS`` characters in all: a template reads them as data and never runs them.

Why lockstep renders itself rather than calling ``tokenizer.apply_chat_template``: transformers renders in
jinja2's ``ImmutableSandboxedEnvironment`` (no escape to Python internals, no mutation of the inputs), but nothing
bounds the work. Four 250-byte client templates of nested ``range(100000)`` loops held every request thread for
~30 s, and a 203-byte one built a 10^9-character string before any length check. Here the same environment (the
same options, filters and globals: ``tojson``, ``raise_exception``, ``strftime_now``, ``dict``, ``namespace``,
loop controls, a ``{% generation %}`` block) renders with three bounds, so client data cannot make even the
model's own template run long or grow large:

- time: every call, and every 256th iteration of every ``{% for %}`` (each loop's iterable is wrapped when the
  template compiles), checks a deadline (``MAX_RENDER_SECONDS``) and the request's cancel flag (its client left);
- output: the text is streamed (``Template.generate``) and rendering stops once it passes ``max_chars``;
- growth inside one expression: ``*``, ``+``, ``%`` and ``**``, every call (macros included), every filter and
  every ``namespace`` assignment refuse a string or list longer than ``max_chars`` (and ``join`` and repetition
  refuse before building it).

A single C-level operation (one ``~`` concatenation, one filter) still runs to its end before its result is
checked; its operands are bounded by the checks before it. lockstep trusts the model's template as it trusts its
weights: what the bounds guard against is client data driving it.
"""

import json
import re
import threading
import time
from contextvars import ContextVar
from datetime import datetime
from functools import lru_cache, wraps
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# The variables a client may set through chat_template_kwargs: those that published chat templates read as
# switches or data (Qwen3, DeepSeek, gpt-oss, Llama 3.x, SmolLM3, Granite, Mistral, Hermes).
TEMPLATE_KWARGS = frozenset(
    {
        "enable_thinking",  # Qwen3, SmolLM3 ("/think"), GLM
        "thinking",  # DeepSeek-V3.1, Granite
        "reasoning_effort",  # gpt-oss
        "thinking_budget",  # Seed-OSS
        "model_identity",  # gpt-oss
        "builtin_tools",  # gpt-oss, Llama 3.1
        "custom_tools",  # Llama 3.1+
        "tools_in_user_message",  # Llama 3.1+
        "date_string",  # Llama 3.1+
        "xml_tools",  # SmolLM3
        "python_tools",  # SmolLM3
        "controls",  # Granite
        "keep_cot",  # some distilled reasoning templates
    }
)
# Set by the request's own fields, never through chat_template_kwargs.
REQUEST_FIELDS = frozenset({"add_generation_prompt", "continue_final_message", "tools", "messages"})
MAX_KWARGS_CHARS = 1 << 16  # the JSON text of all chat_template_kwargs values together
MAX_RENDER_SECONDS = 2.0  # a normal conversation renders in well under a millisecond
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # Hugging Face's marker for continue_final_message
_ITER = "lockstep_checked_iter"  # the global every loop's iterable passes through
_BIG_FORMAT_WIDTH = re.compile(r"%[-+ #0]*(\d{6,})|%[-+ #0\d]*\.(\d{6,})")


class TemplateError(ValueError):
    """The template refused the conversation (``raise_exception``, a missing variable, a bad input)."""


class RenderLimitError(Exception):
    """Rendering passed a bound: ``kind`` is "time" or "size"."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class RenderCancelled(Exception):
    """The request's client left while its template rendered."""


def check_template_kwargs(kwargs: dict[str, Any]) -> str | None:
    """None if ``kwargs`` are all allowed, else why not (naming the first bad key)."""
    for key in kwargs:
        if key == "chat_template":
            return "chat_template_kwargs may not carry a chat template: the server renders the model's own"
        if key in REQUEST_FIELDS:
            return f"chat_template_kwargs key {key[:100]!r} is set by the request's own field, not here"
        if key not in TEMPLATE_KWARGS:
            allowed = ", ".join(sorted(TEMPLATE_KWARGS))
            return f"chat_template_kwargs key {key[:100]!r} is not allowed (allowed: {allowed})"
    size = len(json.dumps(list(kwargs.values())))
    if size > MAX_KWARGS_CHARS:
        return f"chat_template_kwargs values are {size} characters of JSON: more than {MAX_KWARGS_CHARS}"
    return None


class _Watch:
    """One render's bounds, checked from the trace function and the sandbox's hooks."""

    def __init__(self, max_chars: int, seconds: float, cancelled: threading.Event | None) -> None:
        self.max_chars, self.seconds, self.cancelled = max_chars, seconds, cancelled
        self.deadline = time.monotonic() + seconds
        self.ticks = 0

    def check(self) -> None:
        if time.monotonic() > self.deadline:
            raise RenderLimitError("time", f"rendering the chat template took over {self.seconds:g} s")
        if self.cancelled is not None and self.cancelled.is_set():
            raise RenderCancelled()

    def size(self, value: object, what: str) -> object:
        if isinstance(value, (str, list, tuple, dict)) and len(value) > self.max_chars:
            raise RenderLimitError("size", f"the chat template made a {what} of over {self.max_chars} characters")
        return value

    def tick(self) -> None:
        """One loop iteration: the clock is read every 256th."""
        self.ticks += 1
        if not self.ticks & 255:
            self.check()


_watch: ContextVar[_Watch | None] = ContextVar("lockstep_template_watch", default=None)


def _current() -> _Watch:
    watch = _watch.get()
    if watch is None:  # the environment is only ever used through render()
        raise RuntimeError("the chat template environment renders only through render()")
    return watch


def _checked_iter(iterable):
    """What every ``{% for %}`` of the template iterates over (``BoundedSandbox._parse`` puts it there)."""
    watch = _current()
    watch.check()
    for item in iterable:
        watch.tick()
        yield item


def _length(value: object) -> int:
    return len(value) if isinstance(value, (str, list, tuple)) else 0


class _Generation(jinja2.ext.Extension):
    """Hugging Face's ``{% generation %}...{% endgeneration %}`` (it marks the assistant's tokens for training
    masks): the body renders as it is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """``namespace()``: no underscore-prefixed names (as Hugging Face's), and no value past the size cap (a
    namespace is the one place a template's state grows from one loop iteration to the next)."""

    def __init__(*args, **kwargs) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name, value in attrs.items():
            _Namespace._check(name, value)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value) -> None:
        _Namespace._check(name, value)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name, value) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace may not hold the underscore-prefixed name {name!r}")
        _current().size(value, "namespace value")


class _Dict:
    """``dict()`` in a template, without the type's attributes."""

    def __call__(self, *args, **kwargs) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Hugging Face's: no HTML escaping, and json.dumps' options.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _bounded_filter(name: str, f):
    """A filter whose arguments (past the value) and result stay within the cap; ``join`` is checked before it
    joins."""
    first = 2 if hasattr(f, "jinja_pass_arg") else 1  # past the context (if it takes one) and the value

    @wraps(f)
    def bounded(*args, **kwargs):
        watch = _current()
        watch.check()
        for a in (*args[first:], *kwargs.values()):
            if isinstance(a, int) and not isinstance(a, bool) and abs(a) > watch.max_chars:
                raise RenderLimitError("size", f"the filter {name!r} was given {a}: more than {watch.max_chars}")
            watch.size(a, f"argument of the filter {name!r}")
        if name == "join" and len(args) >= first and hasattr(args[first - 1], "__iter__"):
            items = list(args[first - 1])
            sep = args[first] if len(args) > first else kwargs.get("d", "")
            total = sum(len(v) if isinstance(v, str) else 1 for v in items) + _length(sep) * len(items)
            if total > watch.max_chars:
                raise RenderLimitError("size", f"the chat template joined over {watch.max_chars} characters")
            args = (*args[: first - 1], items, *args[first:])
        return watch.size(f(*args, **kwargs), f"result of the filter {name!r}")

    return bounded


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """Hugging Face's chat-template environment, with the hooks of the module docstring."""

    intercepted_binops = frozenset({"*", "+", "%", "**"})

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols])
        self.filters["tojson"] = _tojson
        self.filters = {name: _bounded_filter(name, f) for name, f in self.filters.items()}
        self.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
        self.globals.update(dict=_Dict(), namespace=_Namespace)
        self.globals[_ITER] = _checked_iter

    def _parse(self, source, name, filename):
        # Every loop iterates through _checked_iter, so that a loop that calls nothing still sees the deadline.
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(jinja2.nodes.For):
            checked = jinja2.nodes.Call(jinja2.nodes.Name(_ITER, "load"), [loop.iter], [], None, None)
            loop.iter = checked.set_lineno(loop.lineno).set_environment(self)
        return tree

    def call_binop(self, context, operator: str, left, right):
        watch = _current()
        if operator == "*":
            seq, times = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(times, int) and _length(seq) * max(times, 0) > watch.max_chars:
                raise RenderLimitError("size", f"the chat template repeated a value past {watch.max_chars} characters")
        elif operator == "+" and _length(left) + _length(right) > watch.max_chars:
            raise RenderLimitError("size", f"the chat template made a value of over {watch.max_chars} characters")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
            if right * abs(left).bit_length() > 1 << 16:
                raise RenderLimitError("size", f"the chat template raised {left} to the power {right}")
        elif operator == "%" and isinstance(left, str) and _BIG_FORMAT_WIDTH.search(left):
            raise RenderLimitError("size", "the chat template formatted with a width of a million or more")
        return watch.size(super().call_binop(context, operator, left, right), "value")

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's signature)
        watch = _current()
        watch.check()
        for a in (*args, *kwargs.values()):
            watch.size(a, "call argument")
        return watch.size(super().call(__context, __obj, *args, **kwargs), "call result")


@lru_cache(maxsize=8)  # the model's template(s): a tokenizer may name several (a dict of templates)
def compile_template(source: str) -> jinja2.Template:
    """``source`` compiled in a ``BoundedSandbox`` (cached: a server renders the same template every call)."""
    return BoundedSandbox().from_string(source)


def render(
    tokenizer,
    messages: list[dict],
    *,
    tools: list[dict] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    kwargs: dict[str, Any] | None = None,
    max_chars: int,
    seconds: float = MAX_RENDER_SECONDS,
    cancelled: threading.Event | None = None,
) -> str:
    """The conversation as ``tokenizer.apply_chat_template(..., tokenize=False)`` renders it, within the bounds:
    RenderLimitError past ``seconds`` or ``max_chars``, RenderCancelled once ``cancelled`` is set, TemplateError
    when the template refuses the conversation. Blocking: call it in a worker thread."""
    if continue_final_message and add_generation_prompt:
        raise TemplateError("add_generation_prompt and continue_final_message cannot both be true")
    try:
        source = tokenizer.get_chat_template(None, tools)
    except ValueError as e:
        raise TemplateError(str(e)) from None
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]  # as Hugging Face drops them
    final = None
    if continue_final_message:
        final = messages[-1].get("content") if messages else None
        if not isinstance(final, str):
            raise TemplateError("continue_final_message needs a final message with text to continue")
        messages[-1] = {**messages[-1], "content": final + _CONTINUE_TAG}
    variables = {
        **tokenizer.special_tokens_map,
        **(kwargs or {}),
        "messages": messages,
        "tools": tools,
        "documents": None,
        "add_generation_prompt": add_generation_prompt,
    }
    watch = _Watch(max_chars, seconds, cancelled)
    text = _generate(compile_template(source), variables, watch)
    if final is not None:
        # Cut the text where the final message's marker is: the model continues that message.
        tag = text.rfind(_CONTINUE_TAG.strip())
        if tag < 0 or final.strip() not in text:
            raise TemplateError("continue_final_message: the template does not render the final message as it is")
        text = text[:tag] if text[tag : tag + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:tag].rstrip()
    return text


def _generate(template: jinja2.Template, variables: dict, watch: _Watch) -> str:
    token = _watch.set(watch)
    try:
        pieces, size = [], 0
        for piece in template.generate(**variables):
            size += len(piece)
            if size > watch.max_chars:
                raise RenderLimitError("size", f"the chat template made over {watch.max_chars} characters")
            pieces.append(piece)
        return "".join(pieces)
    except (RenderLimitError, RenderCancelled):
        raise
    except RecursionError:
        raise RenderLimitError("size", "the chat template recursed too deeply") from None
    except Exception as e:  # the template refused the conversation, or a sandbox rule stopped it
        raise TemplateError(str(e)[:1000]) from None
    finally:
        _watch.reset(token)
