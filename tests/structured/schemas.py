"""Ten JSON schemas of different shapes (nested objects, arrays, enums, bounded numbers, optional
fields), a regex and a choice list: what the structured-output tests ask for and validate."""

from __future__ import annotations

import json
import re

import jsonschema

NAME = {"type": "string", "minLength": 1, "maxLength": 16}
SCHEMAS = [
    {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"city": NAME, "address": {
        "type": "object", "properties": {"street": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["street", "zip"]}}, "required": ["city", "address"]},
    {"type": "array", "items": {"type": "integer", "minimum": -50, "maximum": 50}, "minItems": 1, "maxItems": 6},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "size": {"type": "string", "enum": ["S", "M", "L"]}},
     "required": ["color", "size"]},
    {"type": "object", "properties": {"price": {"type": "number", "minimum": 0, "maximum": 1000},
                                      "in_stock": {"type": "boolean"}}, "required": ["price", "in_stock"]},
    {"type": "object", "properties": {"title": NAME, "subtitle": NAME, "pages": {"type": "integer", "minimum": 1,
                                                                                  "maximum": 999}},
     "required": ["title"]},  # optional fields
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
                                      "owner": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1,
                                                                                        "maximum": 9999}},
                                                "required": ["id"]}}, "required": ["tags", "owner"]},
    {"type": "object", "properties": {"points": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                         "y": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["x", "y"]}}}, "required": ["points"]},
    {"type": "object", "properties": {"answer": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99},
                                                           {"type": "string", "enum": ["unknown"]}]},
                                      "note": {"type": ["string", "null"], "maxLength": 12}},
     "required": ["answer", "note"]},
    {"$defs": {"person": {"type": "object", "properties": {"name": NAME}, "required": ["name"]}},
     "type": "object", "properties": {"lead": {"$ref": "#/$defs/person"},
                                      "team": {"type": "array", "items": {"$ref": "#/$defs/person"}, "maxItems": 3}},
     "required": ["lead", "team"]},
]
REGEX = r"(yes|no), [a-z]{2,8}\."
CHOICES = ["positive", "negative", "neutral"]


def check_json(text: str, schema: dict) -> None:
    """The text parses and the value validates (raises otherwise)."""
    jsonschema.validate(json.loads(text), schema)


def check_regex(text: str) -> None:
    assert re.fullmatch(REGEX, text), text
