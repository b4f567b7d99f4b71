import pytest

from hs_capture import config
from hs_capture.config import ConfigError


def test_layers_parse_sorted_and_default():
    assert config.parse_layers("30, 2,58") == [2, 30, 58]
    assert config.parse_layers("") is None and config.parse_layers("default") is None


@pytest.mark.parametrize("text", ["2,x", "-1", "2,2", "1;2"])
def test_bad_layer_lists_are_config_errors(text):
    with pytest.raises(ConfigError):
        config.parse_layers(text)


def test_default_layers_are_sglang_eagle3_default():
    assert config.resolve_layers(None, 61) == [2, 30, 58]  # DeepSeek-V3 / Kimi-K2
    assert config.resolve_layers(None, 6) == [2, 3]  # deduplicated for tiny models


def test_layers_out_of_range_name_the_model():
    with pytest.raises(ConfigError, match=r"\[61\] outside 1..60 for this 61-layer model"):
        config.resolve_layers([2, 61], 61)
    with pytest.raises(ConfigError):
        config.resolve_layers([0], 61)


def test_enabled_by_dir_alias_and_kill_switch():
    assert not config.is_enabled({})
    assert config.is_enabled({"SGLANG_HS_DUMP_DIR": "/x"})
    assert not config.is_enabled({"HSCAP_DIR": "/x", "HSCAP_DISABLE": "1"})


@pytest.mark.parametrize("env", [
    {"HSCAP_CODEC": "lz4"}, {"HSCAP_ON_FULL": "later"}, {"HSCAP_WRITER_THREADS": "0"},
    {"HSCAP_MAX_INFLIGHT_MB": "lots"},
])
def test_bad_settings_are_config_errors(env):
    with pytest.raises(ConfigError):
        config.load({"HSCAP_DIR": "/x", "HSCAP_RUN_ID": "r", **env})


def test_unwritable_dir_is_a_config_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="not writable"):
        config.check_dump_dir(str(blocker / "sub"))
