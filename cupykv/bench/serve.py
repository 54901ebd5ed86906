"""`python -m cupykv.bench serve`: transformers models served on cupykv against transformers' own serving.

The same random-initialised model (bf16, real shapes: a Gemma-3-4B-like and a GPT-OSS-20B-like text
config) and the same prompts for every contender, one after another in one process:

- cupykv: cupykv.hf.Engine (continuous batching, chunked prefill, prefix caching, overlap);
- transformers' continuous batching: model.generate_batch (its paged cache);
- model.generate with its default cache, the prompts of a turn as one padded batch (where it fits).

Workloads: (chat) multi-turn conversations over a few shared system prompts, every turn the history plus a
new message, all conversations of a turn in flight together; (long) prompts of 8k-32k tokens, well past
the windows, with decode. Reported per contender: output and total tokens/s, time to the first token (the
whole turn's prefill for the batch contenders), peak KV bytes per layer kind (cupykv: the slots held, at
their peak), and for cupykv the GPU's idle time between forward passes (CUDA events at the end of one
forward and the start of the next) as a share of the forward's time. Greedy decoding throughout; the
contenders' tokens are compared (bf16: agreement is reported, not required).

--smoke: a tiny model and short prompts, on the CPU where there is no GPU (the test suite runs it).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from typing import Dict, List

import numpy as np

SHAPES = {
    # name: (config class, fields); vocabularies cut to 32k (the logits' size does not concern the cache)
    "gemma-3-4b": ("Gemma3TextConfig", dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
                                             num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                                             sliding_window=1024, vocab_size=32768, max_position_embeddings=40960)),
    "gpt-oss-20b": ("GptOssConfig", dict(hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                                         num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                                         sliding_window=128, num_local_experts=32, num_experts_per_tok=4,
                                         vocab_size=32768, max_position_embeddings=131072)),
    "tiny": ("Gemma3TextConfig", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=16,
                                      vocab_size=128, max_position_embeddings=4096)),
}


# generate_batch's tokens per forward where its default does not fit: GPT-OSS's attention there is eager,
# whose scores for a default-sized batch over a 32k prompt need more memory than an 80 GB GPU has left
GENERATE_BATCH_TOKENS = {"gpt-oss-20b": 256}


def build(shape: str, device: str):
    import torch
    import transformers as tf
    cls_name, fields = SHAPES[shape]
    # the model's own attention for the contenders that use it: sdpa where transformers has it for the
    # architecture (GPT-OSS's learned sinks have eager only)
    config = getattr(tf, cls_name)(**fields, attn_implementation="eager" if cls_name == "GptOssConfig" else "sdpa")
    model_cls = {"Gemma3TextConfig": tf.Gemma3ForCausalLM, "GptOssConfig": tf.GptOssForCausalLM}[cls_name]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_cls(config).eval()
    finally:
        torch.set_default_dtype(old)
    return model


def chat_workload(rng, smoke: bool):
    """(system prompts, conversations: each a list of user messages), token ids."""
    n_sys, sys_len, convs, turns, msg = (2, 40, 4, 2, 8) if smoke else (4, 1024, 32, 4, 96)
    systems = [rng.integers(10, 30000 if not smoke else 120, sys_len).tolist() for _ in range(n_sys)]
    conversations = [(systems[i % n_sys], [rng.integers(10, 30000 if not smoke else 120, msg).tolist()
                                           for _ in range(turns)]) for i in range(convs)]
    return conversations


def long_prompts(rng, smoke: bool) -> List[List[int]]:
    lengths = [60, 90] if smoke else [8192, 16384, 32768, 8192]
    return [rng.integers(10, 30000 if not smoke else 120, n).tolist() for n in lengths]


class Contender:
    name = ""

    def generate(self, prompts: List[List[int]], new: int) -> List[List[int]]:
        raise NotImplementedError


class CupykvEngine(Contender):
    name = "cupykv Engine"

    def __init__(self, model, max_seq_len: int, max_batch: int, attention: str = "auto"):
        import torch
        import cupykv.hf as hf
        # the KV pool: half the device memory the weights left free (the others size their caches the same way)
        memory = int(torch.cuda.mem_get_info()[0] * 0.5) if model.device.type == "cuda" else None
        self.engine = hf.Engine(model, max_batch=max_batch, tokens_per_block=16, max_seq_len=max_seq_len,
                                max_step_tokens=2048, profile=True, attention=attention, memory_bytes=memory)
        self.name = f"cupykv Engine ({self.engine.attention} attention)"

    def generate(self, prompts, new):
        return self.engine.generate(prompts, new)

    def report(self) -> dict:
        s = self.engine.stats
        out = dict(peak_kv_bytes_per_layer=dict(s.peak_kv_bytes_per_layer),
                   window_bound_bytes_per_layer=dict(s.window_bound_bytes_per_layer), hit_tokens=s.hit_tokens,
                   prompt_tokens=s.prompt_tokens, steps=s.steps,
                   median_ttft_s=float(np.median(s.first_token_s)) if s.first_token_s else None)
        out["cupykv_host_s"] = s.cupykv_host_s
        if s.forward_s:
            out.update(forward_s=s.forward_s, gpu_idle_s=s.idle_s, gpu_idle_share=s.idle_s / s.forward_s,
                       gpu_idle_cupykv_s=s.idle_cupykv_s, gpu_idle_cupykv_share=s.idle_cupykv_s / s.forward_s)
        return out


class GenerateBatch(Contender):
    name = "transformers generate_batch"

    def __init__(self, model, max_batch_tokens=None):
        from transformers import GenerationConfig
        self.model = model
        self.config = GenerationConfig(do_sample=False, eos_token_id=None)
        self.cb_config = None
        try:            # its paged cache: half the free device memory, as the Engine's pool
            from transformers.generation.configuration_utils import ContinuousBatchingConfig
            self.cb_config = ContinuousBatchingConfig(max_memory_percent=0.5, max_batch_tokens=max_batch_tokens)
            if max_batch_tokens:
                self.name += f" (max_batch_tokens={max_batch_tokens})"
        except ImportError:
            pass
        self.ttft: List[float] = []

    def generate(self, prompts, new):
        self.config.max_new_tokens = new
        extra = {"continuous_batching_config": self.cb_config} if self.cb_config is not None else {}
        out = self.model.generate_batch(prompts, generation_config=self.config, progress_bar=False,
                                        record_timestamps=True, **extra)
        outs = [out.get(f"req_{i}") for i in range(len(prompts))]
        failed = [i for i, o in enumerate(outs) if o is None or getattr(o, "error", None) or not o.generated_tokens]
        if failed:              # it logs its errors and returns the requests empty: a failure, not 0 tokens/s
            o = outs[failed[0]]
            raise RuntimeError(f"generate_batch: {len(failed)} of {len(prompts)} requests failed "
                               f"({getattr(o, 'error', None) or 'no tokens'})")
        self.ttft += [o.timestamps[0] - o.created_time for o in outs if getattr(o, "timestamps", None)]
        return [list(o.generated_tokens) for o in outs]

    def report(self) -> dict:
        return dict(median_ttft_s=float(np.median(self.ttft))) if self.ttft else {}


class PaddedGenerate(Contender):
    name = "transformers generate (padded batch)"

    def __init__(self, model):
        self.model = model

    def generate(self, prompts, new):
        import torch
        width = max(map(len, prompts))
        ids = torch.zeros((len(prompts), width), dtype=torch.long, device=self.model.device)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):          # left padding
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        with torch.no_grad():
            out = self.model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                      do_sample=False, eos_token_id=None)
        return out[:, width:].tolist()


def run_chat(contender, conversations, new: int) -> dict:
    histories = [list(system) for system, _ in conversations]
    t0 = time.perf_counter()
    out_tokens = total = 0
    first_turn_s = None
    results = []
    for turn in range(len(conversations[0][1])):
        prompts = [h + msgs[turn] for h, (_, msgs) in zip(histories, conversations)]
        t = time.perf_counter()
        outs = contender.generate(prompts, new)
        if first_turn_s is None:
            first_turn_s = time.perf_counter() - t
        results.append(outs)
        out_tokens += sum(map(len, outs))
        total += sum(map(len, prompts)) + sum(map(len, outs))
        histories = [p + o for p, o in zip(prompts, outs)]
    seconds = time.perf_counter() - t0
    return dict(seconds=seconds, output_tps=out_tokens / seconds, total_tps=total / seconds,
                first_turn_s=first_turn_s, tokens=results)


def run_long(contender, prompts, new: int) -> dict:
    t0 = time.perf_counter()
    outs = contender.generate(prompts, new)
    seconds = time.perf_counter() - t0
    out_tokens = sum(map(len, outs))
    return dict(seconds=seconds, output_tps=out_tokens / seconds,
                total_tps=(out_tokens + sum(map(len, prompts))) / seconds, tokens=outs)


def serve(shapes: List[str], smoke: bool, contenders: List[str], out_dir: str, command: str) -> int:
    import torch
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and "cupykv_torch" in contenders and "cupykv" in contenders:
        contenders = [c for c in contenders if c != "cupykv_torch"]     # (the CPU's only path already)
    rng = np.random.default_rng(0)
    rows, failures = [], 0
    for shape in shapes:
        model = build(shape, device)
        conv = chat_workload(rng, smoke)
        longs = long_prompts(rng, smoke)
        new_chat, new_long = (8, 8) if smoke else (64, 128)
        seq = (max(len(p) for p in longs) + new_long + 64) if smoke else 40960
        makers = {"cupykv": lambda: CupykvEngine(model, seq, 64),
                  "cupykv_torch": lambda: CupykvEngine(model, seq, 64, attention="torch"),
                  "generate_batch": lambda: GenerateBatch(model, GENERATE_BATCH_TOKENS.get(shape)),
                  "generate": lambda: PaddedGenerate(model)}
        tokens: Dict[str, dict] = {}
        for name in contenders:
            try:
                c = makers[name]()
                chat = run_chat(c, conv, new_chat)
                long = run_long(c, longs, new_long) if name != "generate" or smoke else None
                row = dict(shape=shape, contender=c.name, chat=_strip(chat), long=_strip(long),
                           **(c.report() if hasattr(c, "report") else {}))
                tokens[name] = (chat["tokens"], long["tokens"] if long else None)
            except Exception as exc:           # a contender that does not run here is reported, not fatal
                row = dict(shape=shape, contender=name, error=f"{type(exc).__name__}: {exc}")
                failures += name.startswith("cupykv")
            rows.append(row)
            print(json.dumps(row))
            c = None                            # the next contender needs this one's KV memory
            release_memory(device)
        if "cupykv" in tokens:
            for name, (chat, long) in tokens.items():
                if name != "cupykv":
                    same = np.mean([a == b for t1, t2 in zip(chat, tokens["cupykv"][0]) for a, b in zip(t1, t2)])
                    print(f"{shape}: {name} agrees with cupykv on {same:.0%} of the chat requests' tokens")
        model = None      # (the next shape's weights need the memory)
    result = dict(command=command, device=device, rows=rows, failures=failures)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "serve.json"), "w") as f:
            json.dump(result, f, indent=1)
        with open(os.path.join(out_dir, "serve.md"), "w") as f:
            f.write(markdown(result))
        print(f"wrote {out_dir}/serve.json, {out_dir}/serve.md; " + plot(result, os.path.join(out_dir, "serve.png")))
    return 1 if failures else 0


def plot(result: dict, path: str) -> str:
    """Output tokens/s per contender, one panel per workload and a group of bars per shape, each bar labelled."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"no plot: matplotlib is not installed ({type(exc).__name__}); pip install 'cupykv[plot]'"
    rows = [r for r in result["rows"] if "error" not in r]
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    names = list(dict.fromkeys(r["contender"] for r in rows))
    value = {(r["shape"], r["contender"], w): (r[w] or {}).get("output_tps", 0.0) for r in rows for w in ("chat", "long")}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(1, len(names))
    for ax, workload in zip(axes, ("chat", "long")):
        for i, name in enumerate(names):
            vals = [value.get((shape, name, workload), 0.0) for shape in shapes]
            bars = ax.bar([j + i * width for j in range(len(shapes))], vals, width, label=name)
            ax.bar_label(bars, fmt="%.0f", fontsize=8)
        ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(shapes))], shapes)
        ax.set_ylabel("output tokens/s")
        ax.set_title(workload)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{result['command']} ({result['device']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return f"wrote {path}"


def release_memory(device: str) -> None:
    """Give what dropped contenders held back to the device (torch's and CuPy's pools)."""
    import gc
    gc.collect()
    if device == "cuda":
        import torch
        torch.cuda.empty_cache()
        import cupy
        cupy.get_default_memory_pool().free_all_blocks()
        cupy.get_default_pinned_memory_pool().free_all_blocks()


def _strip(r):
    return None if r is None else {k: v for k, v in r.items() if k != "tokens"}


def markdown(result: dict) -> str:
    lines = [f"`{result['command']}` on {result['device']}", "",
             "| shape | contender | chat out tok/s | chat total tok/s | first turn s | long out tok/s | long total tok/s |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    extra = []
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['contender']} | {r['error']} | | | | |")
            continue
        c, lg = r["chat"], r["long"] or {}
        if r.get("median_ttft_s") is not None:
            extra.append(f"- {r['shape']}, {r['contender']}: median time to first token {r['median_ttft_s']:.3f} s "
                         "(from the request's submission, a turn's requests submitted together)")
        if "peak_kv_bytes_per_layer" in r:
            extra.append(f"- {r['shape']}, {r['contender']}: peak KV bytes per layer "
                         f"{r['peak_kv_bytes_per_layer']} (the windows allow at that point "
                         f"{r['window_bound_bytes_per_layer']}), prefix hits {r['hit_tokens']} of {r['prompt_tokens']} "
                         f"prompt tokens, {r['steps']} steps"
                         + f", {r['cupykv_host_s']:.2f} s of host time in cupykv's calls"
                         + (f"; GPU idle between forwards {r['gpu_idle_s']:.3f} s of {r['forward_s']:.2f} s "
                            f"forward ({r['gpu_idle_share']:.1%}), of which cupykv's calls explain at most "
                            f"{r['gpu_idle_cupykv_s']:.3f} s ({r['gpu_idle_cupykv_share']:.1%})" if "forward_s" in r else ""))
        lines.append(f"| {r['shape']} | {r['contender']} | {c['output_tps']:.1f} | {c['total_tps']:.1f} | "
                     f"{c['first_turn_s']:.2f} | {lg.get('output_tps', float('nan')):.1f} | "
                     f"{lg.get('total_tps', float('nan')):.1f} |")
    return "\n".join(lines + [""] + extra) + "\n"


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m cupykv.bench serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--shapes", default="gemma-3-4b,gpt-oss-20b")
    ap.add_argument("--contenders", default="cupykv,cupykv_torch,generate_batch,generate",
                    help="cupykv (the Engine, its default attention path), cupykv_torch (its torch path), "
                         "generate_batch, generate")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--plot-from", metavar="JSON", help="only draw serve.png (into --out) from a serve.json")
    a = ap.parse_args(argv)
    if a.plot_from:
        with open(a.plot_from) as f:
            print(plot(json.load(f), os.path.join(a.out, "serve.png")))
        return 0
    shapes = ["tiny"] if a.smoke else a.shapes.split(",")
    bad = [s for s in shapes if s not in SHAPES]
    if bad:
        ap.error(f"unknown shapes {bad}; known: {sorted(SHAPES)}")
    import importlib.util
    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"python -m cupykv.bench serve needs the hf extra (missing: {missing})", file=sys.stderr)
        return 2
    return serve(shapes, a.smoke, a.contenders.split(","), a.out,
                 " ".join(["python -m cupykv.bench serve"] + [shlex.quote(x) for x in argv]))
