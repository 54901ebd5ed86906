"""The Triton attention path of cupykv.hf (triton_attention.py): the kernel against dense attention computed in
float64 from contiguous K/V (windows, grouped heads, soft-capping, learned sinks, context tiles and decode
entries, pages scattered through a table), and the Engine on that path against transformers' generate().
Compiled on a CUDA GPU; on the CPU the same kernel runs under TRITON_INTERPRET=1 (the CI path: conftest.py
sets it where there is no GPU, before triton is imported)."""
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the hf extra (torch) is not installed")
pytest.importorskip("triton", reason="triton is not installed (the hf extra installs it on Linux x86-64)")
pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

import cupykv  # noqa: E402
import cupykv.hf as hf  # noqa: E402
from cupykv.hf.tiny import ARCHS, reference_tokens, tiny_model  # noqa: E402
from cupykv.hf.triton_attention import TritonAttention  # noqa: E402


@pytest.fixture(params=["cpu", "cuda"])
def device(request):
    if request.param == "cuda":
        if not (torch.cuda.is_available() and cupykv.cuda_available()):
            pytest.skip("no usable CUDA GPU here; the GPU suite runs it")
    elif os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on the CPU is its interpreter, chosen where there is no GPU (TRITON_INTERPRET=1)")
    return torch.device(request.param)


def dense(q, k, v, qpos, window, scaling, softcap, sinks):
    """float64 attention of queries q [n, H, D] at positions qpos over keys k, v [P, KVH, D] at 0..P-1."""
    n, H, D = q.shape
    group = H // k.shape[1]
    k = np.repeat(k, group, axis=1)
    v = np.repeat(v, group, axis=1)
    s = np.einsum("nhd,phd->nhp", q, k) * scaling
    if softcap is not None:
        s = np.tanh(s / softcap) * softcap
    p = np.arange(k.shape[0])
    hidden = p[None, :] > qpos[:, None]
    if window is not None:
        hidden |= p[None, :] <= qpos[:, None] - window
    s = np.where(hidden[:, None, :], -np.inf, s)
    if sinks is not None:
        s = np.concatenate([s, np.broadcast_to(sinks[None, :, None], (n, H, 1))], axis=-1)
    e = np.exp(s - s.max(-1, keepdims=True))
    w = e / e.sum(-1, keepdims=True)
    if sinks is not None:
        w = w[..., :-1]
    return np.einsum("nhp,phd->nhd", w, v)


@pytest.mark.parametrize("heads,kv_heads,D,tpb", [(4, 2, 16, 4), (8, 1, 64, 16), (2, 2, 32, 32)])
@pytest.mark.parametrize("window,softcap,sinks", [(None, None, False), (7, None, True), (20, 5.0, False),
                                                  (None, 3.0, True)])
def test_kernel_equals_dense_attention(device, heads, kv_heads, D, tpb, window, softcap, sinks):
    rng = np.random.default_rng(heads * 100 + D + tpb + (window or 0))
    # entries: (tokens this step, position of the first): two context chunks (one not at 0), three decodes
    entries = [(37, 0), (11, 29), (1, 70), (1, 5), (1, 44)]
    num_contexts = 2
    blocks = max(-(-(p + n) // tpb) for n, p in entries)
    pages_n = 2 * blocks * len(entries) + 3
    pages = rng.standard_normal((pages_n, tpb, kv_heads, D)).astype(np.float32)
    table = np.full((len(entries) + 1, 2, blocks + 2), -1, np.int32)      # a spare row, spare blocks
    free = rng.permutation(pages_n)
    k_seq, v_seq = [], []
    for e, (n, p) in enumerate(entries):
        nb = -(-(p + n) // tpb)
        table[e, 0, :nb], table[e, 1, :nb] = free[:nb], free[nb:2 * nb]
        free = free[2 * nb:]
        if window is not None:        # blocks no query of the entry can see are gone (no page)
            first = max(0, p - window + 1) // tpb
            table[e, :, :first] = -1
        k_seq.append(pages[table[e, 0, :nb].clip(0)].reshape(-1, kv_heads, D))
        v_seq.append(pages[table[e, 1, :nb].clip(0)].reshape(-1, kv_heads, D))
    cu = np.concatenate([[0], np.cumsum([n for n, _ in entries])])
    starts = np.array([p for _, p in entries])
    q = rng.standard_normal((int(cu[-1]), heads, D)).astype(np.float32)
    sink = rng.standard_normal(heads).astype(np.float32) * 2 if sinks else None
    scaling = D ** -0.5

    t = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
    out = torch.full(q.shape, float("nan"), device=device)
    # q as transformers hands it: [heads, T, D], seen through a transposed view
    q_view = t(np.ascontiguousarray(q.transpose(1, 0, 2))).transpose(0, 1)
    run = TritonAttention(torch, device, cu, starts, num_contexts)
    run(q_view, t(pages), t(table), out, window=window, scaling=scaling, softcap=softcap,
        sinks=t(sink) if sinks else None)
    got = out.cpu().numpy()
    for e, (n, p) in enumerate(entries):
        qpos = np.arange(p, p + n)
        want = dense(q[cu[e]:cu[e + 1]].astype(np.float64), k_seq[e][:p + n].astype(np.float64),
                     v_seq[e][:p + n].astype(np.float64), qpos, window, scaling, softcap,
                     sink.astype(np.float64) if sinks else None)
        np.testing.assert_allclose(got[cu[e]:cu[e + 1]], want, rtol=2e-4, atol=2e-4, err_msg=f"entry {e}")


def test_kernel_reads_the_table_a_swapped_page_shows(device):
    """Negative control: the same inputs with one K page of the entry's table row pointing at another page
    must give another output (the kernel reads pages through the table)."""
    rng = np.random.default_rng(3)
    tpb, D = 4, 16
    pages = torch.from_numpy(rng.standard_normal((8, tpb, 1, D)).astype(np.float32)).to(device)
    table = torch.tensor([[[0, 1, 2], [3, 4, 5]]], dtype=torch.int32, device=device)
    q = torch.from_numpy(rng.standard_normal((1, 1, D)).astype(np.float32) * 4).to(device)
    cu, starts = np.array([0, 1]), np.array([10])
    outs = []
    broken = table.clone()
    broken[0, 0, 1] = 6
    for row in (table, broken):
        out = torch.empty_like(q)
        TritonAttention(torch, device, cu, starts, 0)(q, pages, row, out, window=None, scaling=D ** -0.5,
                                                     softcap=None, sinks=None)
        outs.append(out)
    assert not torch.allclose(outs[0], outs[1])


@pytest.mark.parametrize("arch", ARCHS)
def test_engine_on_the_triton_path_equals_generate(device, arch):
    """Every architecture, prompts past 3 windows, chunks of 13 (mixed prefill and decode steps), a shared
    prefix: greedy tokens equal to generate() (float32)."""
    model = tiny_model(arch).to(device)
    g = torch.Generator().manual_seed(1)
    batch = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (30, 5, 27, 41)]
    batch.append(batch[0][:24] + [3, 4, 5])
    engine = hf.Engine(model, max_batch=3, tokens_per_block=4, max_step_tokens=13, max_seq_len=96,
                       attention="triton")
    assert engine.attention == "triton"
    assert engine.generate(batch, 8) == [reference_tokens(model, p, 8) for p in batch]


def test_a_head_size_the_kernel_cannot_tile_is_refused_or_served_by_torch(device):
    """head_dim 24 (no power of two): attention="triton" is refused at construction, naming it; "auto" on a
    GPU falls back to the torch path (on the CPU it is the torch path anyway)."""
    import transformers as tf
    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=64, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=24, num_hidden_layers=1, attn_implementation="eager")
    model = tf.LlamaForCausalLM(cfg).eval().to(device)
    with pytest.raises(cupykv.InvalidRequestError, match="head_dim 24"):
        hf.Engine(model, max_batch=1, tokens_per_block=4, max_seq_len=32, attention="triton")
    engine = hf.Engine(model, max_batch=1, tokens_per_block=4, max_seq_len=32)
    assert engine.attention == "torch"
    prompt = [1, 2, 3, 4, 5]
    assert engine.generate([prompt], 4) == [reference_tokens(model, prompt, 4)]
