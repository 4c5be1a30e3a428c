"""``POST /v1/completions``."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from colibri_backend.backends import LoadedModel
from colibri_backend.server.errors import bad_value
from colibri_backend.server.generation import admit, check_prompt_chars, check_request, tokenize_off_loop
from colibri_backend.server.responses import CompletionChoice, respond
from colibri_backend.server.schemas import (
    MAX_N,
    MAX_TOP_LOGPROBS,
    Completion,
    CompletionRequest,
    openapi_body,
    parse_request,
    responses_for,
)
from colibri_backend.server.security import require_api_key

router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])

_PROMPT_SHAPES = (
    "prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids, "
    "and not empty"
)


def _check_unsupported(req: CompletionRequest, n: int) -> None:
    if req.echo:
        raise bad_value("echo is not supported", "echo")
    if req.suffix:
        raise bad_value("suffix (insertion) is not supported", "suffix")
    if req.best_of is not None and req.best_of != n:
        raise bad_value("best_of is not supported (use n)", "best_of")


def _check_ids(model: LoadedModel, prompts: list[list[int]]) -> None:
    vocab = getattr(getattr(model, "info", None), "n_vocab", None) or getattr(model, "n_vocab", None)
    if not vocab:
        return
    for ids in prompts:
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise bad_value(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", "prompt")


@router.post(
    "/completions",
    openapi_extra=openapi_body(CompletionRequest),
    responses=responses_for(Completion, Completion),
)
async def completions(request: Request) -> Response:
    state = request.app.state.colibri
    req = await parse_request(request, CompletionRequest)
    checked = check_request(state, req, "prompt")
    model = checked.model
    _check_unsupported(req, checked.n)
    logprobs = req.logprobs
    if logprobs is not None:
        if not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise bad_value(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}", "logprobs")
        if not model.capabilities.logprobs:
            raise bad_value(f"backend {checked.slot.cfg.backend!r} does not report logprobs", "logprobs")
    prompt = req.prompt
    texts: list[str] = []
    if isinstance(prompt, str):
        texts = [prompt]
    elif prompt and all(isinstance(x, str) for x in prompt):
        texts = list(prompt)
    elif prompt and all(isinstance(x, int) for x in prompt):
        prompts = [list(prompt)]
    elif prompt and all(isinstance(x, list) for x in prompt):
        prompts = [list(x) for x in prompt]
    else:
        raise bad_value(_PROMPT_SHAPES, "prompt")
    if texts:
        check_prompt_chars(state, checked, sum(len(t) for t in texts))
        prompts = await tokenize_off_loop(lambda: [model.tokenize(t) for t in texts])
    _check_ids(model, prompts)
    if len(prompts) * checked.n > MAX_N:
        raise bad_value(f"at most {MAX_N} completions per request (prompts x n)", "n")
    prepared = admit(state, checked, prompts, logprobs, req)
    return await respond(state, prepared, request, req.model, CompletionChoice)
