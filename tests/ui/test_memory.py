"""Unquantized weights are named by the model dtype in the Memory panel and the welcome line (the engine's memory
says "bf16" for any unquantized form, float32 ones included: issue 18)."""

from __future__ import annotations

from specchat.config import EngineConfig
from specchat.ui.app import SpecchatApp
from specchat.ui.memory import MemoryPanel, weights_format
from tests.ui.conftest import SIZE, wait_for
from tests.ui.fake_engine import FakeEngine

FLOAT32 = {"weights_format": "bf16", "linear_weight_bytes": 4_000, "linear_weight_bytes_bf16": 2_000}
BFLOAT16 = {**FLOAT32, "linear_weight_bytes": 2_000}


def test_unquantized_weights_are_named_by_their_dtype():
    assert weights_format(FLOAT32) == "float32"
    assert weights_format(BFLOAT16) == "bfloat16"
    assert weights_format(BFLOAT16, "float16") == "float16"  # as wide as bfloat16: only --dtype tells them apart
    assert weights_format({**FLOAT32, "weights_format": "mxfp4", "weights_method": "gptq"}, "float32") == "mxfp4 (gptq)"
    assert weights_format({}) == "n/a"
    assert weights_format({**FLOAT32, "weights_gguf": "Q4_1+Q8_0"}, "float32") == "gguf Q4_1+Q8_0"  # CPU blocks


async def test_the_panel_and_the_welcome_name_the_dtype_asked_for():
    app = SpecchatApp(engine=FakeEngine(), config=EngineConfig(dtype="float16"))
    async with app.run_test(size=SIZE) as pilot:
        panel = app.main.query_one(MemoryPanel)
        await wait_for(pilot, lambda: "weights float16" in str(panel.render()), what="the memory reading")
        welcome = app.chat.query_one(".welcome")
        await wait_for(pilot, lambda: "weights float16" in str(welcome.render()), what="the welcome line")


async def test_without_dtype_the_width_names_it(tiny_engine, make_app):
    app = make_app(tiny_engine)
    async with app.run_test(size=SIZE) as pilot:
        panel = app.main.query_one(MemoryPanel)
        await wait_for(pilot, lambda: "weights float32" in str(panel.render()), what="the memory reading")


def test_resident_memory_without_proc_or_resource(monkeypatch):
    """macOS has no /proc (the peak from getrusage, in bytes there); Windows has no `resource` either (n/a)."""
    import builtins
    import sys

    from specchat.ui import bridge

    real_open = builtins.open

    def no_proc(path, *args, **kwargs):
        if str(path).startswith("/proc/"):
            raise FileNotFoundError(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", no_proc)
    peak = bridge.rss_bytes()
    assert peak is not None and peak > 10_000_000  # this process's peak, in bytes (KiB on Linux, scaled)
    monkeypatch.setitem(sys.modules, "resource", None)  # `import resource` fails, as on Windows
    assert bridge.rss_bytes() is None
