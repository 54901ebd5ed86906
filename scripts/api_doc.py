"""Write docs/api.md, the API reference, from the public API's signatures and docstrings.

    python scripts/api_doc.py [--check]

--check exits 1 when docs/api.md differs from what this would write (tests/test_docs.py runs it): the
reference is the docstrings, so change those, then run this.
"""
import inspect
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..")
sys.path.insert(0, ROOT)

import cupykv  # noqa: E402
from cupykv import interop  # noqa: E402
from cupykv.step import DeviceStep  # noqa: E402

INTRO = """# API reference

Every public class, function and Step attribute, from their docstrings (`scripts/api_doc.py` writes
this page). Shapes are `[dims]`, dtypes name the element type; "entries" are a step's batch positions
(contexts first, then decodes), "rows" the host table's rows (one per live request). Every error is a
`cupykv.CupykvError`; a call that raises leaves the manager as it was.
"""


def doc(obj) -> str:
    return inspect.cleandoc(inspect.getdoc(obj) or "(no docstring)")


def signature(name: str, obj) -> str:
    try:
        return f"{name}{inspect.signature(obj)}"
    except (TypeError, ValueError):
        return name


def members(cls):
    """Public methods and properties defined on the class itself, in source order."""
    out = []
    for name, value in vars(cls).items():
        if name.startswith("_") and name != "__init__":
            continue
        if isinstance(value, property):
            out.append((name, value, "property"))
        elif inspect.isfunction(value):
            out.append((name, value, "method"))
    return out


def section_class(cls, title=None) -> list:
    lines = [f"### `{title or cls.__name__}`", "", "```python", signature(cls.__name__, cls), "```", "", doc(cls), ""]
    for name, value, kind in members(cls):
        if name == "__init__":
            continue
        if kind == "property":
            lines += [f"- **`{name}`** (property): " + doc(value).replace("\n", "\n  "), ""]
        else:
            lines += [f"- **`{signature(name, value)}`**", "", "  " + doc(value).replace("\n", "\n  "), ""]
    return lines


def section_function(fn, prefix="") -> list:
    return [f"### `{prefix}{fn.__name__}`", "", "```python", signature(prefix + fn.__name__, fn), "```", "",
            doc(fn), ""]


def build() -> str:
    lines = [INTRO, "## The core (`import cupykv`)", ""]
    for cls in (cupykv.CacheSpec, cupykv.KVCacheManager, cupykv.Step, DeviceStep, cupykv.KVStorage,
                cupykv.Request, cupykv.Layout, cupykv.LayerGroup):
        lines += section_class(cls)
    lines += section_function(cupykv.cuda_available, "cupykv.")
    lines += ["## Errors", ""]
    for name in cupykv.__all__:
        obj = getattr(cupykv, name)
        if inspect.isclass(obj) and issubclass(obj, BaseException):
            bases = ", ".join(b.__name__ for b in obj.__bases__)
            lines += [f"- **`{name}`** ({bases}): " + doc(obj).replace("\n", " "), ""]
    lines += ["## torch and CSR views (`cupykv.interop`)", "", doc(interop), ""]
    for name in ("to_torch", "tables_to_torch", "write_positions_to_torch", "pages_to_torch", "finish_on_torch",
                 "csr_views", "cupy_stream"):
        lines += section_function(getattr(interop, name), "interop.")
    lines += section_class(interop.CsrViews, "interop.CsrViews")
    from cupykv import kv_events, transfer, transports
    from cupykv.transports import loopback, nixl
    lines += ["## KV transfer between managers (`cupykv.transfer`, `cupykv.transports`)", "", doc(transfer), ""]
    lines += section_class(transfer.KVTransfers, "transfer.KVTransfers")
    for cls in (transfer.TransferMeta, transfer.Descriptors, transfer.Outgoing, transfer.Incoming):
        lines += section_class(cls, "transfer." + cls.__name__)
    lines += section_function(transfer.layout_signature, "transfer.")
    lines += [f"- **`transfer.TransferLayoutError`**: " + doc(transfer.TransferLayoutError), ""]
    lines += ["### Transports", "", doc(transports), "", doc(loopback), ""]
    lines += section_class(transports.LoopbackTransport, "transports.LoopbackTransport")
    lines += section_class(loopback.LoopbackRead, "transports.loopback.LoopbackRead")
    lines += [doc(nixl), ""]
    lines += section_class(nixl.NixlAgent, "transports.nixl.NixlAgent")
    lines += section_class(nixl.NixlRead, "transports.nixl.NixlRead")
    lines += section_function(nixl.nixl_available, "transports.nixl.")
    lines += [f"- **`transports.nixl.NixlUnavailableError`**: " + doc(nixl.NixlUnavailableError), ""]
    lines += ["## KV events for routers (`cupykv.kv_events`)", "", doc(kv_events), ""]
    lines += section_class(kv_events.KVEventPublisher, "kv_events.KVEventPublisher")
    for fn in (kv_events.vllm_events, kv_events.event_batch, kv_events.encode):
        lines += section_function(fn, "kv_events.")
    lines += [f"- **`kv_events.EventsUnavailableError`**: " + doc(kv_events.EventsUnavailableError), ""]
    try:
        import cupykv.hf as hf
    except ImportError:
        raise SystemExit("scripts/api_doc.py needs the hf extra (torch, transformers) to document cupykv.hf")
    lines += ["## Serving transformers models (`import cupykv.hf`)", "", doc(hf), ""]
    lines += section_class(hf.Engine, "hf.Engine")
    lines += section_class(hf.EngineStats, "hf.EngineStats")
    for fn in (hf.spec_from_config, hf.layer_windows, hf.register, hf.cupykv_attention):
        lines += section_function(fn, "hf.")
    lines += section_class(hf.PagedBatch, "hf.PagedBatch")
    from cupykv.hf import tiny
    lines += section_function(tiny.tiny_model, "hf.tiny.") + section_function(tiny.reference_tokens, "hf.tiny.")
    lines += [f"- **`hf.UnsupportedModelError`**: " + doc(hf.UnsupportedModelError), ""]
    text = "\n".join(lines)
    return "\n".join(line.rstrip() for line in text.splitlines()).rstrip() + "\n"


def main() -> int:
    path = os.path.join(ROOT, "docs", "api.md")
    text = build()
    if "--check" in sys.argv:
        current = open(path).read() if os.path.exists(path) else ""
        if current != text:
            print("docs/api.md is out of date: run python scripts/api_doc.py")
            return 1
        return 0
    with open(path, "w") as f:
        f.write(text)
    print(f"wrote {path} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
