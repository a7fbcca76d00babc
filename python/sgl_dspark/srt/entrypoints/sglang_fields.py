"""Request fields of SGLang 0.5.23 that this server accepts without acting on them.

SGLang's clients send fields that have no meaning for a single-node, text-only server without
LoRA, sessions or disaggregation (`lora_path: null`, `bootstrap_room`, `extra_key`, ...). Each
such field has a policy here:

- *inert*: any value is accepted and has no effect on what is generated (routing hints, cache
  keys, priorities, metric labels); logged at debug level;
- *neutral only*: the field would change the result (a LoRA adapter, a custom logit processor,
  images, a beam search), so only its neutral value (null, false, 0, empty) is accepted, and any
  other value is a 400 that names the field and says why.

Fields that are neither implemented nor listed here are unknown. They behave as in SGLang 0.5.23:
ignored at the top level of `/generate` and of the OpenAI bodies (SGLang's schemas ignore unknown
keys there; a debug line names them), refused inside `sampling_params` (by `SamplingParams`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sgl_dspark.srt.entrypoints.api_errors import ApiError
from sgl_dspark.srt.sampling.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def is_neutral(value: Any) -> bool:
    """null, false, 0, an empty string/list/object, or a list (one entry per prompt) of those."""
    if value is None or value is False:
        return True
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value == 0
    if isinstance(value, (str, dict)):
        return not value
    if isinstance(value, list):
        return all(is_neutral(v) for v in value)
    return False


@dataclass(frozen=True)
class FieldPolicy:
    """`accepts(value)`: whether the value runs here; `why`: what the field does in SGLang and
    why it has no effect here, or why other values are refused."""

    why: str
    accepts: Callable[[Any], bool] = is_neutral


def _inert(why: str) -> FieldPolicy:
    return FieldPolicy(why, lambda value: True)


def _neutral(why: str) -> FieldPolicy:
    return FieldPolicy(why)


def _rank_zero(value: Any) -> bool:
    return value is None or value == 0


_LORA = _neutral("this server serves no LoRA adapters")
_LOGIT_PROCESSOR = _neutral("custom logit processors are not supported")
_MULTIMODAL = _neutral("the model is text-only")
_SESSION = _neutral("sessions are not supported")
_HIDDEN = _neutral("hidden states are not returned")
_DISAGG = _inert("prefill/decode disaggregation: this server runs both phases itself")
_DP_RANK = FieldPolicy(
    "this server has one data-parallel rank (0)", lambda value: _rank_zero(value)
)
_CACHE_KEY = _inert("a prefix-cache key; this server keeps no prefix cache across requests")
_ROUTING = _inert("a routing or logging hint with no effect on the output")
_PRIORITY = _inert("requests are scheduled first come, first served")

# Top-level fields of SGLang's `GenerateReqInput` (/generate) that are not implemented.
GENERATE_FIELDS: dict[str, FieldPolicy] = {
    "lora_path": _LORA,
    "lora_id": _LORA,
    "custom_logit_processor": _LOGIT_PROCESSOR,
    "session_id": _SESSION,
    "session_params": _SESSION,
    "image_data": _MULTIMODAL,
    "video_data": _MULTIMODAL,
    "audio_data": _MULTIMODAL,
    "input_embeds": _MULTIMODAL,
    "mm_hashes": _MULTIMODAL,
    "modalities": _MULTIMODAL,
    "images_config": _MULTIMODAL,
    "video_config": _MULTIMODAL,
    "mm_processor_kwargs": _MULTIMODAL,
    "use_audio_in_video": _MULTIMODAL,
    "return_hidden_states": _HIDDEN,
    "return_routed_experts": _neutral("routed experts are not returned"),
    "routed_experts_start_len": _inert("used only with return_routed_experts"),
    "return_indexer_topk": _neutral("indexer top-k selections are not returned"),
    "return_entropy": _neutral("entropies are not returned"),
    "return_bytes": _neutral("token bytes are not returned"),
    "return_sampling_mask": _neutral("sampling masks are not returned"),
    "return_flat_raw_top_logprobs": _neutral("flat raw top logprobs are not returned"),
    "return_flat_raw_output_top_logprobs": _neutral("flat raw top logprobs are not returned"),
    "return_prompt_token_ids": _neutral("prompt token ids are not returned"),
    "require_reasoning": _neutral("reasoning is not forced by this server"),
    "max_thinking_tokens": _neutral("thinking budgets are not supported"),
    "kv_hints": _neutral("KV hints are not supported"),
    "positional_embed_overrides": _neutral("positional embedding overrides are not supported"),
    "multi_item_delimiter_indices": _neutral("multi-item scoring is not supported"),
    "token_indices_to_pool": _neutral("pooling is not supported"),
    "watermark": _neutral("watermarking is not supported"),
    "background": _neutral("background requests are not supported"),
    "bootstrap_host": _DISAGG,
    "bootstrap_port": _DISAGG,
    "bootstrap_room": _DISAGG,
    "bootstrap_pair_key": _DISAGG,
    "decode_tp_size": _DISAGG,
    "disagg_prefill_dp_rank": _DISAGG,
    "routed_dp_rank": _DP_RANK,
    "data_parallel_rank": _DP_RANK,
    "extra_key": _CACHE_KEY,
    "cache_salt": _CACHE_KEY,
    "priority": _PRIORITY,
    "routing_key": _ROUTING,
    "conversation_id": _ROUTING,
    "custom_labels": _ROUTING,
    "log_metrics": _ROUTING,
    "no_logs": _ROUTING,
    "external_trace_header": _ROUTING,
    "received_time": _ROUTING,
    "http_worker_ipc": _ROUTING,
}

# Fields of SGLang's OpenAI `CompletionRequest` / `ChatCompletionRequest` that are not
# implemented (the sampling extensions are forwarded to `SamplingParams`: SAMPLING_EXTENSIONS).
OPENAI_FIELDS: dict[str, FieldPolicy] = {
    **{
        name: GENERATE_FIELDS[name]
        for name in (
            "lora_path",
            "custom_logit_processor",
            "session_id",
            "session_params",
            "images_config",
            "video_config",
            "mm_processor_kwargs",
            "use_audio_in_video",
            "return_hidden_states",
            "return_routed_experts",
            "routed_experts_start_len",
            "return_prompt_token_ids",
            "return_sampling_mask",
            "return_flat_raw_output_top_logprobs",
            "watermark",
            "bootstrap_host",
            "bootstrap_port",
            "bootstrap_room",
            "disagg_prefill_dp_rank",
            "routed_dp_rank",
            "data_parallel_rank",
            "extra_key",
            "cache_salt",
            "priority",
            "custom_labels",
        )
    },
    "rid": _inert("request ids of OpenAI requests are chosen by the server"),
    "return_cached_tokens_details": _inert("no prefix cache: zero cached tokens"),
    "return_spec_tokens_details": _inert("speculative statistics are in /server_info"),
    "return_token_ids": _neutral("token ids are not returned on the OpenAI routes"),
    "return_meta_info": _neutral("meta_info is returned on /generate"),
    "return_input_ids_in_sglext": _neutral("input ids are not returned on the OpenAI routes"),
    "return_output_ids_in_sglext": _neutral("output ids are not returned on the OpenAI routes"),
    "sampling_logprobs_mode": _neutral("logprobs are those of the model's distribution"),
    "max_dynamic_patch": _MULTIMODAL,
    "min_dynamic_patch": _MULTIMODAL,
    "task": _inert("a prompt label with no effect on the output"),
}

# SGLang's names of sampling extensions on its OpenAI routes -> their `sampling_params` names.
# They are forwarded as they are; `SamplingParams` implements them or answers 400.
SAMPLING_EXTENSIONS: dict[str, str] = {
    "min_tokens": "min_new_tokens",
    "json_schema": "json_schema",
    "regex": "regex",
    "ebnf": "ebnf",
    "stop_regex": "stop_regex",
    "custom_params": "custom_params",
}

# Keys of SGLang's `sampling_params` with no effect on what is generated here, removed before
# `SamplingParams` sees them; `sampling_seed` is SGLang's name of `seed`.
SAMPLING_INERT: dict[str, FieldPolicy] = {
    "spaces_between_special_tokens": _inert(
        "the tokenizers decode special tokens with their own spacing"
    ),
    "stream_interval": _inert("every step's new text is streamed"),
    "beam_width": FieldPolicy("beam search is not supported", lambda v: v in (None, 0, 1)),
    "choice": _neutral("choice-constrained decoding is not supported"),
    "watermark": _neutral("watermarking is not supported"),
}
SAMPLING_RENAMES: dict[str, str] = {"sampling_seed": "seed"}
# Every key of SGLang 0.5.23's `sampling_params`. Those `SamplingParams` does not implement are
# accepted at their neutral value (SGLang's frontend sends `min_new_tokens: 0`, `regex: null`,
# `stop_regex: []`, ... with every request) and otherwise passed on, to be refused there.
SGLANG_SAMPLING_KEYS = frozenset(
    {
        "max_new_tokens",
        "stop",
        "stop_token_ids",
        "stop_regex",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "min_new_tokens",
        "n",
        "json_schema",
        "regex",
        "ebnf",
        "structural_tag",
        "ignore_eos",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "no_stop_trim",
        "stream_interval",
        "logit_bias",
        "sampling_seed",
        "custom_params",
        "beam_width",
        "watermark",
        "choice",
    }
)
_IMPLEMENTED_SAMPLING_KEYS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def check_fields(
    extras: Mapping[str, Any] | None,
    policies: Mapping[str, FieldPolicy],
    where: str,
    prefix: str = "",
) -> None:
    """Apply `policies` to the fields of a body that its model does not implement: inert and
    neutral values are logged (debug) and dropped, unknown fields ignored as SGLang does, and a
    value that would change the result raises a 400 naming the field."""
    for name, value in (extras or {}).items():
        policy = policies.get(name)
        if policy is None:
            logger.debug("%s: ignoring the unknown field %r (as SGLang does)", where, name[:80])
        elif policy.accepts(value):
            logger.debug("%s: field %r has no effect here: %s", where, name, policy.why)
        else:
            shown = repr(value)
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            raise ApiError(
                400,
                f"{prefix}{name}={shown} is not supported by this server: {policy.why}",
                param=f"{prefix}{name}",
            )


def sampling_dict(values: Mapping[str, Any], where: str) -> dict[str, Any]:
    """SGLang `sampling_params` -> the keys `SamplingParams.from_dict` takes: SGLang's renamed
    keys mapped, inert keys checked and dropped, every other key kept (unknown ones are refused
    there, as in SGLang)."""
    if not isinstance(values, Mapping):
        return values  # type: ignore[return-value]  # from_dict words the error
    out: dict[str, Any] = {}
    inert: dict[str, Any] = {}
    for key, value in values.items():
        if key in SAMPLING_INERT:
            inert[key] = value
        elif key in SAMPLING_RENAMES:
            target = SAMPLING_RENAMES[key]
            if values.get(target) is not None and value is not None:
                raise ApiError(400, f"send one of {key} and {target}", param=key)
            if value is not None:
                out[target] = value
        elif (
            key in SGLANG_SAMPLING_KEYS
            and key not in _IMPLEMENTED_SAMPLING_KEYS
            and is_neutral(value)
        ):
            logger.debug("%s: sampling_params.%s=%r is the neutral value", where, key, value)
        else:
            out[key] = value
    check_fields(inert, SAMPLING_INERT, where, prefix="sampling_params.")
    return out
