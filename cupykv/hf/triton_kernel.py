"""The Triton source of the paged attention kernel that triton_attention.py launches (its docstring draws
what a program does). Imported on first use only, so that `import cupykv.hf` needs no triton and a
TRITON_INTERPRET=1 set by the caller (the CPU tests) takes effect."""
import triton
import triton.language as tl


@triton.jit
def key_block(n0, qv, qpos, lo, hi, row, pages, kvh, m_i, l_i, acc, scaling, softcap, window,
              stride_pp, stride_po, stride_ph, stride_tk, d,
              BLOCK_N: tl.constexpr, TPB: tl.constexpr, HAS_WINDOW: tl.constexpr,
              HAS_SOFTCAP: tl.constexpr, IEEE: tl.constexpr):
    """Keys [n0, n0 + BLOCK_N) into the running softmax of every row: (m_i, l_i, acc) updated."""
    kpos = n0 + tl.arange(0, BLOCK_N)
    kin = (kpos >= lo) & (kpos < hi)
    blk = kpos // TPB
    kpage = tl.load(row + blk, mask=kin, other=-1)
    vpage = tl.load(row + stride_tk + blk, mask=kin, other=-1)
    kin = kin & (kpage >= 0)
    at = (kpos % TPB)[:, None] * stride_po + kvh * stride_ph + d[None, :]
    k = tl.load(pages + kpage[:, None].to(tl.int64) * stride_pp + at, mask=kin[:, None], other=0.0)
    v = tl.load(pages + vpage[:, None].to(tl.int64) * stride_pp + at, mask=kin[:, None], other=0.0)
    if IEEE:
        s = tl.dot(qv, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(qv, tl.trans(k))
    s = s * scaling
    if HAS_SOFTCAP:
        s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))      # softcap * tanh(s / softcap)
    visible = kin[None, :] & (kpos[None, :] <= qpos[:, None])
    if HAS_WINDOW:
        visible = visible & (kpos[None, :] > qpos[:, None] - window)
    s = tl.where(visible, s, -1.0e30)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv

@triton.jit
def paged_attention(q, out, pages, table, tiles, sinks, scaling, softcap, window,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_pp, stride_po, stride_ph,
                    stride_te, stride_tk,
                    GROUP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, D: tl.constexpr, TPB: tl.constexpr,
                    HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                    IEEE: tl.constexpr, FOR_LOOP: tl.constexpr):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    entry = tl.load(tiles + tile * 4)
    t0 = tl.load(tiles + tile * 4 + 1)
    n = tl.load(tiles + tile * 4 + 2)
    p0 = tl.load(tiles + tile * 4 + 3)
    r = tl.arange(0, BLOCK_M)
    ti = r // GROUP
    qh = kvh * GROUP + r % GROUP
    row_ok = (ti < n) & (ti < BLOCK_T)
    d = tl.arange(0, D)
    qv = tl.load(q + (t0 + ti)[:, None] * stride_qt + qh[:, None] * stride_qh + d[None, :],
                 mask=row_ok[:, None], other=0.0)
    qpos = p0 + ti
    hi = p0 + n                                     # keys [lo, hi) are visible to some row
    lo = p0 * 0
    if HAS_WINDOW:
        lo = tl.maximum(p0 - window + 1, 0)
    if HAS_SINKS:
        m_i = tl.load(sinks + qh, mask=row_ok, other=0.0).to(tl.float32)
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    else:
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    row = table + entry * stride_te
    first = (lo // BLOCK_N) * BLOCK_N
    if FOR_LOOP:            # compiled: a for loop, which Triton pipelines
        for n0 in range(first, hi, BLOCK_N):
            m_i, l_i, acc = key_block(n0, qv, qpos, lo, hi, row, pages, kvh, m_i, l_i, acc, scaling,
                                      softcap, window, stride_pp, stride_po, stride_ph, stride_tk, d,
                                      BLOCK_N, TPB, HAS_WINDOW, HAS_SOFTCAP, IEEE)
    else:                   # TRITON_INTERPRET: its range() cannot take loaded bounds under NumPy >= 2.4
        n0 = first
        while n0 < hi:
            m_i, l_i, acc = key_block(n0, qv, qpos, lo, hi, row, pages, kvh, m_i, l_i, acc, scaling,
                                      softcap, window, stride_pp, stride_po, stride_ph, stride_tk, d,
                                      BLOCK_N, TPB, HAS_WINDOW, HAS_SOFTCAP, IEEE)
            n0 += BLOCK_N
    acc = acc / l_i[:, None]
    tl.store(out + (t0 + ti)[:, None] * stride_ot + qh[:, None] * stride_oh + d[None, :],
             acc.to(out.dtype.element_ty), mask=row_ok[:, None])
