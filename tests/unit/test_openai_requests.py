"""OpenAI request bodies -> GenerationRequest, without processes: what is accepted, what each
field becomes, and that a refused request names its field exactly as gRPC would."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import pytest
from sarathi_proto import generate_pb2

from controller.api_request import RequestLimits, to_generation_request
from controller.openai_api.errors import ApiError
from controller.openai_api.validation import parse_chat, parse_completion
from controller.scheduler import InvalidRequestError
from controller.tokenizer import Tokenizer
from tests.unit.test_tokenizer import make_tokenizer

MODEL = "tiny"


def make_limits(tokenizer: Tokenizer) -> RequestLimits:
    assert tokenizer.eos_token_id is not None
    return RequestLimits(
        vocab_size=tokenizer.vocab_size,
        default_max_tokens=16,
        max_stop_strings=2,
        max_stop_string_chars=8,
        eos_token_ids=frozenset({tokenizer.eos_token_id}),
    )


def completion(**fields: Any) -> Any:
    tokenizer = make_tokenizer()
    body = {"model": MODEL, "prompt": "the Paris", **fields}
    return parse_completion(body, MODEL, make_limits(tokenizer), tokenizer)


def chat(**fields: Any) -> Any:
    tokenizer = make_tokenizer()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}
    return parse_chat(body, MODEL, make_limits(tokenizer), tokenizer)


def test_completion_prompt_is_tokenized_like_the_grpc_prompt() -> None:
    tokenizer = make_tokenizer()
    parsed = completion(prompt="the Paris 日本", max_tokens=5, temperature=0, seed=7)
    grpc = to_generation_request(
        generate_pb2.GenerateRequest(prompt="the Paris 日本"),
        make_limits(tokenizer),
        tokenizer.encode_prompt,
    )
    assert parsed.generation.prompt_token_ids == grpc.prompt_token_ids
    params = parsed.generation.params
    assert params.max_tokens == 5
    assert params.sampling.temperature == 0.0 and params.sampling.seed == 7
    assert params.stop_token_ids == frozenset({tokenizer.eos_token_id})
    assert not parsed.stream and not parsed.include_usage
    assert parsed.generation.request_id.startswith("cmpl-")


def test_unset_fields_take_openai_defaults() -> None:
    params = completion().generation.params
    assert params.sampling.temperature == 1.0  # OpenAI samples unless told temperature=0
    assert params.sampling.top_p == 1.0
    assert params.max_tokens == 16  # OpenAI's and vLLM's completions default


def test_completions_default_to_16_tokens_and_chat_to_the_servers_default() -> None:
    tokenizer = make_tokenizer()
    limits = dataclasses.replace(make_limits(tokenizer), default_max_tokens=300)
    body = {"model": MODEL, "prompt": "the Paris"}
    assert parse_completion(body, MODEL, limits, tokenizer).generation.params.max_tokens == 16
    chat_body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    assert parse_chat(chat_body, MODEL, limits, tokenizer).generation.params.max_tokens == 300


def test_unknown_fields_are_logged_once_per_name(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="controller.openai_api.bodies"):
        for _ in range(3):
            completion(max_tokens=2, frobnicate=1, user="someone")
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == ["request field 'frobnicate' is not supported and was ignored"]


def test_token_id_prompts_and_one_element_batches_are_one_prompt() -> None:
    assert completion(prompt=[5, 6, 7]).generation.prompt_token_ids == [5, 6, 7]
    assert completion(prompt=[[5, 6]]).generation.prompt_token_ids == [5, 6]
    assert (
        completion(prompt=["the"]).generation.prompt_token_ids
        == completion(prompt="the").generation.prompt_token_ids
    )


def test_chat_messages_go_through_the_chat_template() -> None:
    tokenizer = make_tokenizer()
    parts = [{"type": "text", "text": "the "}, {"type": "text", "text": "Paris"}]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": parts}]
    parsed = chat(messages=messages)
    rendered = tokenizer.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the Paris"}]
    )
    assert rendered.endswith("<|im_start|>assistant\n")
    assert parsed.generation.prompt_token_ids == tokenizer.encode(
        rendered, add_special_tokens=False
    )
    assert parsed.generation.request_id.startswith("chatcmpl-")


def test_a_single_user_message_matches_grpc_apply_chat_template() -> None:
    tokenizer = make_tokenizer()
    grpc = to_generation_request(
        generate_pb2.GenerateRequest(prompt="hi", apply_chat_template=True),
        make_limits(tokenizer),
        tokenizer.encode_prompt,
    )
    assert chat().generation.prompt_token_ids == grpc.prompt_token_ids


def test_stream_options_stop_strings_and_extensions_are_honoured() -> None:
    tokenizer = make_tokenizer()
    parsed = chat(
        stream=True,
        stream_options={"include_usage": True},
        stop="\n\n",
        ignore_eos=True,
        top_k=3,
        max_completion_tokens=9,
    )
    assert parsed.stream and parsed.include_usage
    assert parsed.generation.stop == ("\n\n",)
    assert tokenizer.eos_token_id not in parsed.generation.params.stop_token_ids
    assert parsed.generation.params.sampling.top_k == 3
    assert parsed.generation.params.max_tokens == 9


@pytest.mark.parametrize(
    ("fields", "field_name"),
    [
        ({"n": 200}, "n"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"seed": -1}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"stop": ["a", "b", "c"]}, "stop"),
        ({"stop": "much too long"}, "stop"),
        ({"stop": 5}, "stop"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [1, 99999]}, "prompt"),
        ({"prompt": ["one", "two"]}, "prompt"),
        ({"prompt": {"text": "x"}}, "prompt"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": "yes"}, "stream"),
        ({"echo": "yes"}, "echo"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"best_of": 0}, "best_of"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": "x"}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"99999": 1}}, "logit_bias"),
        ({"logit_bias": {"1": 101}}, "logit_bias"),
        ({"logit_bias": [1]}, "logit_bias"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"stop_token_ids": [99999]}, "stop_token_ids"),
    ],
)
def test_bad_completion_fields_get_400_naming_the_field(
    fields: dict[str, Any], field_name: str
) -> None:
    with pytest.raises(ApiError) as err:
        completion(**fields)
    assert err.value.status_code == 400
    assert err.value.param == field_name
    assert err.value.message.startswith(f"{field_name}: ")


@pytest.mark.parametrize(
    ("fields", "field_name"),
    [
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content",
        ),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"logprobs": 3}, "logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ],
)
def test_bad_chat_fields_get_400_naming_the_field(fields: dict[str, Any], field_name: str) -> None:
    with pytest.raises(ApiError) as err:
        chat(**fields)
    assert err.value.status_code == 400
    assert err.value.param == field_name


def test_a_model_without_chat_template_refuses_chat_naming_messages() -> None:
    tokenizer = make_tokenizer(chat_template=None)
    body = {"messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(ApiError) as err:
        parse_chat(body, MODEL, make_limits(tokenizer), tokenizer)
    assert err.value.status_code == 400 and err.value.param == "messages"
    assert "chat template" in err.value.message


def test_another_model_name_is_404_naming_model() -> None:
    with pytest.raises(ApiError) as err:
        completion(model="gpt-4o")
    assert err.value.status_code == 404 and err.value.param == "model"
    assert "tiny" in err.value.message  # says what is served instead


def test_a_body_that_is_not_an_object_is_400() -> None:
    tokenizer = make_tokenizer()
    with pytest.raises(ApiError) as err:
        parse_completion(["prompt"], MODEL, make_limits(tokenizer), tokenizer)
    assert err.value.status_code == 400


@pytest.mark.parametrize(
    ("http_fields", "sampling", "stop"),
    [
        ({"temperature": -1.0}, generate_pb2.SamplingParams(temperature=-1.0), []),
        ({"top_p": 1.5}, generate_pb2.SamplingParams(top_p=1.5), []),
        ({"top_k": -4}, generate_pb2.SamplingParams(top_k=-4), []),
        ({"stop": ["a", "b", "c"]}, generate_pb2.SamplingParams(), ["a", "b", "c"]),
    ],
)
def test_http_and_grpc_refuse_with_the_same_message(
    http_fields: dict[str, Any], sampling: generate_pb2.SamplingParams, stop: list[str]
) -> None:
    tokenizer = make_tokenizer()
    with pytest.raises(InvalidRequestError) as grpc_err:
        to_generation_request(
            generate_pb2.GenerateRequest(prompt="the", sampling=sampling, stop=stop),
            make_limits(tokenizer),
            tokenizer.encode_prompt,
        )
    with pytest.raises(ApiError) as http_err:
        completion(prompt="the", **http_fields)
    assert http_err.value.message == str(grpc_err.value)
    assert http_err.value.param == grpc_err.value.field


def test_logprobs_ask_for_the_tokens_own_and_that_many_alternatives() -> None:
    assert completion(logprobs=3).generation.params.sampling.top_logprobs == 3
    assert completion(logprobs=0).generation.params.sampling.top_logprobs == 0
    assert completion().generation.params.sampling.top_logprobs is None
    assert chat(logprobs=True).generation.params.sampling.top_logprobs == 0
    assert chat(logprobs=True, top_logprobs=5).generation.params.sampling.top_logprobs == 5
    assert chat(logprobs=False).generation.params.sampling.top_logprobs is None
    grpc = generate_pb2.GenerateRequest(prompt_token_ids=[1, 2], logprobs=4)
    request = to_generation_request(grpc, make_limits(make_tokenizer()), lambda t, c: [1])
    assert request.params.sampling.top_logprobs == 4


def test_penalties_reach_the_sampling_params_on_both_apis() -> None:
    sampling = completion(
        presence_penalty=0.5, frequency_penalty=-1, repetition_penalty=1.1,
        logit_bias={"7": -100, "3": 2.5}, min_tokens=2,
    ).generation.params.sampling  # fmt: skip
    assert (sampling.presence_penalty, sampling.frequency_penalty) == (0.5, -1.0)
    assert sampling.repetition_penalty == 1.1 and sampling.min_tokens == 2
    assert sampling.logit_bias == ((3, 2.5), (7, -100.0))
    grpc = generate_pb2.GenerateRequest(
        prompt_token_ids=[1, 2],
        sampling=generate_pb2.SamplingParams(presence_penalty=0.5, logit_bias={3: 2.5}),
    )
    via_grpc = to_generation_request(grpc, make_limits(make_tokenizer()), lambda t, c: [1])
    assert via_grpc.params.sampling.presence_penalty == 0.5
    assert via_grpc.params.sampling.logit_bias == ((3, 2.5),)
    assert via_grpc.params.sampling.repetition_penalty == 1.0  # proto3's 0: unset


def test_structured_output_fields_compile_to_a_grammar_or_a_400_naming_them() -> None:
    assert completion().generation.params.sampling.grammar is None
    assert completion(response_format={"type": "text"}).generation.params.sampling.grammar is None
    for fields in (
        {"response_format": {"type": "json_object"}},
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "string"}}}},
        {"guided_regex": "[a-z]+"},
        {"guided_choice": ["yes", "no"]},
    ):
        assert completion(**fields).generation.params.sampling.grammar, fields
    for fields, name in (
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "x"}}}},
         "response_format"),
        ({"guided_regex": "[a-"}, "guided_regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ):  # fmt: skip
        with pytest.raises(ApiError) as err:
            completion(**fields)
        assert err.value.param == name, fields
    grpc = generate_pb2.GenerateRequest(
        prompt_token_ids=[1], structured_output=generate_pb2.StructuredOutput(json_schema="{")
    )
    with pytest.raises(InvalidRequestError) as bad:
        to_generation_request(grpc, make_limits(make_tokenizer()), lambda t, c: [1])
    assert bad.value.field == "structured_output"


def test_an_unset_max_tokens_is_what_the_context_leaves_where_that_is_less() -> None:
    """vLLM's rule: a request that names no max_tokens is not refused for it. Set, it is the
    client's, and a prompt that fills the context is refused for the prompt (the scheduler)."""
    tokenizer = make_tokenizer()

    def limits(context: int) -> RequestLimits:
        return dataclasses.replace(
            make_limits(tokenizer), default_max_tokens=300, max_model_len=context
        )

    prompt = "the Paris " * 2
    grpc = to_generation_request(
        generate_pb2.GenerateRequest(prompt=prompt), limits(20), tokenizer.encode_prompt
    )
    room = 20 - len(grpc.prompt_token_ids)
    assert 0 < room < 16 and grpc.params.max_tokens == room
    body = {"model": MODEL, "prompt": prompt}
    completion_ = parse_completion(body, MODEL, limits(20), tokenizer).generation
    assert completion_.params.max_tokens == room  # completions' 16, clamped
    short = parse_completion({**body, "prompt": "the"}, MODEL, limits(20), tokenizer).generation
    assert short.params.max_tokens == 16
    chat_body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    chat_ = parse_chat(chat_body, MODEL, limits(30), tokenizer).generation
    assert chat_.params.max_tokens == 30 - len(chat_.prompt_token_ids) < 300
    named = parse_completion({**body, "max_tokens": 30}, MODEL, limits(20), tokenizer).generation
    assert named.params.max_tokens == 30  # the scheduler refuses it, naming max_tokens
    too_long = to_generation_request(
        generate_pb2.GenerateRequest(prompt="the Paris " * 30), limits(20), tokenizer.encode_prompt
    )
    assert too_long.params.max_tokens == 300  # the scheduler refuses it, naming the prompt


def test_stop_token_ids_outside_the_vocabulary_are_refused_on_both_apis() -> None:
    """The last stage masks stop tokens by index (min_tokens): one past the vocabulary would
    fail its step and take the pipeline down with it."""
    tokenizer = make_tokenizer()
    with pytest.raises(InvalidRequestError) as grpc_err:
        to_generation_request(
            generate_pb2.GenerateRequest(prompt="the", stop_token_ids=[4_000_000_000]),
            make_limits(tokenizer),
            tokenizer.encode_prompt,
        )
    assert grpc_err.value.field == "stop_token_ids"
    with pytest.raises(ApiError) as http_err:
        completion(prompt="the", stop_token_ids=[4_000_000_000])
    assert http_err.value.param == "stop_token_ids"
