import pytest

from hs_capture.server import config
from hs_capture.server.config import ConfigError


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
    {"HSCAP_CODEC": "lz4"}, {"HSCAP_ON_FULL": "later"}, {"HSCAP_WRITER_THREADS": "-1"},
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


def test_writer_threads_follow_the_usable_cores_and_the_writers_on_the_host(monkeypatch):
    from hs_capture.server import config

    monkeypatch.setattr(config.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert config.default_writer_threads() == 12  # one writer on a 16-core H200 host
    assert config.default_writer_threads(writers_on_host=4) == 3
    monkeypatch.setattr(config.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert config.default_writer_threads() == 2  # never fewer
    assert config.load({"HSCAP_DIR": "/x", "HSCAP_RUN_ID": "r"}).writer_threads == 0  # auto, sized at model load
    assert config.load({"HSCAP_DIR": "/x", "HSCAP_RUN_ID": "r", "HSCAP_WRITER_THREADS": "5"}).writer_threads == 5


def test_the_auto_inflight_budget_lets_every_thread_hold_a_step_with_room_to_wait(monkeypatch):
    def host(gib):
        monkeypatch.setattr(config.os, "sysconf", lambda name: {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": (gib << 30) // 4096}[name])

    step = 470 << 20  # one TP-8 H200's 8192-token DeepSeek-V3 step: 3 aux layers + final, bf16
    host(2048)
    assert config.inflight_budget(12, step) == 16 * step  # 4 GiB held 8 of them: 12 threads could not all compress
    assert config.inflight_budget(2, step) == 4 << 30  # never below the old fixed 4 GiB
    assert config.inflight_budget(12, 0) == 4 << 30  # step unknown (no chunked prefill size)
    host(64)
    assert config.inflight_budget(64, step) == 8 << 30  # at most an eighth of the host
    host(16)
    assert config.inflight_budget(12, step) == 4 << 30  # ... but never below 4 GiB
    assert config.load({"HSCAP_DIR": "/tmp/x", "HSCAP_RUN_ID": "r"}).max_inflight_bytes == 0  # auto unless set
