"""specchat: terminal chat and agent runner with speculative decoding and MXFP4, shown live."""

from specchat.config import EngineConfig, SamplingParams, SpecParams

__all__ = ["Engine", "EngineConfig", "SamplingParams", "SpecParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # The engine pulls in torch; keep `import specchat` (and the CLI's --help) light.
    if name == "Engine":
        from specchat.engine.engine import Engine

        return Engine
    raise AttributeError(name)
