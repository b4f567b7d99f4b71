"""Loads the test plugin (../../shims/hscap_test_cpu_plugin.py) in a release that has no
plugin entry points yet (0.5.10 has no `sglang.srt.plugins`): imported by the .pth that
bin/setup_sglang_venv.sh writes, it registers the plugin to run when DeepSeek's attention
handler registry is imported, the point the plugin's first job needs. Test venvs only."""

import os
import sys

import wrapt

_SHIMS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "shims")


def _register(module):
    if _SHIMS not in sys.path:
        sys.path.append(_SHIMS)
    import hscap_test_cpu_plugin

    hscap_test_cpu_plugin.register()


wrapt.register_post_import_hook(_register, "sglang.srt.models.deepseek_common.attention_backend_handler")
