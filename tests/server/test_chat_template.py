"""The server's chat-template rendering (``lockstep.server.chat_template``): the same text as Hugging Face's
``apply_chat_template`` for real and feature-heavy templates, within its bounds (time, characters, growth inside
an expression, the client leaving) for hostile ones, and which ``chat_template_kwargs`` a client may pass. Also
the streamed text's stop-string holdback (``responses._StopPrefix``): the same as trying every prefix, in linear
time. (The routes are driven over HTTP in test_hostile_templates.py.)"""

import random
import threading
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from lockstep.server.chat_template import (
    MAX_KWARGS_CHARS,
    RenderCancelled,
    RenderLimitError,
    TemplateError,
    check_template_kwargs,
    render,
)
from lockstep.server.responses import _StopPrefix

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Grüße, 東京 🙂 — what's 2+2?"},
    {"role": "assistant", "content": "4", "tool_calls": None},
    {"role": "user", "content": "And 3+3?"},
]
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]
# Most of what templates on the Hub use: namespace, tojson, loop variables, a recursive loop, macros, filters,
# loop controls, a generation block, raise_exception, strftime_now, dict(), special tokens, extra variables.
RICH = """{%- set ns = namespace(n=0, sys='') -%}
{%- macro show(x) %}[{{ x | tojson }}]{% endmacro -%}
{{ bos_token }}{% if tools %}TOOLS {{ tools | tojson(indent=2) }}
{%- for t in tools %}{{ show(t.function.name) }}{% endfor %}
{% endif %}{% for m in messages %}{% if m.role == 'system' %}{% set ns.sys = m.content %}{% continue %}{% endif %}
{%- set ns.n = ns.n + 1 -%}
<{{ m['role'] | upper }} {{ loop.index }}/{{ loop.length }}{{ ' last' if loop.last }}>
{%- if m.role == 'assistant' %}{% generation %}{{ m.content | trim }}{% endgeneration %}
{%- else %}{{ m.content }}{% endif %}
{%- if 'tool_calls' in m %}HAS_CALLS{% endif %}
{% endfor %}{% for k, v in dict(a=[1], b=[1, 2]) | dictsort %}{{ k }}={{ v | join(',') }};{% endfor %}
{%- for x in [[1, [2, [3]]]] recursive %}{% if x is iterable %}({{ loop(x) }}){% else %}{{ x }}{% endif %}{% endfor %}
{{ ns.n }} {{ ns.sys | length }} {{ 'yes' if enable_thinking is defined and enable_thinking else 'no' }}
{%- if strftime_now('%Y') | int < 2000 %}{{ raise_exception('clock') }}{% endif %}
{%- if add_generation_prompt %}<ASSISTANT>{% endif %}"""


class _Templated:
    """A tokenizer stand-in with a given template (for templates Hugging Face's tokenizers need not render)."""

    special_tokens_map: dict = {}

    def __init__(self, source: str) -> None:
        self.source = source

    def get_chat_template(self, chat_template=None, tools=None) -> str:
        return self.source


def _render(source: str, max_chars: int = 100_000, seconds: float = 0.5, **kw) -> str:
    return render(_Templated(source), CONVERSATION, max_chars=max_chars, seconds=seconds, **kw)


@pytest.fixture(scope="module")
def tok(embedded_model_dir: Path):
    return AutoTokenizer.from_pretrained(embedded_model_dir)


@pytest.mark.parametrize("template", ["model", "rich"])
def test_renders_what_hugging_face_renders(tok, template: str) -> None:
    if template == "rich":
        tok = AutoTokenizer.from_pretrained(tok.name_or_path)
        tok.chat_template = RICH
    cases = [
        dict(add_generation_prompt=True),
        dict(add_generation_prompt=False),
        dict(add_generation_prompt=True, tools=TOOLS, kwargs={"enable_thinking": True}),
        dict(add_generation_prompt=False, continue_final_message=True),
    ]
    for case in cases:
        kwargs = case.pop("kwargs", {})
        ours = render(tok, CONVERSATION, **case, kwargs=kwargs, max_chars=100_000)
        theirs = tok.apply_chat_template(CONVERSATION, **case, **kwargs, tokenize=False)
        assert ours == theirs, case
    assert len({render(tok, CONVERSATION, add_generation_prompt=g, max_chars=10**5) for g in (True, False)}) == 2


def test_the_template_can_still_refuse_a_conversation() -> None:
    with pytest.raises(TemplateError, match="no system"):
        _render("{% if messages[0].role == 'system' %}{{ raise_exception('no system messages') }}{% endif %}")
    with pytest.raises(TemplateError):  # the sandbox still stands
        _render("{{ ''.__class__.__mro__[1].__subclasses__() }}{{ cycler.__init__.__globals__.os.system('id') }}")


@pytest.mark.parametrize(
    "source",
    [
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",  # nothing but loops
        "{% for a in messages * 10000 %}{% for b in messages * 1000 %}{% endfor %}{% endfor %}",  # loops over data
        "{% macro f(n) %}{% for i in range(3) %}{{ f(n + 1) if n < 30 }}{% endfor %}{% endmacro %}{{ f(0) }}",
    ],
)
def test_rendering_stops_at_the_deadline(source: str) -> None:
    t = time.perf_counter()
    with pytest.raises(RenderLimitError, match="took over 0.3 s") as e:
        _render(source, seconds=0.3)
    assert e.value.kind == "time" and time.perf_counter() - t < 1.0


@pytest.mark.parametrize(
    "source",
    [
        "{% for i in range(100000) %}{{ 'y' * 100 }}{% endfor %}",  # the output itself
        "{{ 'x' * 1000000000 }}",  # one repetition
        "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
        "{% macro f(s, n) %}{{ f(s ~ s, n + 1) if n < 60 else s | length }}{% endmacro %}{{ f('ab', 0) }}",
        "{{ range(100000) | join('x' * 99999) }}",
        "{{ 'a' | center(1000000000) }}",
        "{{ 'a' + 'b' * 99999 + 'c' * 99999 }}",
        "{{ 2 ** 100000000 }}",
        "{{ '%999999999d' % 1 }}",
        "{% set a = 'x' * 60000 %}{% set b = a ~ a %}{{ (b ~ b) | upper }}",  # a filter's result
    ],
)
def test_nothing_grows_past_the_cap(source: str) -> None:
    t = time.perf_counter()
    with pytest.raises(RenderLimitError) as e:
        _render(source, max_chars=100_000)
    assert e.value.kind == "size" and time.perf_counter() - t < 0.5


def test_under_the_cap_the_same_template_renders() -> None:
    # Negative control for the two tests above: the bounds, not the templates, stop them.
    assert len(_render("{% for i in range(1000) %}{{ 'y' * 100 }}{% endfor %}")) == 100_000
    assert _render("{{ 'x' * 10 }}{{ range(3) | join('-') }}{{ 2 ** 10 }}") == "xxxxxxxxxx0-1-21024"
    assert _render("{% for i in range(100) %}{% for j in range(100) %}{% endfor %}{% endfor %}done") == "done"


def test_a_departed_client_stops_its_render() -> None:
    cancelled = threading.Event()
    threading.Timer(0.1, cancelled.set).start()
    t = time.perf_counter()
    with pytest.raises(RenderCancelled):
        _render("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", seconds=30,
                cancelled=cancelled)  # fmt: skip
    assert time.perf_counter() - t < 0.5


def test_which_kwargs_a_client_may_pass() -> None:
    assert check_template_kwargs({}) is None
    assert check_template_kwargs({"enable_thinking": False, "reasoning_effort": "low", "builtin_tools": []}) is None
    assert "chat template" in check_template_kwargs({"chat_template": "{{ 1 }}"})
    for key in ("documents", "bos_token", "messages_x", "__class__"):
        assert repr(key) in check_template_kwargs({"enable_thinking": True, key: 1})
    for key in ("add_generation_prompt", "tools", "messages", "continue_final_message"):
        assert "request's own field" in check_template_kwargs({key: True})
    assert str(MAX_KWARGS_CHARS) in check_template_kwargs({"date_string": "x" * MAX_KWARGS_CHARS})


def _held_by_trying_every_prefix(text: str, stop: str) -> int:
    return next((k for k in range(min(len(stop) - 1, len(text)), 0, -1) if text.endswith(stop[:k])), 0)


def test_stop_prefix_holds_back_what_trying_every_prefix_holds_back() -> None:
    rng = random.Random(0)
    for _ in range(300):
        stop = "".join(rng.choice("ab") for _ in range(rng.randrange(1, 8)))
        prefix, text = _StopPrefix(stop), ""
        while len(text) < 40:
            chunk = "".join(rng.choice("abc") for _ in range(rng.randrange(1, 4)))
            text += chunk
            assert prefix.feed(chunk) == _held_by_trying_every_prefix(text, stop), (stop, text)


def test_stop_prefix_is_linear_in_the_text() -> None:
    # Issue 25's shape: a long stop string that the text keeps almost matching. Trying every prefix at every chunk
    # costs O(text x stop) a chunk; fed once, the text costs O(1) a character.
    stop = "a" * 1023 + "b"
    per_char = []
    for n in (20_000, 80_000):
        prefix = _StopPrefix(stop)
        t = time.perf_counter()
        for _ in range(n // 4):
            prefix.feed("aaaa")
        per_char.append((time.perf_counter() - t) / n)
        assert prefix.feed("a") == 1023
    assert per_char[1] < 3 * per_char[0] + 1e-7 and per_char[1] < 5e-6
