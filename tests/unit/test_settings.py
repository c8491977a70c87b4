"""One list of per-request settings: the CLI's flags, the adapters' fields and per-call keywords follow it."""

import dataclasses

import pytest

from fly_integrations.params import OVERRIDABLE, FlyParams
from fly_runtime.cli import _config, build_parser
from fly_runtime.config import REQUEST_SETTINGS, GenerationConfig


def test_every_request_setting_is_a_config_field():
    fields = {f.name for f in dataclasses.fields(GenerationConfig)}
    assert set(REQUEST_SETTINGS) <= fields


def test_the_cli_has_a_flag_for_every_setting_and_passes_it_on():
    args = build_parser().parse_args(["generate", "--entropy-top-k", "5", "--no-exact-code", "--k", "9", "hi"])
    config = _config(args)
    assert (config.entropy_top_k, config.exact_code, config.k) == (5, False, 9)
    flags = {a.dest for a in build_parser()._subparsers._group_actions[0].choices["generate"]._actions}
    assert set(REQUEST_SETTINGS) <= flags


@pytest.mark.parametrize("name", OVERRIDABLE)
def test_the_adapters_have_a_field_and_a_per_call_override_for_every_setting(name):
    assert name in FlyParams.model_fields and FlyParams.model_fields[name].description
    config_name = "max_new_tokens" if name == "max_tokens" else name
    assert config_name in REQUEST_SETTINGS


def test_a_per_call_override_reaches_the_config():
    params = FlyParams()
    assert params.generation_config(entropy_top_k=5, max_tokens=7).entropy_top_k == 5
    assert params.generation_config(max_tokens=7).max_new_tokens == 7


def test_unload_keeps_the_engine_asked_for_and_forgets_the_others(monkeypatch):
    from fly_runtime import loader

    class Engine:  # stands for a loaded engine: nothing here loads one
        settled = False

        def settle(self) -> None:  # waits for a form opening beside the requests, which would keep it alive
            self.settled = True

    kept, other = loader.ModelSettings(), loader.ModelSettings(precision="fp32")
    engine, dropped = Engine(), Engine()
    monkeypatch.setattr(loader, "_engines", {kept: engine, other: dropped})
    loader.unload(keep=kept)
    assert loader.loaded(kept) is engine and loader.loaded(other) is None
    assert dropped.settled and not engine.settled
    loader.unload()
    assert loader.loaded(kept) is None and engine.settled
