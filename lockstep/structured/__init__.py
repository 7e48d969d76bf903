"""Structured outputs (JSON schema, regex, choice, grammar) and tool calls."""

from lockstep.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
