"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's shapes): what a prompt is as tokens, and back.

``/tokenize`` takes a completions-style ``prompt`` (text, or token ids) or a chat request's ``messages`` (with
its ``tools``, ``response_format`` and thinking options), encoded exactly as those routes encode them, and
answers ``{"count", "max_model_len", "tokens"}``; a prompt longer than the context is reported, not refused.
``add_special_tokens: false`` leaves out the BOS a text ``prompt`` would get (a chat prompt's BOS is part of its
encoding and stays).
``/detokenize`` takes ``{"tokens": [...]}`` and answers ``{"prompt": text}`` (special tokens kept).
``GET /tokenizer_info`` answers the tokenizer's special tokens, whether a text prompt gets a BOS and the context
(vLLM's endpoint, which lm-evaluation-harness's remote tokenizer reads before it tokenizes through ``/tokenize``).
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from .completion import check_ids
from .errors import invalid
from .prepare import json_body, offload
from .routes_openai import chat_prompt, completion_prompts
from .schemas import ChatRequest, CompletionRequest, DetokenizeRequest

router = APIRouter()


def _validated(model: type[BaseModel], body: dict) -> BaseModel:
    """``body`` as ``model``; a failure is the same 400 a route's own body would get."""
    try:
        return model.model_validate(body)
    except ValidationError as err:
        raise RequestValidationError(err.errors(), body=body) from None


@router.post("/tokenize")
async def tokenize(request: Request, body: dict = Depends(json_body(dict))):
    server = request.app.state.server
    tokens = await offload(request, _tokens, server, body)
    return {"count": len(tokens), "max_model_len": server.engine.max_context, "tokens": tokens}


def _tokens(server, body: dict) -> list[int]:
    add_special_tokens = body.get("add_special_tokens", True)
    if not isinstance(add_special_tokens, bool):
        raise invalid("add_special_tokens: expected a boolean", "add_special_tokens")
    if "messages" in body:
        _, tokens, _, _ = chat_prompt(server, _validated(ChatRequest, body))
    elif "prompt" in body:
        prompts = completion_prompts(server, _validated(CompletionRequest, {**body, "max_tokens": 1}))
        if len(prompts) != 1:
            raise invalid("prompt: expected one prompt (text or token ids)", "prompt")
        tokens = prompts[0]
        check_ids(server, tokens, "prompt")
    else:
        raise invalid("expected a 'prompt' (text or token ids) or chat 'messages'", "prompt")
    return tokens


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request):
    server = request.app.state.server
    tok = server.engine.tokenizer
    eos = tok.decode([tok.eos_id])
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tok.decode([tok.bos_id]),
        "eos_token": eos,
        "pad_token": eos,
        "add_bos_token": True,  # a text prompt's, as /v1/completions and /tokenize give it by default
        "model_max_length": server.engine.max_context,
    }


@router.post("/detokenize")
async def detokenize(request: Request, body: DetokenizeRequest = Depends(json_body(DetokenizeRequest))):
    server = request.app.state.server
    check_ids(server, body.tokens, "tokens")
    return {"prompt": server.engine.tokenizer.decode(body.tokens)}
