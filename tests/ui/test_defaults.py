"""The app takes the theme of $SPECCHAT_HOME/config.toml (cli/defaults.py reads and checks the file)."""

from __future__ import annotations

from specchat.ui.app import SpecchatApp
from tests.ui.conftest import SIZE
from tests.ui.fake_engine import FakeEngine


async def test_the_app_takes_the_theme():
    app = SpecchatApp(engine=FakeEngine(), theme="nord")
    async with app.run_test(size=SIZE):
        assert app.theme == "nord" and app.current_theme.name == "nord"
