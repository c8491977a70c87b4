"""The tools suite's BFCL data and scoring, without a model: schemas converted to JSON schema, calls checked
against possible answers as BFCL's AST check does, the data read from a wheel-shaped archive."""

import json
import zipfile

from fly_runtime.bench import bfcl
from fly_runtime.bench.bfcl import call_matches, json_schema, load_bfcl, score_calls, tool_name

TRIANGLE = {"calculate_triangle_area": {"base": [10], "height": [5], "unit": ["units", ""]}}


def test_bfcl_types_become_json_schema_types():
    schema = {"type": "dict", "properties": {
        "ratio": {"type": "float"}, "point": {"type": "tuple", "items": {"type": "float"}},
        "options": {"type": "dict", "properties": {"x": {"type": "any"}}}}, "required": ["ratio"]}
    converted = json_schema(schema)
    assert converted["type"] == "object" and converted["required"] == ["ratio"]
    assert converted["properties"]["ratio"] == {"type": "number"}
    assert converted["properties"]["point"] == {"type": "array", "items": {"type": "number"}}
    assert converted["properties"]["options"]["properties"]["x"] == {}  # any type: no constraint
    assert tool_name("math.factorial") == "math_factorial"


def test_a_call_matches_on_name_required_parameters_and_possible_values():
    assert call_matches("calculate_triangle_area", {"base": 10, "height": 5}, TRIANGLE)  # unit may be left out
    assert call_matches("calculate_triangle_area", {"base": 10.0, "height": 5, "unit": "Units"}, TRIANGLE)
    assert not call_matches("calculate_triangle_area", {"base": 10}, TRIANGLE)  # a required one missing
    assert not call_matches("calculate_triangle_area", {"base": 10, "height": 6}, TRIANGLE)  # wrong value
    assert not call_matches("calculate_triangle_area", {"base": 10, "height": 5, "colour": "red"}, TRIANGLE)
    assert not call_matches("triangle_area", {"base": 10, "height": 5}, TRIANGLE)  # wrong function
    assert not call_matches("calculate_triangle_area", {"base": True, "height": 5}, TRIANGLE)  # bool is no number
    nested = {"f": {"where": [{"city": ["New York, NY"], "unit": ["", "celsius"]}]}}
    assert call_matches("f", {"where": {"city": "new york ny"}}, nested)  # case and punctuation ignored
    assert not call_matches("f", {"where": {"city": "Boston"}}, nested)


def test_parallel_calls_match_in_any_order_and_in_number():
    expected = [{"play": {"artist": ["Taylor Swift"], "minutes": [20]}},
                {"play": {"artist": ["Maroon 5"], "minutes": [15]}}]
    swapped = [("play", {"artist": "Maroon 5", "minutes": 15}), ("play", {"artist": "Taylor Swift", "minutes": 20})]
    assert score_calls(swapped, expected)
    assert not score_calls(swapped[:1], expected)
    assert not score_calls([swapped[0], swapped[0]], expected)  # one expected call cannot answer twice
    assert not score_calls([], [TRIANGLE])


def test_turns_load_from_the_wheel_with_tool_names_made_valid(tmp_path, monkeypatch):
    monkeypatch.setattr(bfcl, "_installed_data", lambda: None)
    question = {"id": "simple_python_0", "question": [[{"role": "user", "content": "Area of a 10 by 5 triangle?"}]],
                "function": [{"name": "geometry.area", "description": "Area.", "parameters": {
                    "type": "dict", "properties": {"base": {"type": "integer"}}, "required": ["base"]}}]}
    answer = {"id": "simple_python_0", "ground_truth": [{"geometry.area": {"base": [10]}}]}
    with zipfile.ZipFile(tmp_path / "bfcl_eval-2026.3.23-py3-none-any.whl", "w") as archive:
        archive.writestr("bfcl_eval/data/BFCL_v4_simple_python.json", json.dumps(question) + "\n")
        archive.writestr("bfcl_eval/data/possible_answer/BFCL_v4_simple_python.json", json.dumps(answer) + "\n")
    (turn,) = load_bfcl(tmp_path, ("simple_python",))
    turn_id, category, messages, tools, expected = turn
    assert (turn_id, category, messages[0]["role"]) == ("simple_python_0", "simple_python", "user")
    assert tools[0]["function"]["name"] == "geometry_area"
    assert tools[0]["function"]["parameters"]["type"] == "object"
    assert expected == [{"geometry_area": {"base": [10]}}]
    assert score_calls([("geometry_area", {"base": 10})], expected)
