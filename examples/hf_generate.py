"""Serve transformers models on cupykv and check every token against the model's own generate().

Tiny random-initialised Gemma 3 (5 sliding-window layers : 1 full) and GPT-OSS (alternating, learned sinks)
models, float32, on the GPU when there is one (cuda backend) and on the CPU otherwise (host backend). A
batch of prompts that share a system prompt runs through cupykv.hf.Engine; then a follow-up turn of each
conversation (its history plus a new message) hits the prefix cache. Prints tokens/s and cache hits, and
exits 1 if any token differs from model.generate().

    pip install -e ".[hf]" && python examples/hf_generate.py
"""
import sys
import time

import torch

import cupykv  # noqa: E402
import cupykv.hf as hf  # noqa: E402
from cupykv.hf.tiny import reference_tokens, tiny_model  # noqa: E402

NEW = 16


def main() -> int:
    device = "cuda" if torch.cuda.is_available() and cupykv.cuda_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    system = torch.randint(0, 128, (48,), generator=g).tolist()
    questions = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (7, 12, 5, 20)]
    failures = 0
    for arch in ("gemma3", "gpt_oss"):
        model = tiny_model(arch).to(device)
        engine = hf.Engine(model, max_batch=4, tokens_per_block=16, max_step_tokens=64, max_seq_len=256)
        first = [system + q for q in questions]
        t0 = time.perf_counter()
        answers = engine.generate(first, NEW)
        follow = [p + a + torch.randint(0, 128, (6,), generator=g).tolist() for p, a in zip(first, answers)]
        replies = engine.generate(follow, NEW)
        seconds = time.perf_counter() - t0
        s = engine.stats
        wrong = sum(out != reference_tokens(model, p, NEW) for p, out in zip(first + follow, answers + replies))
        failures += wrong
        print(f"{arch:8s} ({engine.mgr.backend.name} backend, {device}, {engine.attention} attention): {len(first + follow)} requests, "
              f"{s.generated_tokens} tokens in {s.steps} steps, {s.generated_tokens / seconds:.0f} tokens/s, "
              f"cache hits {s.hit_tokens} of {s.prompt_tokens} prompt tokens; "
              f"{'all tokens equal generate()' if not wrong else f'{wrong} requests differ from generate()'}")
    print("OK" if not failures else "FAILED")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
