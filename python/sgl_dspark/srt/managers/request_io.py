"""The scheduler thread's request I/O: `GenerateReqInput` -> `Req` (tokenize, finalise the
sampling parameters, validate) and `Req` -> `GenerateOutput` deltas (detokenized text, new ids,
logprobs). Runs on the scheduler thread only (it owns the tokenizer and the detokenizers)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sgl_dspark.srt.constrained import Grammars
from sgl_dspark.srt.core.req import Req
from sgl_dspark.srt.managers.io_struct import (
    GenerateOutput,
    GenerateReqInput,
    PromptLogprobsOut,
    ReqAccepted,
)
from sgl_dspark.srt.sampling.sampling_params import SamplingParams
from sgl_dspark.srt.tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from sgl_dspark.srt.managers.scheduler import Scheduler
    from sgl_dspark.srt.tokenizer import TokenizerLike

OutQueue = asyncio.Queue  # of SchedulerOutput


@dataclass
class Tracked:
    """A request in flight and what its waiter has been sent so far."""

    req: Req
    out: OutQueue
    return_logprob: bool
    sent_chars: int = 0
    sent_tokens: int = 0
    sent_prompt_logprobs: bool = False


class RequestIO:
    def __init__(
        self, scheduler: Scheduler, tokenizer: TokenizerLike | None, speculative: bool
    ) -> None:
        """`speculative`: outputs carry DSpark's per-request verify counts."""
        self._scheduler = scheduler
        self._tokenizer = tokenizer
        self._speculative = speculative
        cfg = scheduler.cfg
        self._grammars = Grammars(tokenizer, cfg.vocab_size or 0, cfg.eos_token_ids)

    def make_req(self, inp: GenerateReqInput) -> tuple[Req, ReqAccepted]:
        """The request to queue (validated by `Scheduler.add_group`) and its acceptance record.
        Raises ValueError for a request that can never run."""
        ids = self._tokenize(inp)
        p = self._finalise_params(inp, len(ids))
        detok = None
        if self._tokenizer is not None:
            detok = IncrementalDetokenizer(
                self._tokenizer,
                skip_special_tokens=p.skip_special_tokens,
                stop=p.stop,
                no_stop_trim=p.no_stop_trim,
                prompt_ids=ids,
            )
        prompt_text = None
        if inp.return_prompt_text and self._tokenizer is not None:
            prompt_text = self._tokenizer.decode(ids)
        req = Req(
            rid=inp.rid,
            prompt_ids=ids,
            params=p,
            return_logprob=inp.return_logprob,
            logprob_start_len=inp.logprob_start_len,
            top_logprobs_num=inp.top_logprobs_num,
            token_ids_logprob=inp.token_ids_logprob,
            detok=detok,
            queued_at=time.monotonic(),
            grammar=self._grammars.matcher_for(p.grammar),
        )
        return req, ReqAccepted(inp.rid, len(ids), prompt_text)

    def _tokenize(self, inp: GenerateReqInput) -> list[int]:
        if inp.input_ids is not None:
            return list(inp.input_ids)
        if self._tokenizer is None:
            raise ValueError(
                "text and chat prompts need a tokenizer; this server runs with "
                "--skip-tokenizer-init, so send token ids"
            )
        if inp.text is not None:
            return self._tokenizer.encode(inp.text)
        assert inp.messages is not None
        ids = self._tokenizer.apply_chat_template(
            inp.messages,
            add_generation_prompt=True,
            tokenize=True,
            **dict(inp.chat_template_kwargs or {}),
        )
        assert isinstance(ids, list), type(ids)
        return ids

    def _finalise_params(self, inp: GenerateReqInput, num_prompt_ids: int) -> SamplingParams:
        params = inp.sampling_params
        if params.stop and self._tokenizer is None:
            raise ValueError(
                "stop strings need a tokenizer; this server runs with "
                "--skip-tokenizer-init, so use stop_token_ids"
            )
        if not inp.fill_context:
            return params
        sched = self._scheduler
        # The longest sequence the context and, with the executor's step window, the pool allow.
        pages = sched.allocator.num_usable_pages * sched.allocator.page_size
        limit = min(sched.req_pool.max_context_len, pages - sched.executor.step_window)
        if num_prompt_ids >= limit:
            raise ValueError(
                f"the prompt ({num_prompt_ids} tokens) leaves no room for output "
                f"in the context length {limit}"
            )
        return dataclasses.replace(params, max_new_tokens=limit - num_prompt_ids)

    def make_output(self, tracked: Tracked) -> GenerateOutput:
        req = tracked.req
        text = ""
        if req.detok is not None:
            if req.finished:
                req.detok.finish()  # flush held-back text; a no-op after a stop-string match
            text = req.detok.text
        new_ids = tuple(req.output_ids[tracked.sent_tokens :])
        logprobs: tuple[float, ...] = ()
        token_texts: tuple[str, ...] = ()
        if tracked.return_logprob:
            logprobs = tuple(req.output_logprobs[tracked.sent_tokens :])
            if self._tokenizer is not None:
                token_texts = tuple(
                    self._tokenizer.decode([t], skip_special_tokens=False) for t in new_ids
                )
        extras = self._logprob_extras(tracked, new_ids) if tracked.return_logprob else {}
        spec = self._speculative
        delta = text[tracked.sent_chars :]
        tracked.sent_chars = len(text)
        tracked.sent_tokens = len(req.output_ids)
        return GenerateOutput(
            rid=req.rid,
            text=delta,
            token_ids=new_ids,
            logprobs=logprobs,
            token_texts=token_texts,
            prompt_tokens=len(req.prompt_ids),
            completion_tokens=len(req.output_ids),
            finish_reason=req.finish_reason,
            spec_verify_ct=req.spec_verify_ct if spec else None,
            spec_committed=req.spec_committed if spec else None,
            **extras,
        )

    def _logprob_extras(self, tracked: Tracked, new_ids: tuple[int, ...]) -> dict:
        """Top-N / token-id logprobs of the new tokens, the prompt's logprobs once it is done,
        and the texts of every id they name."""
        req = tracked.req
        sent = tracked.sent_tokens
        out: dict = {
            "top_logprobs": tuple(req.output_top_logprobs[sent : sent + len(new_ids)]),
            "token_ids_logprobs": tuple(req.output_token_ids_logprobs[sent : sent + len(new_ids)]),
        }
        ids: set[int] = set(req.token_ids_logprob or ())
        for row in out["top_logprobs"]:
            ids.update(t for t, _ in row)
        if req.wants_prompt_logprobs and req.prefill_done and not tracked.sent_prompt_logprobs:
            tracked.sent_prompt_logprobs = True
            prompt_ids = tuple(req.prompt_ids[req.logprob_start_len :])
            out["prompt_logprobs"] = PromptLogprobsOut(
                prompt_ids,
                tuple(req.input_logprobs),
                tuple(req.input_top_logprobs) if req.top_logprobs_num > 0 else (),
                tuple(req.input_token_ids_logprobs) if req.token_ids_logprob is not None else (),
            )
            ids.update(prompt_ids)
            for top_row in req.input_top_logprobs:
                ids.update(t for t, _ in top_row or ())
        if self._tokenizer is not None and ids:
            out["id_texts"] = {
                t: self._tokenizer.decode([t], skip_special_tokens=False) for t in ids
            }
        return out
