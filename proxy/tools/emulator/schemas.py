"""Request validation, mirroring the parts of vLLM's pydantic request models the emulator uses.

Unknown fields are ignored (vLLM's ``extra="allow"``); known fields of the wrong type are a 400.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

_INT64 = 2**63 - 1
_M = TypeVar("_M", bound=BaseModel)


class RequestError(ValueError):
    """A request the emulator answers with an error body (HTTP status = code)."""

    def __init__(
        self,
        message: str,
        *,
        code: int = 400,
        err_type: str = "BadRequestError",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.err_type = err_type
        self.param = param


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class RepetitionDetection(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    max_pattern_size: int = Field(default=0, ge=0)
    min_pattern_size: int = Field(default=0, ge=0)
    min_count: int = Field(default=3, ge=2)


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    n: int = Field(default=1, ge=1, le=128)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    presence_penalty: float | None = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    seed: int | None = Field(default=None, ge=-_INT64 - 1, le=_INT64)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    request_id: str | None = None
    ignore_eos: bool = False
    repetition_detection: RepetitionDetection | None = None
    stop: str | list[str] | None = None
    cache_salt: str | None = Field(default=None, min_length=1)


class ChatRequest(_Common):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=0, ge=-1)
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=-1)
    echo: bool | None = False


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = True  # the emulator's tokenizer has no special tokens
    return_token_strs: bool = False


def validation_error(exc: ValidationError) -> RequestError:
    """vLLM answers pydantic validation failures with a 400 BadRequestError."""
    errors = exc.errors()
    first = ".".join(str(p) for p in errors[0]["loc"]) if errors else None
    parts = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in errors]
    return RequestError(
        f"{len(errors)} validation error(s) for request: " + "; ".join(parts), param=first
    )


def parse(cls: type[_M], body: dict[str, Any]) -> _M:
    try:
        return cls.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


# What the emulator's template ends a prompt with for the model to answer; a template that
# drops assistant reasoning opens the reasoning there (EmulatorConfig.template_drops_reasoning).
GENERATION_PROMPT = "\nassistant:"
OPENING_GENERATION_PROMPT = "\nassistant:<think>\n"
REASONING_END = "</think>"
# transformers' apply_chat_template (vLLM renders with it) when the template cut the final
# message it was asked to continue; vLLM answers 400 with it.
FINAL_MESSAGE_CUT = (
    "continue_final_message is set but the final message does not appear in the chat after"
    " applying the chat template! This can happen if the chat template deletes portions of the"
    " final message. Please verify the chat template and final message in your chat to ensure"
    " they are compatible."
)


def render_messages(
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    drops_reasoning: bool = False,
) -> str:
    """Render chat messages to one prompt string (role + content per message): the emulator's
    chat template. An assistant message's ``reasoning`` (``reasoning_content``: vLLM renames
    it) renders before its content between the markers, as templates that keep it do (Qwen3).
    ``continue_final_message``: the last message left open, no generation prompt;
    ``drops_reasoning``: an assistant message renders as what follows its ``</think>``, its
    ``reasoning`` dropped (DeepSeek-R1's distills, QwQ), so a final message holding reasoning
    cannot be continued (transformers' error, vLLM's 400)."""
    lines: list[str] = []
    final = ""
    for msg in messages:
        role = msg.get("role")
        if not isinstance(role, str):
            raise RequestError("Each message must have a string `role`.", param="messages")
        content = msg.get("content")
        if isinstance(content, list):
            text = " ".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
        elif content is None or isinstance(content, str):
            text = content or ""
        else:
            raise RequestError("Message `content` must be a string or a list.", param="messages")
        final = text
        if drops_reasoning and role == "assistant" and REASONING_END in text:
            text = text.split(REASONING_END)[-1]
        reasoning = message_reasoning(msg) if role == "assistant" else None
        if reasoning and not drops_reasoning:
            text = f"<think>\n{reasoning.strip(chr(10))}\n{REASONING_END}\n\n{text}"
        lines.append(f"{role}: {text}")
    rendered = "\n".join(lines)
    if continue_final_message:
        if final.strip() not in rendered:
            raise RequestError(FINAL_MESSAGE_CUT, param="messages")
        return rendered
    if not add_generation_prompt:
        return rendered
    return rendered + (OPENING_GENERATION_PROMPT if drops_reasoning else GENERATION_PROMPT)


def message_reasoning(message: dict[str, Any]) -> str | None:
    """The reasoning field of an input message (``reasoning``, else ``reasoning_content``)."""
    for key in ("reasoning", "reasoning_content"):
        value = message.get(key)
        if isinstance(value, str) and value:
            return value
    return None


def answer_after_reasoning(prompt: str) -> str:
    """What the last turn of a rendered prompt holds after its closed reasoning (a continued
    content); "" when nothing, or no reasoning closed."""
    turn = prompt.rpartition(GENERATION_PROMPT.strip("\n"))[2]
    _, end, tail = turn.rpartition(REASONING_END)
    return tail.lstrip("\n") if end else ""


def closed_reasoning_in(prompt: str) -> str | None:
    """The reasoning the last turn of a rendered prompt closes (what follows is the answer):
    between its last ``<think>`` and ``</think>``; None when the turn closes none."""
    turn = prompt.rpartition(GENERATION_PROMPT.strip("\n"))[2]
    head, end, _ = turn.rpartition(REASONING_END)
    if not end:
        return None
    return head.rpartition("<think>")[2].strip("\n")


def completion_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str]:
    """The prompts of a completions request as strings (token-id prompts joined as ids)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise RequestError("Prompt cannot be empty.", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [" ".join(str(p) for p in prompt)]
    out: list[str] = []
    for p in prompt:
        if isinstance(p, str):
            out.append(p)
        elif isinstance(p, list):
            out.append(" ".join(str(t) for t in p))
        else:
            raise RequestError("Invalid prompt.", param="prompt")
    return out
