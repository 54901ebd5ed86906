"""transformers models served on cupykv (cupykv.hf): greedy tokens equal to the model's own generate() (eager
attention, its own cache) in float32, for every architecture the backend serves, with prompts several
windows long, chunked prefill (chunks that are not multiples of the block), mixed prefill and decode steps,
prefix hits, preemption (suspend to the host tier, or recompute), scratch on and off; the window convention
(W - 1 and W + 1 must change the tokens); a broken table entry must change them too; bad input is refused
with nothing changed. Runs on the CPU (host backend) in CI and on the GPU (cuda backend) in the GPU suite."""
import pytest

torch = pytest.importorskip("torch", reason="the hf extra (torch) is not installed")
pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

import cupykv  # noqa: E402
import cupykv.hf as hf  # noqa: E402
from cupykv.hf.tiny import ARCHS, WINDOW, reference_tokens, tiny_model  # noqa: E402

NEW = 8


def device_of(backend: str) -> str:
    if backend == "cuda":
        if not (cupykv.cuda_available() and torch.cuda.is_available()):
            pytest.skip("no usable CUDA GPU here (CuPy or torch without one); the GPU suite runs it")
        return "cuda"
    return "cpu"


@pytest.fixture(params=["host", "cuda"])
def backend(request):
    device_of(request.param)
    return request.param


def prompts(*lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in lengths]


def check_exact(model, engine, batch, new=NEW):
    out = engine.generate(batch, new)
    want = [reference_tokens(model, p, new) for p in batch]
    assert out == want
    return out


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tpb,scratch", [(4, True), (16, False), (32, True)])
def test_tokens_equal_generate(backend, arch, tpb, scratch):
    model = tiny_model(arch).to(device_of(backend))
    # prompts past 3 windows, chunks of 13 (no multiple of any block size): steps mix prefill and decode
    engine = hf.Engine(model, max_batch=3, tokens_per_block=tpb, max_step_tokens=13, max_seq_len=96,
                       swa_scratch_reuse=scratch, backend=backend)
    check_exact(model, engine, prompts(30, 5, 27, 41))
    assert engine.stats.steps > 0 and max(engine.stats.step_tokens) == 13


@pytest.mark.parametrize("attention", ["torch", "triton"])
def test_requests_that_reach_max_seq_len_are_exact(backend, attention):
    """Decoding up to the last position max_seq_len allows: the table is ceil((63 + 1) / 16) = 4 blocks wide,
    so the blocks a sliding window spans from the last block run past the table's end, and those columns
    must count for nothing (the learned sinks make a doubled key change the tokens)."""
    if attention == "triton" and backend != "cuda":
        pytest.skip("the Triton path runs on CUDA (the GPU suite)")
    model = tiny_model("gpt_oss").to(device_of(backend))
    engine = hf.Engine(model, max_batch=2, tokens_per_block=16, max_seq_len=63, backend=backend,
                       attention=attention)
    check_exact(model, engine, prompts(51, 47, 60), new=63 - 60)
    check_exact(model, engine, prompts(51, seed=3), new=12)


def test_window_convention_off_by_one_changes_tokens(monkeypatch):
    """transformers' sliding_window W and cupykv's W are the same keys (p - W, p]: served with W - 1 or W + 1
    the tokens must differ (the test would pass with either otherwise)."""
    model = tiny_model("mistral")
    batch = prompts(40, 33, 45)
    want = [reference_tokens(model, p, NEW) for p in batch]
    attend = hf.PagedBatch.attend
    for delta in (-1, 1):
        def shifted(self, layer, *args, delta=delta):
            w = self.windows[layer]
            self.windows[layer] = w + delta
            try:
                return attend(self, layer, *args)
            finally:
                self.windows[layer] = w
        monkeypatch.setattr(hf.PagedBatch, "attend", shifted)
        out = hf.Engine(model, max_batch=3, tokens_per_block=4, max_seq_len=96).generate(batch, NEW)
        assert out != want, f"window {WINDOW + delta} gave the tokens of window {WINDOW}"
    monkeypatch.setattr(hf.PagedBatch, "attend", attend)
    assert hf.Engine(model, max_batch=3, tokens_per_block=4, max_seq_len=96).generate(batch, NEW) == want


def test_a_broken_table_entry_changes_tokens(monkeypatch):
    """Negative control: one table cell of one layer pointing at another page must show."""
    model = tiny_model("gemma3")
    batch = prompts(30, 26)
    want = [reference_tokens(model, p, NEW) for p in batch]
    init = hf.PagedBatch.__init__

    def broken(self, step, storage, *args):
        init(self, step, storage, *args)
        # the full-attention layer, entry 0: block 1's K and V read block 0's pages
        self.tables[5, 0, :, 1] = self.tables[5, 0, :, 0]
    monkeypatch.setattr(hf.PagedBatch, "__init__", broken)
    out = hf.Engine(model, max_batch=2, tokens_per_block=4, max_seq_len=96).generate(batch, NEW)
    assert out != want


def test_prefix_hits_are_counted_and_exact(backend):
    """A shared system prompt: the second request hits it at the first one's chunk end (a retained
    boundary), exactly 32 tokens, and both outputs equal generate()."""
    model = tiny_model("gemma3").to(device_of(backend))
    system = prompts(32, seed=7)[0]
    first, second = system + prompts(9, seed=8)[0], system + prompts(5, seed=9)[0]
    engine = hf.Engine(model, max_batch=2, tokens_per_block=4, max_step_tokens=32, max_seq_len=96, backend=backend)
    check_exact(model, engine, [first])
    check_exact(model, engine, [second])
    assert engine.stats.hit_tokens == 32


@pytest.mark.parametrize("tier", [0, 1 << 16])
def test_preemption_keeps_the_output(backend, tier):
    """A pool too small for every request at once: the newest is suspended to the host tier (tier > 0) or
    freed and computed again; every output still equals generate()."""
    model = tiny_model("gpt_oss").to(device_of(backend))
    engine = hf.Engine(model, max_batch=4, tokens_per_block=4, max_step_tokens=24, max_seq_len=96,
                       memory_bytes=100_000, host_tier_bytes=tier, backend=backend)
    check_exact(model, engine, prompts(30, 28, 35, 22), new=16)
    s = engine.stats
    assert (s.preempted_suspend if tier else s.preempted_recompute) > 0


def test_spec_from_config_windows():
    assert hf.layer_windows(tiny_model("gemma3").config) == [WINDOW] * 5 + [None]
    assert hf.layer_windows(tiny_model("gpt_oss").config) == [WINDOW, None] * 2
    assert hf.layer_windows(tiny_model("qwen2").config) == [None, None, WINDOW, WINDOW]
    assert hf.layer_windows(tiny_model("mistral").config) == [WINDOW] * 3
    assert hf.layer_windows(tiny_model("llama").config) == [None] * 3
    spec = hf.spec_from_config(tiny_model("gemma3").config, tokens_per_block=16, max_batch=2, memory_bytes=1 << 20)
    assert (spec.num_kv_heads, spec.head_dim, spec.dtype, spec.tokens_per_block) == (2, 16, "float32", 16)


def test_bad_input_is_refused_and_the_engine_keeps_serving():
    model = tiny_model("gemma3")
    engine = hf.Engine(model, max_batch=2, tokens_per_block=4, max_seq_len=64, max_step_tokens=16,
                       memory_bytes=200_000)
    ok = engine.add_request(prompts(10)[0], NEW)
    with pytest.raises(cupykv.CupykvError, match="empty prompt"):
        engine.add_request([], NEW)
    with pytest.raises(cupykv.CupykvError, match="max_seq_len"):
        engine.add_request(prompts(60)[0], NEW)
    with pytest.raises(cupykv.CupykvError, match="never fit"):
        hf.Engine(model, max_batch=2, tokens_per_block=4, max_seq_len=64, max_step_tokens=4,
                  memory_bytes=12_000).add_request(prompts(50)[0], 10)
    with pytest.raises(cupykv.CupykvError, match="exists already"):
        engine.add_request(prompts(3)[0], NEW, rid=ok)
    with pytest.raises(cupykv.InvalidRequestError, match="attention='flash'"):
        hf.Engine(model, max_batch=2, tokens_per_block=4, max_seq_len=64, attention="flash")
    with pytest.raises(cupykv.CapacityExceededError, match="max_seq_len"):      # the second prompt is refused:
        engine.generate([prompts(3)[0], prompts(60)[0]], NEW)                   # the first must not stay queued
    assert list(engine.requests) == [ok] and [r.rid for r in engine.waiting] == [ok]
    with pytest.raises(cupykv.UnknownRequestError, match="not in this engine"):
        engine.result("never-added")
    chosen = [engine.add_request(prompts(4)[0], NEW, rid=r) for r in range(ok + 1, ok + 9)]   # ids auto ids take
    auto = engine.add_request(prompts(5)[0], NEW)
    assert auto not in [ok, *chosen]
    while engine.has_unfinished():
        engine.step()
    assert engine.result(ok) == reference_tokens(model, prompts(10)[0], NEW)
    assert [engine.result(r) for r in chosen] == [reference_tokens(model, prompts(4)[0], NEW)] * len(chosen)
    assert engine.result(auto) == reference_tokens(model, prompts(5)[0], NEW)


def test_unsupported_models_are_refused_before_anything_is_allocated():
    import transformers as tf
    t5 = tf.T5Config(vocab_size=64, d_model=32, d_ff=64, num_layers=2, num_heads=2, d_kv=16)
    with pytest.raises(hf.UnsupportedModelError, match="encoder-decoder"):
        hf.layer_windows(t5)
    cfg = tiny_model("gemma3").config
    cfg.layer_types = ["sliding_attention"] * 5 + ["chunked_attention"]
    with pytest.raises(hf.UnsupportedModelError, match="chunked_attention"):
        hf.layer_windows(cfg)
    model = tiny_model("llama")
    layer = model.model.layers[1].self_attn            # this layer keeps eager attention: it bypasses cupykv
    forward = layer.forward

    def eager_forward(*args, **kwargs):
        config = layer.config
        saved, config._attn_implementation = config._attn_implementation, "eager"
        try:
            kwargs.pop("cupykv_batch", None)
            return forward(*args, **kwargs)
        finally:
            config._attn_implementation = saved
    layer.forward = eager_forward
    with pytest.raises(hf.UnsupportedModelError, match=r"layers \[1\]"):
        hf.Engine(model, max_batch=2, tokens_per_block=4, max_seq_len=64)


def next_token_logits(engine, prompt, new, monkeypatch):
    """The engine's next-token logits [new, vocab] for one prompt alone (each forward's last row; a prompt
    of one chunk) and its tokens."""
    rows = []
    forward = engine._forward

    def kept(*args):
        logits = forward(*args)
        rows.append(logits[0, -1].float().cpu())
        return logits
    monkeypatch.setattr(engine, "_forward", kept)
    out = engine.generate([prompt], new)[0]
    monkeypatch.setattr(engine, "_forward", forward)
    return torch.stack(rows), out


def forward_logits(model, prompt, out):
    """transformers' own forward over prompt + out (teacher-forced): the rows that predict out, float32."""
    with torch.no_grad():
        ids = torch.tensor([prompt + out], device=model.device)
        return model(ids).logits[0, len(prompt) - 1:-1].float().cpu()


@pytest.mark.parametrize("arch", ["gemma3", "gpt_oss"])
def test_bf16_logits_as_close_to_float32_as_transformers_own_bf16(backend, arch, monkeypatch):
    """bf16: exact tokens are no fair test (logit ties, and GPT-OSS's router flips experts on rounding noise).
    The engine's bf16 next-token logits, against the float32 model's over the same tokens, must be no
    further off than transformers' own bf16 forward is (mean absolute error, with a margin of half)."""
    if backend == "host":
        pytest.importorskip("ml_dtypes", reason="bfloat16 KV on the host backend needs ml_dtypes")
    device = device_of(backend)
    exact = tiny_model(arch).to(device)
    model = tiny_model(arch, dtype=torch.bfloat16).to(device)
    engine = hf.Engine(model, max_batch=1, tokens_per_block=16, max_step_tokens=64, max_seq_len=96)
    ours = theirs = 0.0
    for prompt in prompts(30, 27, 41):
        got, out = next_token_logits(engine, prompt, NEW, monkeypatch)
        want = forward_logits(exact, prompt, out)
        ours += (got - want).abs().mean().item()
        theirs += (forward_logits(model, prompt, out) - want).abs().mean().item()
    assert ours <= 1.5 * theirs, (arch, engine.attention, ours, theirs)


def test_end_tokens_stop_requests_as_generate_does(backend):
    """eos_token_id ends a request with that token, as generate() does; under overlap the step already
    enqueued for it is dropped, and the other requests are unchanged."""
    model = tiny_model("gpt_oss").to(device_of(backend))
    batch = prompts(30, 27, 41, 12)
    full = [reference_tokens(model, p, 12) for p in batch]
    eos = full[0][3]
    engine = hf.Engine(model, max_batch=4, tokens_per_block=4, max_seq_len=96, eos_token_id=eos, backend=backend)
    out = engine.generate(batch, 12)
    assert out == [reference_tokens(model, p, 12, eos_token_id=eos) for p in batch]
    assert len(out[0]) <= 4 and out[0][-1] == eos


def test_without_prefix_caching(backend):
    model = tiny_model("gemma2").to(device_of(backend))
    engine = hf.Engine(model, max_batch=4, tokens_per_block=4, max_seq_len=96, prefix_caching=False, backend=backend)
    check_exact(model, engine, prompts(30, 5, 27, 41, 33))
    assert engine.stats.hit_tokens == 0 and engine.mgr.cache is None


@pytest.mark.parametrize("arch", ["gemma3", "gpt_oss", "gemma2"])
def test_float32_logits_within_a_tolerance_of_transformers(backend, arch, monkeypatch):
    """Each step's next-token logits equal transformers' own forward over the same tokens (float32, up to
    the order of the sums): a request alone, so every forward's last row is its next token's logits."""
    model = tiny_model(arch).to(device_of(backend))
    engine = hf.Engine(model, max_batch=1, tokens_per_block=4, max_step_tokens=64, max_seq_len=96, backend=backend)
    prompt = prompts(37)[0]
    got, out = next_token_logits(engine, prompt, NEW, monkeypatch)
    want = forward_logits(model, prompt, out)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
