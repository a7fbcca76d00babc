"""SGLang's native `POST /generate` and `POST /abort_request`.

Output per prompt, as `Engine.generate`: `{"text", "output_ids", "meta_info": {"id",
"prompt_tokens", "completion_tokens", "finish_reason", "e2e_latency", and with `return_logprob`
SGLang's logprob keys (`logprob_format.py`)}}`; a list for a batch. Streaming sends, as SGLang
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
from sgl_dspark.srt.entrypoints.logprob_format import LogprobOptions, sglang_logprob_meta
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
    logprobs: LogprobOptions | None,
    return_text: bool,
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
    if logprobs is not None and res is not None:
        meta.update(_logprob_meta(res, logprobs, return_text))
    return meta


def _logprob_meta(res: SubResult, options: LogprobOptions, return_text: bool) -> dict[str, Any]:
    texts: dict[int, str] | None = None
    if return_text:
        texts = dict(res.id_texts)
        texts.update(zip(res.token_ids, res.token_texts))
    prompt = res.prompt_logprobs
    return sglang_logprob_meta(
        output_ids=res.token_ids,
        output_logprobs=res.logprobs,
        output_top=res.top_logprobs,
        output_token_ids=res.token_ids_logprobs,
        input_ids=prompt.token_ids if prompt else (),
        input_logprobs=prompt.logprobs if prompt else (),
        input_top=prompt.top if prompt else (),
        input_token_ids=prompt.token_ids_values if prompt else (),
        top_logprobs_num=options.top_logprobs_num,
        token_ids_logprob=options.token_ids_logprob,
        texts=texts,
    )


def _logprob_options(body: GenerateRequest, count: int) -> list[LogprobOptions | None]:
    """Per prompt, SGLang's logprob options (None without return_logprob); a list value gives
    one per prompt."""
    if not body.return_logprob:
        return [None] * count
    starts = _per_prompt(body.logprob_start_len, count, "logprob_start_len")
    tops = _per_prompt(body.top_logprobs_num, count, "top_logprobs_num")
    ids = body.token_ids_logprob
    if ids is not None and (not ids or isinstance(ids[0], int)):
        ids_list: list[Any] = [ids] * count
    else:
        ids_list = _per_prompt(ids, count, "token_ids_logprob")
    out: list[LogprobOptions | None] = []
    for start, top, token_ids in zip(starts, tops, ids_list):
        try:
            out.append(LogprobOptions.parse(True, start, top, token_ids))
        except ValueError as exc:
            raise ApiError(400, str(exc), param=str(exc).split(" ", 1)[0]) from None
    return out


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
    logprob_options = _logprob_options(body, len(prompts))
    return_text = bool(body.return_text_in_logprobs)
    built: dict[int, SamplingParams] = {}  # one record per distinct object: a shared dict once
    for (text, ids), sp, rid, lp_options in zip(prompts, sp_list, rids, logprob_options):
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
                logprob_start_len=lp_options.logprob_start_len if lp_options else -1,
                top_logprobs_num=lp_options.top_logprobs_num if lp_options else 0,
                token_ids_logprob=lp_options.token_ids_logprob if lp_options else None,
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
                    lp_options,
                    return_text,
                    start,
                    sim,
                ),
            }
            for inp, r, lp_options in zip(inputs, results, logprob_options)
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
                    logprob_options[i],
                    return_text,
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
