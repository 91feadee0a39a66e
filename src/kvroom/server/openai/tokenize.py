"""vLLM's ``/tokenize`` and ``/detokenize``, in its request and response shapes.

``POST /tokenize`` takes ``{"prompt": str, "add_special_tokens": true}`` or a chat
``{"messages": [...], "add_generation_prompt": true, "add_special_tokens": false}`` and answers
``{"count", "max_model_len", "tokens", "token_strs"}`` (``token_strs`` with
``"return_token_strs": true``). ``POST /detokenize`` takes ``{"tokens": [...]}`` and answers
``{"prompt": str}``. Tokenizing runs in the tokenizer pool, as for generation requests.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field

from kvroom.server.openai.prompts import chat_prompt_ids, check_token_ids, encode_text
from kvroom.server.openai.protocol import ApiError, ChatMessage, _Request
from kvroom.server.openai.serving import ServerState, json_response

router = APIRouter()


class TokenizeCompletionRequest(_Request):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_Request):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


@router.post("/tokenize")
async def tokenize(
    body: TokenizeCompletionRequest | TokenizeChatRequest, request: Request
) -> Response:
    async with request.app.state.kvroom_models.lease(body.model) as s:
        return await _tokenize(s, body)


async def _tokenize(
    s: ServerState, body: TokenizeCompletionRequest | TokenizeChatRequest
) -> Response:
    if isinstance(body, TokenizeChatRequest):
        if body.continue_final_message:
            raise ApiError(
                400, "'continue_final_message' is not supported", param="continue_final_message"
            )
        messages = [m.as_template_input() for m in body.messages]
        ids = await chat_prompt_ids(s, messages, body.add_generation_prompt)
    else:
        ids = await encode_text(s, body.prompt, "prompt", body.add_special_tokens)
    strs = None
    if body.return_token_strs:
        strs = s.tokenizers.loop_tokenizer.convert_ids_to_tokens(ids)
    return json_response(
        TokenizeResponse(count=len(ids), max_model_len=s.max_seq_len, tokens=ids, token_strs=strs)
    )


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
    async with request.app.state.kvroom_models.lease(body.model) as s:
        check_token_ids(s, body.tokens, "tokens")
        return json_response(DetokenizeResponse(prompt=await s.tokenizers.decode(body.tokens)))
