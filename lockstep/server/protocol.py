"""Request bodies of the OpenAI API (the fields lockstep reads), validated with pydantic, and error bodies.

Types are strict: no coercion, so ``"max_tokens": "4"``, ``"n": true`` or ``"stream": "yes"`` is a 400 (an int
is still a valid float); numbers must be finite, and integers fit in 64 bits. Unknown fields are accepted and
ignored, as OpenAI-compatible servers do, except the parameters of OpenAI's and vLLM's APIs that lockstep cannot
honour (``UNHONOURED``, and ``best_of`` > n, ``suffix``): set to anything that changes the answer, they are
rejected with 400 rather than silently ignored. Besides OpenAI's fields, vLLM's sampling extensions ``top_k``,
``min_p``, ``repetition_penalty``, ``ignore_eos``, ``min_tokens``, ``stop_token_ids``, ``include_stop_str_in_output``,
``skip_special_tokens``, ``spaces_between_special_tokens``, ``prompt_logprobs``, ``truncate_prompt_tokens``,
``truncation_side``, ``return_token_ids``, ``return_tokens_as_token_ids``, ``allowed_token_ids``, ``bad_words``,
``use_beam_search`` and ``length_penalty`` are read (the openai client sends them
through ``extra_body``).
"""

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

MAX_N = 128
# Stop conditions are checked at every step of a request (the strings on the event loop, the ids on the engine
# thread): OpenAI's 4 strings, each at most 1024 characters (the text held back while it might begin one is
# bounded by it), and at most 1024 stop token ids.
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_BAD_WORDS = 128  # as token sequences the engine caps them the same (layers/token_bans.py)
MAX_ROLE_CHARS = 64
MAX_TOKEN_ID_DIGITS = 10  # a logit_bias key: no vocabulary has 10**10 tokens
INT64_MAX = 2**63 - 1
STRICT = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class APIError(Exception):
    """An error answered with an OpenAI-style body: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# Parameters of OpenAI's and vLLM's APIs that lockstep does not honour: a request that sets one to anything but
# null or a value that changes nothing (listed) gets a 400 naming it, rather than an answer that ignored it. A name
# leaves these tables when a request model declares (and honours) it. Fields that change nothing in the output
# (user, store, metadata, service_tier, prediction, parallel_tool_calls, cache_salt, request_id, ...) are accepted
# and ignored, as unknown fields are.
UNHONOURED: dict[str, tuple] = {
    "functions": ([],),
    "function_call": ("none", "auto"),
    "modalities": (["text"],),
    "audio": (),
    "reasoning_effort": (),
    "web_search_options": (),
    "logits_processors": ([],),
    "guided_decoding_backend": (),
    "guided_whitespace_pattern": (),
    "logprob_token_ids": ([],),
    "prompt_embeds": (),
    "priority": (0,),
}
CHAT_UNHONOURED = UNHONOURED | {
    "add_special_tokens": (False,),
    "chat_template": (),
    "documents": (),
}
COMPLETION_UNHONOURED = UNHONOURED | {"add_special_tokens": (True,)}


# Fields whose default, when a request leaves them out (or sends null), may come from the model's
# generation_config.json (``LLMEngine.default_sampling``), as in vLLM.
GENERATION_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, each chunk carries the usage so far


class StructuredOutputsBody(BaseModel):
    """vLLM's ``structured_outputs`` object; keys it cannot honour (``structural_tag``, ...) are a 400."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    json_: dict | str | bool | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None


class JSONSchemaFormat(BaseModel):
    model_config = STRICT

    name: str = "response"
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: text, any JSON object, or JSON that follows a schema."""

    model_config = STRICT

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class _Request(BaseModel):
    model_config = STRICT

    model: str
    n: int = Field(1, ge=1, le=MAX_N)
    max_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, le=INT64_MAX)
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)  # int64 or uint64
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens tokens whatever comes
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: dict | str | None = None  # vLLM's older spellings of structured_outputs
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's other sampling extensions, with SamplingParams' meanings.
    min_tokens: int = Field(0, ge=0, le=INT64_MAX)
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT64_MAX)]] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # vLLM's: the top N logprobs at each prompt position (and the prompt token's own), returned in vLLM's shape.
    # (-1: the whole vocabulary; the engine's max_logprobs, vLLM's --max-logprobs, caps them: requests.py)
    prompt_logprobs: int | None = Field(None, ge=-1, le=INT64_MAX)
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT64_MAX)  # keep the last k (-1: all that fit)
    truncation_side: Literal["left", "right"] | None = None  # vLLM's: "right" keeps the first k instead
    return_token_ids: bool = False  # vLLM's: the prompt's and the choices' token ids in the reply
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs name each token "token_id:N"
    # vLLM's: choose only from these ids; never end a banned word (SamplingParams' meanings, layers/token_bans.py)
    allowed_token_ids: list[Annotated[int, Field(ge=0, le=INT64_MAX)]] | None = None
    bad_words: list[str] | None = Field(None, max_length=MAX_BAD_WORDS)
    # vLLM's beam search: n is the beam width (server/beam.py)
    use_beam_search: bool = False
    length_penalty: float = 1.0

    unhonoured: ClassVar[dict[str, tuple]] = UNHONOURED

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data):
        # A null sampling field counts as left out, so the server's default (the model's generation config) applies.
        if isinstance(data, dict) and any(data.get(k, 0) is None for k in GENERATION_FIELDS):
            data = {k: v for k, v in data.items() if not (k in GENERATION_FIELDS and v is None)}
        return data

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
            raise ValueError(f"stop must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them")
        long = next((s for s in stops if len(s) > MAX_STOP_CHARS), None)
        if long is not None:
            raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters, got {len(long)}")
        return stops

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _check_truncate(cls, v):
        if v == 0:
            raise ValueError("truncate_prompt_tokens must be -1 (as many as fit) or a number of tokens >= 1")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, v):
        # OpenAI's keys are token ids written as strings: ASCII digits ("²".isdigit() is true, int() refuses it).
        for k in v or {}:
            if not (k.isascii() and k.isdigit() and len(k) <= MAX_TOKEN_ID_DIGITS):
                raise ValueError(f"logit_bias keys must be token ids (strings of digits 0-9), got {k[:50]!r}")
        return v

    @field_validator("temperature", "top_p", "presence_penalty", "frequency_penalty", mode="before")
    @classmethod
    def _none_is_default(cls, v, info):
        defaults = {"temperature": 1.0, "top_p": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
        return defaults[info.field_name] if v is None else v

    def unsupported(self) -> list[str]:
        """The parameters set that lockstep cannot honour (``UNHONOURED``)."""
        extra = self.model_extra or {}
        bad = [
            name
            for name, neutral in self.unhonoured.items()
            if extra.get(name) is not None and not any(_same(extra[name], v) for v in neutral)
        ]
        return bad

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """vLLM's ``continuous_usage_stats``: the usage so far in every chunk (only with ``include_usage``)."""
        return self.include_usage and self.stream_options.continuous_usage_stats


def _same(a: object, b: object) -> bool:
    """``a == b`` with JSON's types: ``true`` is not ``1``."""
    return type(a) is type(b) and a == b or (type(a), type(b)) in ((int, float), (float, int)) and a == b


def _prompt_kind(v: object) -> str | None:
    """Which of the prompt's forms ``v`` is, judged by its first element: pydantic then validates that form only
    (a plain union tries each, and collects an error per element for each that fails: ~10x slower)."""
    if isinstance(v, str):
        return "text"
    if not isinstance(v, list):
        return None
    first = v[0] if v else 0
    return {str: "texts", list: "id_lists"}.get(type(first), "ids")


Prompt = Annotated[
    Annotated[str, Tag("text")]
    | Annotated[list[str], Tag("texts")]
    | Annotated[list[int], Tag("ids")]
    | Annotated[list[list[int]], Tag("id_lists")],
    Discriminator(
        _prompt_kind,
        custom_error_type="prompt_type",
        custom_error_message="the prompt must be a string, a list of strings, a list of token ids or a list of "
        "lists of token ids",
    ),
]


class CompletionRequest(_Request):
    prompt: Prompt
    max_tokens: int | None = Field(16, ge=0, le=INT64_MAX)  # 0 only with echo: the prompt (and its logprobs) alone
    logprobs: int | None = Field(None, ge=-1, le=INT64_MAX)  # -1: the whole vocabulary (within --max-logprobs)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: str | None = None

    unhonoured: ClassVar[dict[str, tuple]] = COMPLETION_UNHONOURED

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        if self.best_of is not None and self.best_of != self.n:
            bad.append("best_of")
        if self.suffix:
            bad.append("suffix")
        return bad


class FunctionCall(BaseModel):
    model_config = STRICT

    name: str
    arguments: str


class ToolCall(BaseModel):
    """A tool call of an earlier assistant message, as the API returned it."""

    model_config = STRICT

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = STRICT

    # OpenAI's roles, or any other the chat template accepts (vLLM's custom roles: the template decides)
    role: str = Field(min_length=1, max_length=MAX_ROLE_CHARS)
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    reasoning_content: str | None = None  # assistant (vLLM's): dropped from the prompt, as vLLM does

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(
                    f"unsupported type {part.get('type')!r} of a content part: text parts are supported, and "
                    "image_url parts for a vision-language model"
                )
            parts.append(part["text"])
        return "".join(parts)


class FunctionDefinition(BaseModel):
    model_config = STRICT

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = STRICT

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = STRICT

    name: str


class NamedToolChoice(BaseModel):
    model_config = STRICT

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=-1, le=INT64_MAX)  # -1: the whole vocabulary (within --max-logprobs)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: extra variables for the chat template
    # vLLM's: the image processor's min_pixels / max_pixels for this request's images (server/images.py bounds them)
    mm_processor_kwargs: dict[str, Any] | None = None
    # vLLM's template controls: render without the assistant's opening, or continue the final message as it is;
    # echo puts the final message's content before the reply's when the reply continues that role.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False

    @model_validator(mode="after")
    def _one_template_mode(self) -> "ChatCompletionRequest":
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError(
                "cannot set both continue_final_message and add_generation_prompt to true (the default): send "
                "add_generation_prompt false to continue the final message"
            )
        return self

    @property
    def response_role(self) -> str:
        """The reply's role, as vLLM's: the assistant's after a generation prompt, else the final message's."""
        return "assistant" if self.add_generation_prompt else self.messages[-1].role

    unhonoured: ClassVar[dict[str, tuple]] = CHAT_UNHONOURED
