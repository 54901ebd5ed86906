"""Serve Hugging Face transformers models on cupykv: spec_from_config, the "cupykv" attention function,
and a small greedy Engine with continuous batching, chunked prefill, prefix caching and preemption.

An optional part: it needs torch and transformers>=5 (pip install "cupykv[hf]"); `import cupykv` does
not import it.
"""
from ..interop import InteropUnavailableError

try:
    import torch  # noqa: F401
    import transformers  # noqa: F401
except ImportError as exc:          # pragma: no cover - the message is the point
    raise InteropUnavailableError("cupykv.hf needs torch and transformers>=5 (pip install \"cupykv[hf]\"): "
                                  f"{exc}") from exc

from .attention import NAME, PagedBatch, cupykv_attention, register  # noqa: E402
from .config import UnsupportedModelError, layer_windows, spec_from_config, text_config  # noqa: E402
from .engine import Engine, EngineStats  # noqa: E402

__all__ = ["Engine", "EngineStats", "PagedBatch", "cupykv_attention", "register", "spec_from_config",
           "layer_windows", "text_config", "UnsupportedModelError", "NAME"]
