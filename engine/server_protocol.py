"""The OpenAI API's request bodies (pydantic models) and error objects, as ``dayzero serve`` reads them.

Fields follow the OpenAI reference (and vLLM's extensions ``top_k``, ``min_p``); fields the server
does not implement are ignored, as OpenAI's own server ignores unknown ones. Range checks that
OpenAI documents (``temperature`` in [0, 2], ``top_p`` in (0, 1], ``n`` >= 1, ...) are pydantic
constraints, so a bad value answers 400 naming the field before anything reaches the engine.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

MAX_TOP_LOGPROBS = 20  # what the engine reports at most (and OpenAI allows)


class APIError(Exception):
    """An error answered to the client as an OpenAI error object with HTTP ``status``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        """``{"error": {"message", "type", "param", "code"}}`` as the OpenAI API sends it."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    """``stream_options``: whether the last chunk of a stream carries ``usage``."""

    include_usage: bool = False


class JSONSchemaFormat(BaseModel):
    """The ``json_schema`` member of ``response_format``."""

    model_config = ConfigDict(populate_by_name=True)
    name: str = "response"
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """``response_format``: free text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class _Sampling(BaseModel):
    """The fields both endpoints share."""

    model_config = ConfigDict(extra="ignore")
    model: StrictStr
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(0, ge=-1)  # vLLM's extension; 0 or -1: off
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: StrictInt | None = Field(None, ge=0, lt=2**32)
    stop: StrictStr | list[StrictStr] | None = None
    n: StrictInt = Field(1, ge=1, le=16)
    ignore_eos: bool = False  # vLLM's extension (benchmarks)
    return_token_ids: bool = False  # vLLM's extension: each choice also lists its token ids
    # Not implemented: refused when set to anything but their neutral value (not silently ignored).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    def check_supported(self) -> None:
        """400 for a field this server accepts by name but does not implement."""
        unsupported = [("presence_penalty", self.presence_penalty != 0), ("frequency_penalty", self.frequency_penalty != 0),
                       ("logit_bias", bool(self.logit_bias)), ("echo", bool(getattr(self, "echo", False)))]
        for name, set_ in unsupported:
            if set_:
                raise APIError(400, f"{name} is not supported by this server; leave it out", param=name)
    response_format: ResponseFormat | None = None

    def stop_strings(self) -> list[str]:
        """``stop`` as a list of non-empty strings."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]


Prompt = Union[StrictStr, list[StrictInt], list[StrictStr], list[list[StrictInt]]]


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: ``prompt`` is text, token ids, or a list of either (a batch)."""

    prompt: Prompt
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request (one unless it is a batch)."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise APIError(400, "prompt is empty; pass text or token ids", param="prompt")
        return list(p)


IMAGE_DETAILS = ("auto", "low", "high")  # OpenAI's ``detail`` values; the model's own preprocessing decides


class ChatMessage(BaseModel):
    """One message of a conversation; ``content`` may be a list of text and ``image_url`` parts."""

    model_config = ConfigDict(extra="ignore")
    role: StrictStr
    content: StrictStr | list[dict[str, Any]] | None = None

    def template_content(self) -> str | list[dict[str, str]]:
        """``content`` as the chat template takes it: the text, or, when the message has images,
        its parts in order as ``{"type": "text", "text"}`` and ``{"type": "image"}`` (where a
        multimodal template writes the image's placeholder)."""
        parts = self._parts()
        if all(part["type"] == "text" for part in parts):
            return "".join(part["text"] for part in parts)
        return [{"type": "image"} if part["type"] == "image_url" else part for part in parts]

    def image_urls(self) -> list[str]:
        """The data URLs of the message's ``image_url`` parts, in order."""
        return [part["url"] for part in self._parts() if part["type"] == "image_url"]

    def _parts(self) -> list[dict[str, str]]:
        """The content as checked parts, ``{"type": "text", "text"}`` and ``{"type": "image_url",
        "url"}``; 400 naming anything else."""
        if self.content is None or isinstance(self.content, str):
            return [{"type": "text", "text": self.content or ""}]
        parts = []
        for part in self.content:
            kind = part.get("type")
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            elif kind == "image_url":
                if self.role != "user":
                    raise APIError(400, f"image_url parts go in user messages only, not in a {self.role!r} "
                                        "message; move the image to a user message", param="messages")
                parts.append({"type": "image_url", "url": _image_url(part.get("image_url"))})
            else:
                raise APIError(400, f"message content part {kind!r} is not supported; send text and image_url "
                                    "parts", param="messages")
        return parts


def _image_url(value: Any) -> str:
    """The data URL of an ``image_url`` part (``{"url", "detail"}`` or the URL alone); 400 for
    a missing or remote URL (the server fetches nothing) or an unknown ``detail``."""
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise APIError(400, 'an image_url part needs {"url": "data:image/png;base64,..."}', param="messages")
    detail = (value.get("detail") or "auto") if isinstance(value, dict) else "auto"
    if detail not in IMAGE_DETAILS:
        raise APIError(400, f"image_url detail {detail!r} is not one of {', '.join(IMAGE_DETAILS)}; send one of "
                            "those or leave it out", param="messages")
    if not url.startswith("data:"):
        shown = url if len(url) <= 100 else url[:100] + "..."
        raise APIError(400, f"image_url {shown!r} is not a data URL: this server fetches nothing over the network "
                            "(nor reads its own files), so only data URLs are accepted; send the image inline as "
                            "data:image/png;base64,<base64 bytes>", param="messages")
    return url


class ChatRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` (the current name) or ``max_tokens`` (the deprecated one)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """A pydantic/FastAPI validation failure as one 400 naming the first bad field."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = [str(part) for part in first.get("loc", ()) if part not in ("body",)]
    if first.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON ({first.get('msg')}); send a JSON object")
    param = ".".join(loc) or None
    value = first.get("input")
    shown = f" (got {value!r})" if value is not None and not isinstance(value, dict) else ""
    return APIError(400, f"{param or 'request'}: {first.get('msg')}{shown}", param=param)
