"""A CacheSpec from a transformers model config: the window of every layer, the KV heads, the head size.

transformers' `sliding_window = W` means a query at position p sees the keys in (p - W, p], W keys counting
its own: cupykv's window W means the same (FlashInfer's window_left = W - 1), so the numbers carry over
unchanged. Configs name the windows in three ways:

- `layer_types` (Gemma 2/3, GPT-OSS, Qwen2 and most recent models): "sliding_attention" layers slide with
  `sliding_window`, "full_attention" layers see everything;
- `use_sliding_window` and `max_window_layers` (Qwen2 configs without layer_types): the layers from index
  max_window_layers on slide;
- `sliding_window` alone (Mistral, Mixtral): every layer slides (None: none does).

Other layer types (chunked attention, linear attention, Mamba state) are refused with a CupykvError.
"""
from __future__ import annotations

from typing import List, Optional

from ..errors import InvalidSpecError
from ..spec import CacheSpec

SLIDING, FULL = "sliding_attention", "full_attention"


class UnsupportedModelError(InvalidSpecError):
    """A model whose attention cupykv cannot serve (named in the message); nothing was set up."""


def text_config(config):
    """The decoder's config (a multimodal config's text part)."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def layer_windows(config) -> List[Optional[int]]:
    """The sliding window of every decoder layer (None: full attention)."""
    c = text_config(config)
    if getattr(c, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{type(config).__name__}: an encoder-decoder model (cross-attention) "
                                    "is not supported; cupykv serves decoder-only models")
    n = getattr(c, "num_hidden_layers", None)
    if not isinstance(n, int) or n < 1:
        raise UnsupportedModelError(f"{type(config).__name__}: no num_hidden_layers")
    window = getattr(c, "sliding_window", None)
    types = getattr(c, "layer_types", None)
    if types is None and getattr(c, "use_sliding_window", None) is not None:     # Qwen2-style
        first = getattr(c, "max_window_layers", n)
        types = [SLIDING if c.use_sliding_window and i >= first else FULL for i in range(n)]
    if types is None:                                                            # Mistral-style
        return [window] * n
    types = list(types)[:n]
    unknown = sorted({t for t in types if t not in (SLIDING, FULL)})
    if unknown:
        raise UnsupportedModelError(f"{type(config).__name__}: layer types {unknown} are not supported "
                                    f"(cupykv serves {SLIDING!r} and {FULL!r} layers)")
    if SLIDING in types and not window:
        raise UnsupportedModelError(f"{type(config).__name__}: sliding layers but sliding_window={window!r}")
    return [window if t == SLIDING else None for t in types]


def dtype_name(dtype) -> str:
    """A torch dtype (or its name) as CacheSpec names it: torch.bfloat16 -> "bfloat16"."""
    return str(dtype).replace("torch.", "")


def spec_from_config(config, *, tokens_per_block: int, max_batch: int, memory_bytes: Optional[int] = None,
                     **overrides) -> CacheSpec:
    """The CacheSpec of a transformers model config: windows per layer, num_kv_heads, head_dim, the
    config's dtype (float32 when it names none) and max_seq_len = max_position_embeddings; `overrides`
    (any CacheSpec field) win. GPT-OSS's learned sinks need no spec field: they are a logit per head with
    no KV (sink_tokens stays 0)."""
    c = text_config(config)
    heads = getattr(c, "num_attention_heads")
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    dtype = getattr(c, "dtype", None)
    dtype = dtype_name(dtype) if dtype is not None else "float32"
    fields = dict(windows=layer_windows(config), num_kv_heads=getattr(c, "num_key_value_heads", None) or heads,
                  head_dim=head_dim, dtype=dtype, tokens_per_block=tokens_per_block, max_batch=max_batch,
                  memory_bytes=memory_bytes,
                  max_seq_len=getattr(c, "max_position_embeddings", None) or 4096)
    fields.update(overrides)
    return CacheSpec(**fields)
