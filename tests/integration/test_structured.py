"""Structured output on the real pair: a JSON-schema reply under FLy parses and follows its schema every time."""

import json

import jsonschema
import pytest
from pydantic import BaseModel

from fly_integrations import FlyChatModel
from fly_runtime import GenerationConfig
from fly_runtime.chat import encode_chat

# held out: written for this test, never used to tune anything
SCHEMAS = [
    ("Describe the city of Oslo.", {"type": "object", "properties": {"city": {"type": "string"}, "country": {
        "type": "string"}, "population_millions": {"type": "number"}}, "required": ["city", "country",
                                                                                   "population_millions"]}),
    ("Give a Python function's signature for adding two integers.", {"type": "object", "properties": {
        "name": {"type": "string"}, "parameters": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "returns": {"type": "string"}}, "required": ["name", "parameters", "returns"]}),
    ("Is 17 a prime number?", {"type": "object", "properties": {"number": {"type": "integer"}, "is_prime": {
        "type": "boolean"}}, "required": ["number", "is_prime"]}),
    ("Rate the sentence 'I loved this film' for sentiment.", {"type": "object", "properties": {"sentiment": {
        "enum": ["positive", "negative", "neutral"]}, "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["sentiment", "confidence"]}),
    ("List three primary colours.", {"type": "object", "properties": {"colours": {"type": "array", "items": {
        "type": "string"}, "minItems": 3, "maxItems": 3}}, "required": ["colours"]}),
    ("Extract the date from: 'The meeting is on 2024-03-15.'", {"type": "object", "properties": {"date": {
        "type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}}, "required": ["date"]}),
    ("Give an HTTP status code for 'not found' and its name.", {"type": "object", "properties": {"code": {
        "type": "integer", "minimum": 100, "maximum": 599}, "name": {"type": "string"}}, "required": ["code", "name"]}),
    ("Describe a book you like.", {"type": "object", "properties": {"title": {"type": "string"}, "author": {
        "type": "string"}, "year": {"type": "integer"}}, "required": ["title", "author", "year"],
        "additionalProperties": False}),
    ("Convert 5 kilometres to miles.", {"type": "object", "properties": {"kilometres": {"type": "number"},
        "miles": {"type": "number"}}, "required": ["kilometres", "miles"]}),
    ("Name a programming language and whether it is compiled.", {"type": "object", "properties": {
        "language": {"type": "string", "maxLength": 40}, "compiled": {"type": "boolean"}, "typing": {
            "enum": ["static", "dynamic"]}}, "required": ["language", "compiled", "typing"]}),
]


@pytest.mark.parametrize("question, schema", SCHEMAS, ids=[s[0][:24] for s in SCHEMAS])
def test_a_fly_reply_under_a_json_schema_always_parses_and_validates(engine, question, schema):
    messages = [{"role": "system", "content": "Reply with one JSON object that follows this JSON schema: "
                                              + json.dumps(schema)},
                {"role": "user", "content": question}]
    config = GenerationConfig(mode="fly", max_new_tokens=160, json_schema=json.dumps(schema))
    result = engine.generate(encode_chat(engine.tokenizer, messages), config)
    assert result.finish_reason == "stop", result.text
    jsonschema.validate(json.loads(result.text), schema)


def test_the_grammar_keeps_exact_decoding_identical_to_plain_decoding(exact_engine):
    engine = exact_engine
    question, schema = SCHEMAS[7]
    ids = encode_chat(engine.tokenizer, [{"role": "user", "content": question}])
    ar, exact = (engine.generate(ids, GenerationConfig(mode=mode, max_new_tokens=96, json_schema=json.dumps(schema)))
                 for mode in ("ar", "exact"))
    assert exact.token_ids == ar.token_ids
    jsonschema.validate(json.loads(ar.text), schema)
    # the reply ended with its value's closing brace: no step was spent on the end-of-sequence token after it (the
    # prompt's pass gave the first token, each step one more)
    assert ar.finish_reason == "stop" and ar.text.endswith("}") and ar.stats.target_forwards == ar.stats.new_tokens


def test_tokens_the_grammar_forces_are_verified_in_passes_without_drafting(engine):
    question, schema = SCHEMAS[0]
    schema = dict(schema, additionalProperties=False)  # closed, so the reply ends within the budget
    ids = encode_chat(engine.tokenizer, [{"role": "user", "content": question}])
    config = GenerationConfig(mode="exact", max_new_tokens=96, json_schema=json.dumps(schema), ngram=False)
    result = engine.generate(ids, config)
    jsonschema.validate(json.loads(result.text), schema)
    # written in json.dumps's layout, whose braces, keys, quotes and separators came as forced drafts: more than one
    # token per target pass
    assert "\n" not in result.text and result.text.startswith('{"city": ')
    assert result.stats.forced_tokens >= 4
    assert result.stats.target_forwards < result.stats.new_tokens
    plain = engine.generate(ids, GenerationConfig(mode="ar", max_new_tokens=96, json_schema=json.dumps(schema)))
    assert plain.stats.forced_tokens == 0 and plain.stats.target_forwards >= plain.stats.new_tokens


class Pet(BaseModel):
    name: str
    species: str
    age_years: int


def test_langchain_json_schema_structured_output_under_fly():
    model = FlyChatModel(mode="fly", max_tokens=96)
    pet = model.with_structured_output(Pet, method="json_schema").invoke("Invent a pet and describe it.")
    assert isinstance(pet, Pet) and pet.name
    raw = model.with_structured_output({"title": "pet", "type": "object", "properties": {"name": {"type": "string"}},
                                        "required": ["name"]}, method="json_schema", include_raw=True).invoke(
        "Invent a pet name.")
    assert raw["parsing_error"] is None and isinstance(raw["parsed"]["name"], str)


@pytest.mark.parametrize("prompt, schema", SCHEMAS[:4], ids=[f"schema{i}" for i in range(4)])
def test_every_frameworks_default_structured_path_follows_the_schema(prompt, schema):
    """LangChain's with_structured_output (default method json_schema), its function_calling method, and
    LlamaIndex's structured_predict (a forced tool call): each decodes under the schema's grammar, so every reply
    parses and validates, whatever the model would have written."""
    from llama_index.core.prompts import PromptTemplate

    from fly_integrations import FlyLLM

    titled = {"title": "answer", "description": "the answer", **schema}
    by_default = FlyChatModel(max_tokens=96).with_structured_output(titled).invoke(prompt)
    jsonschema.validate(by_default, schema)
    called = FlyChatModel(max_tokens=96).with_structured_output(titled, method="function_calling").invoke(prompt)
    jsonschema.validate(called, schema)
    model = _pydantic_model(titled)
    predicted = FlyLLM(max_tokens=96).structured_predict(model, PromptTemplate(prompt))
    jsonschema.validate(predicted.model_dump(), schema)


def _pydantic_model(schema: dict) -> type[BaseModel]:
    """A pydantic model for ``schema`` (LlamaIndex's programs take classes), with the schema as its JSON schema."""
    from pydantic import ConfigDict, create_model

    fields = {name: (object, ...) if name in schema.get("required", []) else (object, None)
              for name in schema["properties"]}
    model = create_model("Answer", __config__=ConfigDict(json_schema_extra=lambda s, _: s.update(
        {k: v for k, v in schema.items() if k not in ("title",)})), **fields)
    model.__doc__ = "the answer"
    return model
