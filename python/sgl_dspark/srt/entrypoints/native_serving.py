"""SGLang's native `POST /generate` and `POST /abort_request`.

Output per prompt, as `Engine.generate`: `{"text", "output_ids", "meta_info": {"id",
"prompt_tokens", "completion_tokens", "finish_reason", ["output_token_logprobs": [[logprob,
token_id, token_text], ...]], "e2e_latency"}}`; a list for a batch. Streaming sends, as SGLang
does, the CUMULATIVE text and output ids so far in every event (plus "index" in a batch), then
`[DONE]`.

`max_new_tokens: 0` runs the prompt through prefill only and returns no tokens (SGLang's
prompt pre-caching, as `few_shot_gsm8k` sends it). SGLang's fields that have no meaning here are
handled by `sglang_fields.py`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from sgl_dspark.srt.entrypoints.api_errors import ApiError
from sgl_dspark.srt.entrypoints.openai_protocol import GenerateRequest
from sgl_dspark.srt.entrypoints.request_group import (
    GroupStreamingResponse,
    RequestGroup,
    ServingContext,
    SubResult,
    make_sampling_params,
    new_rid,
    parse_body,
    sse,
    stream_events,
)
from sgl_dspark.srt.entrypoints.sglang_fields import GENERATE_FIELDS, check_fields, sampling_dict
from sgl_dspark.srt.managers.io_struct import GenerateReqInput
from sgl_dspark.srt.sampling.sampling_params import SamplingParams


class AbortRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    rid: str


def _prompts(body: GenerateRequest) -> tuple[list[tuple[str | None, list[int] | None]], bool]:
    """(text, ids) per prompt and whether the request was a single prompt."""
    if (body.text is None) == (body.input_ids is None):
        raise ApiError(400, "send exactly one of 'text' and 'input_ids'", param="text")
    items: list[tuple[str | None, list[int] | None]]
    if body.text is not None:
        single = isinstance(body.text, str)
        texts: list[str] = [body.text] if isinstance(body.text, str) else body.text
        param = "text"
        items = [(t, None) for t in texts]
    else:
        ids = body.input_ids
        assert ids is not None
        single = not ids or isinstance(ids[0], int)
        batch = [ids] if single else ids
        param = "input_ids"
        items = [(None, list(x)) for x in batch]  # type: ignore[arg-type]
    if not items:
        raise ApiError(400, f"{param} must not be an empty batch", param=param)
    for i, (text, ids_) in enumerate(items):
        if not (text or ids_):
            where = param if single else f"{param}[{i}]"
            raise ApiError(400, f"{where} must not be empty", param=param)
    return items, single


def _per_prompt(value: Any, count: int, param: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != count:
            raise ApiError(
                400, f"{param} has {len(value)} entries for {count} prompts", param=param
            )
        return value
    return [value] * count


def _meta(
    rid: str,
    prompt_tokens: int,
    completion_tokens: int,
    finish_reason: Any,
    res: SubResult | None,
    return_logprob: bool,
    start: float,
    simulated_accept_len: float | None = None,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": rid,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "finish_reason": finish_reason,
        "e2e_latency": time.perf_counter() - start,
    }
    if res is not None and res.spec_verify_ct is not None:
        meta["spec_verify_ct"] = res.spec_verify_ct
        meta["spec_accept_length"] = (
            (res.spec_committed or 0) / res.spec_verify_ct if res.spec_verify_ct else 0.0
        )
    if simulated_accept_len is not None:
        # Benchmark-only mode: the tokens are not the model's output.
        meta["spec_simulated_accept_len"] = simulated_accept_len
    if return_logprob and res is not None:
        texts: list[str | None] = list(res.token_texts) or [None] * len(res.token_ids)
        meta["output_token_logprobs"] = [
            [lp, t, s] for lp, t, s in zip(res.logprobs, res.token_ids, texts)
        ]
    return meta


async def generate(ctx: ServingContext, request: Request) -> Response:
    start = time.perf_counter()
    body = await parse_body(request, GenerateRequest)
    check_fields(body.model_extra, GENERATE_FIELDS, "/generate")
    prompts, single = _prompts(body)
    sp_list = _per_prompt(body.sampling_params, len(prompts), "sampling_params")
    rids = (
        _per_prompt(body.rid, len(prompts), "rid")
        if body.rid is not None
        else [new_rid() for _ in prompts]
    )
    if len(set(rids)) != len(rids):
        raise ApiError(400, "rid values must be unique", param="rid")
    inputs = []
    return_logprob = bool(body.return_logprob)
    built: dict[int, SamplingParams] = {}  # one record per distinct object: a shared dict once
    for (text, ids), sp, rid in zip(prompts, sp_list, rids):
        params = built.get(id(sp))
        if params is None:
            params = make_sampling_params(
                sampling_dict(sp or {}, "/generate"), default_param="sampling_params"
            )
            built[id(sp)] = params
        if params.n != 1:
            raise ApiError(
                400,
                "sampling_params.n > 1 is not supported on /generate; send the "
                "prompt several times (or use n on /v1/completions)",
                param="n",
            )
        inputs.append(
            GenerateReqInput(
                rid=rid,
                sampling_params=params,
                text=text,
                input_ids=ids,
                return_logprob=return_logprob,
            )
        )
    param = "text" if body.text is not None else "input_ids"
    sim = ctx.args.speculative_dspark_simulate_accept_len
    group = RequestGroup(ctx, request, "/generate", inputs, param)

    if not body.stream:
        async with group:
            await group.start()
            results = await group.collect()
        outs = [
            {
                "text": r.text,
                "output_ids": r.token_ids,
                "meta_info": _meta(
                    inp.rid,
                    r.accepted.prompt_tokens,
                    r.completion_tokens,
                    r.finish_reason,
                    r,
                    return_logprob,
                    start,
                    sim,
                ),
            }
            for inp, r in zip(inputs, results)
        ]
        return JSONResponse(outs[0] if single else outs)

    accepted = await group.start()

    async def events() -> AsyncIterator[str]:
        results = [SubResult(acc) for acc in accepted]
        async for i, out in group.outputs():
            res = results[i]
            res.add(out)
            event: dict[str, Any] = {
                "text": res.text,
                "output_ids": res.token_ids,
                "meta_info": _meta(
                    out.rid,
                    out.prompt_tokens,
                    out.completion_tokens,
                    out.finish_reason,
                    res,
                    return_logprob,
                    start,
                    sim,
                ),
            }
            if not single:
                event["index"] = i
            yield sse(event)

    return GroupStreamingResponse(stream_events(group, events), group)


async def abort_request(ctx: ServingContext, request: Request) -> Response:
    body = await parse_body(request, AbortRequest)
    ctx.loop.abort(body.rid)
    return JSONResponse({})
