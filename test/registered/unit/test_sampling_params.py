"""SamplingParams: SGLang defaults, normalisation, and field-named validation errors."""

from __future__ import annotations

import math

import pytest
from sgl_dspark.srt.sampling import SamplingParams


def test_defaults_match_sglang():
    p = SamplingParams()
    assert p.max_new_tokens == 128
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (1.0, 1.0, -1, 0.0)
    assert p.stop == () and p.stop_token_ids == ()
    assert p.ignore_eos is False and p.skip_special_tokens is True and p.no_stop_trim is False
    assert p.n == 1 and p.seed is None
    assert (p.frequency_penalty, p.presence_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert not p.is_greedy


@pytest.mark.parametrize("temperature", [0, 0.0, 1e-9])
def test_zero_temperature_normalises_to_top_k_1(temperature):
    p = SamplingParams.from_dict({"temperature": temperature, "top_k": 50})
    assert p.is_greedy and p.top_k == 1 and p.temperature == 1.0


@pytest.mark.parametrize("kwargs", [{"top_k": 1}, {"top_k": 1, "temperature": 0.7}])
def test_top_k_1_is_greedy(kwargs):
    assert SamplingParams(**kwargs).is_greedy


@pytest.mark.parametrize("kwargs", [{"temperature": 0.5}, {"top_k": 2}, {"top_p": 0.1}])
def test_sampled_is_not_greedy(kwargs):
    assert not SamplingParams(**kwargs).is_greedy


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, ()), ("</s>", ("</s>",)), (["a", "bc"], ("a", "bc")), (("x",), ("x",))],
)
def test_stop_normalised_to_tuple(value, expected):
    assert SamplingParams(stop=value).stop == expected
    assert SamplingParams.from_dict({"stop": value}).stop == expected


def test_from_dict_round_trip_and_int_to_float():
    d = {
        "max_new_tokens": 7,
        "temperature": 2,
        "top_p": 0.25,
        "top_k": 40,
        "min_p": 0.125,
        "stop": ["x"],
        "stop_token_ids": [3, 9],
        "ignore_eos": True,
        "skip_special_tokens": False,
        "no_stop_trim": True,
        "n": 3,
        "seed": 1234,
    }
    p = SamplingParams.from_dict(d)
    assert isinstance(p.temperature, float) and p.temperature == 2.0
    assert p.stop_token_ids == (3, 9)
    assert SamplingParams.from_dict(p.to_dict()) == p
    for key, value in d.items():
        got = getattr(p, key)
        assert (tuple(value) if isinstance(value, list) else value) == got, key


def test_from_dict_null_means_default():
    assert (
        SamplingParams.from_dict({"temperature": None, "seed": None, "stop": None})
        == SamplingParams()
    )


def test_unknown_keys_rejected_by_name():
    with pytest.raises(ValueError, match="tempreature.*top_pp|top_pp.*tempreature"):
        SamplingParams.from_dict({"tempreature": 1.0, "top_pp": 0.5})
    with pytest.raises(ValueError, match="object"):
        SamplingParams.from_dict([("temperature", 1.0)])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_new_tokens", -1),
        ("max_new_tokens", 1.5),
        ("max_new_tokens", "8"),
        ("max_new_tokens", True),
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", "hot"),
        ("temperature", True),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_p", -0.5),
        ("top_p", math.nan),
        ("top_k", 0),
        ("top_k", -2),
        ("top_k", 2.0),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("min_p", math.nan),
        ("n", 0),
        ("n", 1.0),
        ("seed", -1),
        ("seed", 2**63),
        ("seed", 1.0),
        ("stop", ""),
        ("stop", [""]),
        ("stop", ["a", 3]),
        ("stop", 5),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", [1.0]),
        ("stop_token_ids", 7),
        ("ignore_eos", 1),
        ("skip_special_tokens", "yes"),
        ("no_stop_trim", 0),
    ],
)
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams.from_dict({field: value})
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize(
    ("field", "value"),
    [("frequency_penalty", 0.5), ("presence_penalty", -1.0), ("repetition_penalty", 1.1)],
)
def test_penalties_accepted_and_adjust_logits(field, value):
    p = SamplingParams.from_dict({field: value})
    assert getattr(p, field) == value and p.adjusts_logits


def test_logit_bias_keys_and_range():
    p = SamplingParams.from_dict({"logit_bias": {"7": 2.5, 9: -100, "07": 1.0}})
    assert p.logit_bias == ((7, 1.0), (9, -100.0))  # "07" and "7" name one token: the last wins
    assert SamplingParams.from_dict(p.to_dict()) == p
    for bad, match in (
        ({"x": 1.0}, "logit_bias keys"),
        ({"-1": 1.0}, "logit_bias keys"),
        ({"5": 100.5}, r"logit_bias values must be in \[-100, 100\]"),
        ({"5": "1"}, "logit_bias values must be a number"),
        ([1, 2], "logit_bias must be an object"),
    ):
        with pytest.raises(ValueError, match=match):
            SamplingParams.from_dict({"logit_bias": bad})


def test_min_new_tokens_bounded_by_max_new_tokens():
    assert SamplingParams(max_new_tokens=4, min_new_tokens=4).min_new_tokens == 4
    with pytest.raises(ValueError, match=r"min_new_tokens must be in \[0, max_new_tokens \(4\)\]"):
        SamplingParams(max_new_tokens=4, min_new_tokens=5)
    with pytest.raises(ValueError, match="min_new_tokens"):
        SamplingParams(min_new_tokens=-1)


def test_one_grammar_at_most():
    p = SamplingParams(regex="a+")
    assert p.grammar == ("regex", "a+") and p.adjusts_logits
    assert SamplingParams(json_schema="").grammar is None  # empty means none, as in SGLang
    with pytest.raises(ValueError, match="regex cannot be combined with json_schema"):
        SamplingParams(json_schema="{}", regex="a+")
    with pytest.raises(ValueError, match="ebnf must be a str"):
        SamplingParams.from_dict({"ebnf": 3})


def test_neutral_penalties_accepted():
    p = SamplingParams.from_dict(
        {"frequency_penalty": 0, "presence_penalty": 0.0, "repetition_penalty": 1}
    )
    assert p.repetition_penalty == 1.0 and isinstance(p.repetition_penalty, float)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("top_p", 1.0),
        ("top_p", 1e-6),
        ("top_k", 1),
        ("top_k", 10**6),
        ("min_p", 0.0),
        ("min_p", 1.0),
        ("max_new_tokens", 0),
        ("seed", 0),
        ("seed", 2**63 - 1),
        ("n", 16),
    ],
)
def test_boundary_values_accepted(field, value):
    assert getattr(SamplingParams.from_dict({field: value}), field) == value


def test_frozen():
    p = SamplingParams()
    with pytest.raises(AttributeError):
        p.temperature = 0.5  # type: ignore[misc]


def test_every_field_has_a_validation_rule():
    from dataclasses import fields

    from sgl_dspark.srt.sampling.sampling_params import FIELD_RULES

    assert [f.name for f in fields(SamplingParams)] == list(FIELD_RULES)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        # SGLang's ranges (SamplingParams.verify)
        ("frequency_penalty", 2.5, r"frequency_penalty must be in \[-2, 2\]"),
        ("presence_penalty", -2.01, r"presence_penalty must be in \[-2, 2\]"),
        ("repetition_penalty", 0.0, r"repetition_penalty must be in \(0, 2\]"),
        ("repetition_penalty", 2.5, r"repetition_penalty must be in \(0, 2\]"),
        ("top_p", 1e-400, r"top_p must be in \(0, 1\]"),  # parses to 0.0
        ("stop", ["x"] * 33, "stop may hold at most 32 strings"),
        # Our own, stricter
        ("stop", "x" * 1025, "at most 1024 characters"),
        ("stop_token_ids", list(range(1025)), "at most 1024 ids"),
        ("temperature", 10**400, "temperature must be finite"),
        ("top_p", -(10**400), "top_p must be finite"),
        ("seed", 2**64, r"seed must be in \[0, 2\*\*63\)"),
    ],
)
def test_ranges_of_sglang_and_our_stricter_ones(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams.from_dict({field: value})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("top_k", 2**63),  # past the vocabulary means off
        ("top_k", 10**30),
        ("temperature", 1e300),
        ("temperature", 1e-300),  # greedy
        ("top_p", 5e-324),
        ("min_p", 1e-300),
        ("max_new_tokens", 10**30),  # refused later against the context length
        ("stop", ["x"] * 32),
        ("stop", "x" * 1024),
        ("stop_token_ids", list(range(1024))),
    ],
)
def test_extreme_values_inside_the_ranges_accepted(field, value):
    SamplingParams.from_dict({field: value})


def test_messages_stay_short_for_huge_values():
    with pytest.raises(ValueError) as err:
        SamplingParams.from_dict({"stop_token_ids": [-1] * 1000})
    assert len(str(err.value)) < 200
    with pytest.raises(ValueError) as err:
        SamplingParams.from_dict({f"k{i}" * 100: 1 for i in range(50)})
    assert len(str(err.value)) < 400
