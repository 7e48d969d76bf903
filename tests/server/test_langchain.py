"""LangChain's ChatOpenAI against a real server, as apps already written for vLLM use it: structured output by JSON
schema and by function calling, and bind_tools with a forced call that round-trips through a tool message."""

from typing import Literal

import pytest
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, ConfigDict, Field

from .conftest import Server
from .test_structured_api import tools_model_dir, tools_server  # noqa: F401 (fixtures)


class Forecast(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=8)
    days: int = Field(ge=1, le=14)
    unit: Literal["C", "F"]


@tool(args_schema=Forecast)  # bounded arguments: the random-weight model's strings end within max_tokens
def get_weather(city: str, days: int, unit: Literal["C", "F"]) -> str:
    """The forecast for a city."""
    return f"{city}: sunny for {days} days"


def chat_model(server: Server) -> ChatOpenAI:
    return ChatOpenAI(
        base_url=server.base_url,
        api_key=server.api_key or "none",
        model=server.model,
        temperature=0,
        max_tokens=120,
        max_retries=0,
        timeout=120,
    )


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output(tools_server: Server, method: str) -> None:  # noqa: F811
    out = chat_model(tools_server).with_structured_output(Forecast, method=method).invoke("weather in Oslo?")
    assert isinstance(out, Forecast), out


def test_bind_tools_forced_call_round_trips(tools_server: Server) -> None:  # noqa: F811
    question = HumanMessage("weather in Oslo?")
    call = chat_model(tools_server).bind_tools([get_weather], tool_choice="get_weather", strict=True).invoke([question])
    assert len(call.tool_calls) == 1 and call.tool_calls[0]["name"] == "get_weather", call
    args = call.tool_calls[0]["args"]
    assert set(args) == {"city", "days", "unit"} and args["unit"] in ("C", "F"), args
    result = ToolMessage(get_weather.invoke(args), tool_call_id=call.tool_calls[0]["id"])
    reply = chat_model(tools_server).bind_tools([get_weather], tool_choice="none").invoke([question, call, result])
    assert isinstance(reply.content, str) and not reply.tool_calls, reply
