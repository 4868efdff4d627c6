"""The shapes of OpenAI's requests (checked strictly), its error object, and the chat template.

Request bodies are validated by pydantic in strict mode: a number where a string belongs, a
string where a number belongs, NaN, an unknown field — each is a 400 with OpenAI's error object
`{"error": {"message", "type", "param", "code"}}`, never a 5xx.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

# OpenAI takes 4 stop strings; evaluation harnesses send a task's own and the tokenizer's EOS
# uncapped (lm-evaluation-harness often 5), and local servers take more. This bounds the work each
# generated token costs the server.
MAX_STOP = 64
MAX_CHOICES = 16
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts
MAX_BODY_BYTES = 2 * 1024 * 1024  # larger bodies get 413

COMPLETIONS, CHAT_COMPLETIONS = "/v1/completions", "/v1/chat/completions"  # the routes that generate

# The plain-text chat template for base models: one "Role: content" line per message, then
# "Assistant:" for the model to continue. Generation also stops where the model starts the
# next turn itself.
ROLE_NAMES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant"}
CHAT_STOPS = ("\nUser:", "\nSystem:")


class APIError(Exception):
    """An error answered with OpenAI's error object and an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid_value(param: str, why: str) -> APIError:
    """A 400 for a request field whose value is refused (OpenAI's invalid_value error)."""
    return APIError(400, f"Invalid value for '{param}': {why}", param=param, code="invalid_value")


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool | None = None


class JSONSchemaFormat(_Strict):
    """response_format's json_schema: what openai's `parse(response_format=Model)` sends."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, populate_by_name=True)
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's structured_outputs (v0.12 on): one of a JSON Schema, a regex, choices, a grammar (Lark or GBNF)."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, populate_by_name=True)
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _Sampling(_Strict):
    """Fields completions and chat share. None means the default."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=1)  # extension
    repetition_penalty: float | None = Field(None, gt=0)  # extension
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored, as OpenAI's abuse-monitoring id
    # what the text must be: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value):
        stops = [value] if isinstance(value, str) else value
        if stops is not None:
            if len(stops) > MAX_STOP:
                raise ValueError(f"at most {MAX_STOP} stop strings, got {len(stops)}")
            if any(s == "" for s in stops):
                raise ValueError("stop strings must not be empty")
        return value

    def check(self) -> None:
        """Rules between fields (pydantic checks each field alone)."""
        if self.stream_options is not None and not self.stream:
            raise invalid_value("stream_options", "only allowed when stream is true")
        fmt = self.response_format
        if fmt is not None and (fmt.type == "json_schema") != (fmt.json_schema is not None):
            raise invalid_value("response_format.json_schema", "given with type json_schema, and only then")

    @property
    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(_Sampling):
    prompt: str | Annotated[list[str], Field(min_length=1)] | Annotated[list[int], Field(min_length=1)] | Annotated[
        list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1)
    ]
    # 0 generates nothing: with echo and logprobs, that scores the prompt (as evaluation harnesses do);
    # without echo the text is empty and finish_reason "length", as OpenAI answers it
    max_tokens: int | None = Field(None, ge=0)
    echo: bool | None = None
    logprobs: int | None = Field(None, ge=0, le=5)
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES)

    def check(self) -> None:
        super().check()
        if self.suffix:
            raise invalid_value("suffix", "insertion is not supported by tinygpt's decoder-only models")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise invalid_value("best_of", "supported only equal to n")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON, as OpenAI sends it


class ToolCall(_Strict):
    id: str
    type: Literal["function"]
    function: FunctionCall


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], Field(min_length=1)] | None = None
    name: str | None = None
    tool_calls: Annotated[list[ToolCall], Field(min_length=1)] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool's result: the call it answers

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


MAX_TOOLS = 128


class ChatRequest(_Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid_value("top_logprobs", "requires logprobs to be true")
        calls: set[str] = set()
        for i, m in enumerate(self.messages):
            if m.content is None and not (m.role == "assistant" and m.tool_calls):
                param = f"messages.{i}.content"
                raise APIError(400, f"Missing required parameter: '{param}'", param=param,
                               code="missing_required_parameter")
            if m.tool_calls and m.role != "assistant":
                raise invalid_value(f"messages.{i}.tool_calls", "only an assistant's message makes tool calls")
            if m.role == "tool" and m.tool_call_id not in calls:
                raise invalid_value(f"messages.{i}.tool_call_id", f"{m.tool_call_id!r} answers no tool call of an "
                                    "earlier assistant message" if m.tool_call_id else "a tool's result names the call "
                                    "it answers")
            calls.update(c.id for c in m.tool_calls or ())
        names = [t.function.name for t in self.tools or ()]
        choice = self.tool_choice
        if choice == "required" and not names:
            raise invalid_value("tool_choice", "'required' needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise invalid_value("tool_choice", f"names the function {choice.function.name!r}, which is not among "
                                "the tools" + (f" ({', '.join(names)})" if names else " (none given)"))

    @property
    def tool_mode(self) -> str:
        """none, auto, required or named: what tool_choice asks (auto where tools are given without it)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or ("auto" if self.tools else "none")


class AttentionRequest(_Strict):
    """tinygpt's own: one head's attention weights over a text."""

    model: str
    prompt: str
    layer: int = Field(0, ge=0)
    head: int = Field(0, ge=0)


def chat_prompt(messages: list[Message]) -> str:
    """The plain-text chat template: "Role: content" lines, ending with "Assistant:".

    >>> chat_prompt([Message(role="system", content="Be brief."), Message(role="user", content="Hi")])
    'System: Be brief.\\nUser: Hi\\nAssistant:'
    """
    lines = [f"{ROLE_NAMES[m.role]}: {m.text}" for m in messages]
    return "\n".join(lines) + "\nAssistant:"


# Messages for fields that take one of several JSON types (pydantic reports each alternative).
_UNION_HELP = {
    "prompt": "must be a string, an array of strings, an array of token ids or an array of arrays of token ids",
    "stop": "must be a string or an array of strings",
    "content": "must be a string or an array of text parts ({\"type\": \"text\", \"text\": ...})",
}
_TYPE_TAGS = {"str", "int", "float", "bool", "none", "dict", "list"}


def _is_tag(item) -> bool:
    """pydantic puts the name of the union member it tried into `loc` ('list[int]', 'TextPart')."""
    return isinstance(item, str) and ("[" in item or item in _TYPE_TAGS or item[:1].isupper())


def validation_error(error: ValidationError) -> APIError:
    """The first problem of a failed validation as a 400 in OpenAI's shape."""
    e = error.errors(include_url=False)[0]
    kind, loc = e["type"], e["loc"]
    path = [p for p in loc if not _is_tag(p)]
    param = ".".join(str(p) for p in path) or None
    msg = e["msg"].removeprefix("Value error, ")
    if kind == "json_invalid":
        return APIError(400, f"The request body is not valid JSON: {msg}", code="invalid_json")
    if kind in ("model_type", "model_attributes_type") and not path:
        return APIError(400, "The request body must be a JSON object", code="invalid_json")
    if kind == "missing":
        return APIError(400, f"Missing required parameter: '{param}'", param=param, code="missing_required_parameter")
    if kind == "extra_forbidden":
        return APIError(400, f"Unrecognized request argument supplied: {param}", param=param,
                        code="unknown_parameter")
    if len(path) < len(loc):  # a union: one message for the field rather than one per alternative
        field = next((str(p) for p in reversed(path) if isinstance(p, str)), "")
        help_text = _UNION_HELP.get(field)
        if help_text and kind.endswith("_type"):
            return APIError(400, f"Invalid type for '{param}': {help_text}", param=param, code="invalid_type")
    code = "invalid_type" if kind.endswith("_type") or kind == "literal_error" else "invalid_value"
    if param is None:
        return APIError(400, f"Invalid request: {msg}", code=code)
    return APIError(400, f"Invalid value for '{param}': {msg}", param=param, code=code)


__all__ = [
    "APIError", "AttentionRequest", "ChatRequest", "CompletionRequest", "Message", "ValidationError",
    "chat_prompt", "validation_error", "CHAT_STOPS",
]
