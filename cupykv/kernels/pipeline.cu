// cupykv step pipeline kernels: apply table deltas to the device mirror, then build the page tables.
//
// Every kernel reads its per-step counts from the snapshot header on the device, never from launch
// arguments. That keeps launches identical from step to step (a CUDA graph can replay them with a grid
// sized for capacity) and means a stale host-side hint can only change how much of the grid idles,
// never what is computed.
//
// The contract these kernels implement is DESIGN.md section 3; cupykv/reference.py is the oracle and
// cupykv/backends/host.py holds NumPy emulations of the same kernels.

// Snapshot header word indices. They must match cupykv/staging.py (tests/test_kernel_compile.py checks).
constexpr int H_STEP = 0;
constexpr int H_NUM_RUNS = 1;
constexpr int H_NUM_VALUES = 2;
constexpr int H_NUM_SEQS = 3;
constexpr int H_NUM_CONTEXTS = 4;
constexpr int H_SCRATCH_WIDTH = 5;
constexpr int H_OFF_COPY_IDX = 6;
constexpr int H_OFF_BEGS = 7;
constexpr int H_OFF_ENDS = 8;
constexpr int H_OFF_SCRATCH = 9;
constexpr int H_OFF_RUN_START = 10;
constexpr int H_OFF_RUN_VOFF = 11;
constexpr int H_OFF_VALUES = 12;
constexpr int H_OFF_CU_TOKENS = 13;
constexpr int H_OFF_START_POS = 14;
constexpr int H_NUM_TOKENS = 15;
constexpr int H_MODE = 16;
constexpr int H_PAD_TO = 17;

// H_MODE: how the step's conversion runs. FULL rewrites the batch's rows; DELTA (the batch is the previous
// step's, row for row, and neither step has contexts) rewrites only the cells whose table entry changed.
constexpr int MODE_FULL = 0;
constexpr int MODE_DELTA = 1;

constexpr int BAD = -1;

// slot * scale + offset. Unsigned arithmetic so that an out-of-range product wraps exactly like the
// reference's int64 -> int32 store instead of being undefined behaviour.
__device__ __forceinline__ int page_index(int slot, int scale, int offset)
{
    return static_cast<int>(static_cast<unsigned>(slot) * static_cast<unsigned>(scale) +
                            static_cast<unsigned>(offset));
}

// Apply the step's table deltas (runs of consecutive cells) to the mirror [P, rows, B].
// One block per run (grid-stride, so any fixed grid covers any number of runs); threads stride over the
// run's values, so a long run (a new request's whole row) is still written coalesced.
extern "C" __global__ void cupykv_apply_deltas(const int* __restrict__ snap, int* __restrict__ mirror)
{
    const int num_runs = snap[H_NUM_RUNS];
    const int* run_start = snap + snap[H_OFF_RUN_START];
    const int* run_voff = snap + snap[H_OFF_RUN_VOFF];
    const int* values = snap + snap[H_OFF_VALUES];

    for (int r = blockIdx.x; r < num_runs; r += gridDim.x) {
        const int lo = run_voff[r];
        const int n = run_voff[r + 1] - lo;
        int* dst = mirror + static_cast<long long>(run_start[r]);
        for (int i = threadIdx.x; i < n; i += blockDim.x)
            dst[i] = values[lo + i];
    }
}

// Page index of block b for one layer and role (DESIGN.md section 3). Blocks outside [beg, end) use the
// base slot; callers pass an empty range for generation entries, so only contexts take the scratch path.
// slots is null when the step has no scratch columns; slot 0 is then used, as the host emulation does,
// rather than reading whatever section follows in the snapshot.
__device__ __forceinline__ int per_layer_entry(int base, int b, int beg, int end, const int* slots,
                                               int scale, int offset)
{
    if (beg <= b && b < end) {
        // Two pages (K, V) per scratch block, packed densely over the request's scratch slots; each layer
        // starts at its own offset inside the slot so that consecutive layers rotate through the pages.
        const int t = (b - beg) * 2;
        const int slot = slots ? slots[t / scale] : 0;
        return page_index(slot, scale, (t % scale + offset) % scale);
    }
    return base == BAD ? BAD : page_index(base, scale, offset);
}

// out[L, max_batch, 2, B] from the mirror [P, rows, B].
// Grid: x covers B in quads (4 blocks per thread, int4 loads and stores; B is a multiple of 4 and the
// buffers are 16-byte aligned), y strides over batch entries. Entries s >= num_seqs are never written, so
// a grid sized for max_batch is correct for any step, and the consumer's padding rows keep their values.
extern "C" __global__ void cupykv_convert_per_layer(const int* __restrict__ snap, const int* __restrict__ mirror,
                                                    int* __restrict__ out, const int* __restrict__ layer_group,
                                                    const int* __restrict__ layer_koff,
                                                    const int* __restrict__ group_scale, int num_layers, int rows,
                                                    int max_batch, int B)
{
    const int b0 = 4 * (blockIdx.x * blockDim.x + threadIdx.x);
    if (b0 >= B || snap[H_MODE] == MODE_DELTA)
        return;
    // The output has max_batch rows whatever the header says; never write past it.
    const int num_seqs = min(snap[H_NUM_SEQS], max_batch);
    const int num_contexts = snap[H_NUM_CONTEXTS];
    const int width = snap[H_SCRATCH_WIDTH];
    const int* copy_idx = snap + snap[H_OFF_COPY_IDX];
    const int* begs = snap + snap[H_OFF_BEGS];
    const int* ends = snap + snap[H_OFF_ENDS];
    const int* scratch = snap + snap[H_OFF_SCRATCH];

    for (int s = blockIdx.y; s < num_seqs; s += gridDim.y) {
        const int row = copy_idx[s];
        const bool is_context = s < num_contexts;
        for (int l = 0; l < num_layers; ++l) {
            const int p = layer_group[l];
            const int scale = group_scale[p];
            // Layers of one group re-read the same mirror quad; it is 16 bytes and stays in L1/L2, which
            // is cheaper than holding a per-group copy in registers for an unknown number of groups.
            const int4 base = *reinterpret_cast<const int4*>(
                mirror + (static_cast<long long>(p) * rows + row) * B + b0);
            int beg = 0, end = 0;
            const int* slots = nullptr;
            if (is_context) {
                const int ps = p * num_contexts + s;
                beg = begs[ps];
                end = ends[ps];
                if (width > 0)
                    slots = scratch + static_cast<long long>(ps) * width;
            }
            for (int role = 0; role < 2; ++role) {
                const int offset = layer_koff[l] + role;
                int4 v;
                v.x = per_layer_entry(base.x, b0 + 0, beg, end, slots, scale, offset);
                v.y = per_layer_entry(base.y, b0 + 1, beg, end, slots, scale, offset);
                v.z = per_layer_entry(base.z, b0 + 2, beg, end, slots, scale, offset);
                v.w = per_layer_entry(base.w, b0 + 3, beg, end, slots, scale, offset);
                // 64-bit: L * max_batch * 2 * B exceeds 2^31 words for large models at long context.
                const long long o = ((static_cast<long long>(l) * max_batch + s) * 2 + role) * B + b0;
                *reinterpret_cast<int4*>(out + o) = v;
            }
        }
    }
    // Padding rows [num_seqs, pad_to) of a fixed-size (captured) consumer batch read BAD.
    const int pad_to = min(snap[H_PAD_TO], max_batch);
    const int4 bad = make_int4(BAD, BAD, BAD, BAD);
    for (int s = num_seqs + blockIdx.y; s < pad_to; s += gridDim.y)
        for (int l = 0; l < num_layers; ++l)
            for (int role = 0; role < 2; ++role)
                *reinterpret_cast<int4*>(out + ((static_cast<long long>(l) * max_batch + s) * 2 + role) * B + b0) = bad;
}

__device__ __forceinline__ int shared_entry(int base, int scale, int role)
{
    return base == BAD ? BAD : page_index(base, scale, role);
}

// out[P, max_batch, 2, B]: one table per group; K = base * scale, V = K + 1 (the consumer adds each
// layer's offset through its base pointer). Same grid and row rules as cupykv_convert_per_layer.
extern "C" __global__ void cupykv_convert_shared(const int* __restrict__ snap, const int* __restrict__ mirror,
                                                 int* __restrict__ out, const int* __restrict__ group_scale,
                                                 int num_groups, int rows, int max_batch, int B)
{
    const int b0 = 4 * (blockIdx.x * blockDim.x + threadIdx.x);
    if (b0 >= B || snap[H_MODE] == MODE_DELTA)
        return;
    const int num_seqs = min(snap[H_NUM_SEQS], max_batch);
    const int* copy_idx = snap + snap[H_OFF_COPY_IDX];

    for (int s = blockIdx.y; s < num_seqs; s += gridDim.y) {
        const int row = copy_idx[s];
        for (int p = 0; p < num_groups; ++p) {
            const int scale = group_scale[p];
            const int4 base = *reinterpret_cast<const int4*>(
                mirror + (static_cast<long long>(p) * rows + row) * B + b0);
            for (int role = 0; role < 2; ++role) {
                int4 v;
                v.x = shared_entry(base.x, scale, role);
                v.y = shared_entry(base.y, scale, role);
                v.z = shared_entry(base.z, scale, role);
                v.w = shared_entry(base.w, scale, role);
                const long long o = ((static_cast<long long>(p) * max_batch + s) * 2 + role) * B + b0;
                *reinterpret_cast<int4*>(out + o) = v;
            }
        }
    }
    const int pad_to = min(snap[H_PAD_TO], max_batch);
    const int4 bad = make_int4(BAD, BAD, BAD, BAD);
    for (int s = num_seqs + blockIdx.y; s < pad_to; s += gridDim.y)
        for (int p = 0; p < num_groups; ++p)
            for (int role = 0; role < 2; ++role)
                *reinterpret_cast<int4*>(out + ((static_cast<long long>(p) * max_batch + s) * 2 + role) * B + b0) = bad;
}

// DELTA mode: the batch is the previous step's, row for row, and the output already holds the previous
// step's tables, so only the cells of the table that changed since then (the snapshot's delta runs) need
// rewriting. One thread per changed cell; it finds its run by binary search, its batch entry by a scan of
// copy_idx (cells of rows outside the batch are skipped), and writes that block's entry for every layer
// of the cell's group (PER_LAYER) or for the group (shared != 0). A few dozen cells per decode step
// instead of the whole live output: microseconds instead of the memset floor.
extern "C" __global__ void cupykv_convert_delta(const int* __restrict__ snap, int* __restrict__ out,
                                                const int* __restrict__ layer_group,
                                                const int* __restrict__ layer_koff,
                                                const int* __restrict__ group_scale, int num_layers, int rows,
                                                int max_batch, int B, int shared)
{
    if (snap[H_MODE] != MODE_DELTA)
        return;
    const int num_runs = snap[H_NUM_RUNS];
    const int num_values = snap[H_NUM_VALUES];
    const int num_seqs = min(snap[H_NUM_SEQS], max_batch);
    const int* copy_idx = snap + snap[H_OFF_COPY_IDX];
    const int* run_start = snap + snap[H_OFF_RUN_START];
    const int* run_voff = snap + snap[H_OFF_RUN_VOFF];
    const int* values = snap + snap[H_OFF_VALUES];
    const long long plane = static_cast<long long>(rows) * B;

    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < num_values; i += gridDim.x * blockDim.x) {
        int lo = 0, hi = num_runs;               // the run r with run_voff[r] <= i < run_voff[r + 1]
        while (hi - lo > 1) {
            const int mid = (lo + hi) / 2;
            if (run_voff[mid] <= i)
                lo = mid;
            else
                hi = mid;
        }
        const long long cell = static_cast<long long>(run_start[lo]) + (i - run_voff[lo]);
        const int p = static_cast<int>(cell / plane);
        const int row = static_cast<int>((cell % plane) / B);
        const int b = static_cast<int>(cell % B);
        int s = 0;
        while (s < num_seqs && copy_idx[s] != row)
            ++s;
        if (s == num_seqs)
            continue;
        const int base = values[i];
        const int scale = group_scale[p];
        if (shared) {
            for (int role = 0; role < 2; ++role)
                out[((static_cast<long long>(p) * max_batch + s) * 2 + role) * B + b] = shared_entry(base, scale, role);
            continue;
        }
        for (int l = 0; l < num_layers; ++l) {
            if (layer_group[l] != p)
                continue;
            for (int role = 0; role < 2; ++role) {
                const long long o = ((static_cast<long long>(l) * max_batch + s) * 2 + role) * B + b;
                out[o] = base == BAD ? BAD : page_index(base, scale, layer_koff[l] + role);
            }
        }
    }
}

// Where each new token of the step goes (HostBackend.write_positions is the reference):
// pages[l, t] = the K page index of new token t for layer l (V = K + 1), read from the step's output tables,
// so tokens of scratch blocks land on their scratch pages; offsets[t] = its position inside the page.
// t runs over the step's new tokens in batch order: entry s owns [cu_tokens[s], cu_tokens[s+1]) and its
// first new token is at sequence position start_pos[s]. Counts come from the snapshot header; a fixed grid
// covers any step (grid-stride over tokens). Everything is clamped like the host emulation, so a corrupt
// snapshot (unsafe staging) writes garbage inside the buffers, never outside them: entries at most
// max_batch, tokens at most `capacity`, blocks in [0, B). Tokens >= the step's count are not touched.
// shared: out is [P, max_batch, 2, B] (K = slot * scale) and the layer's K offset is added here;
// otherwise out is [L, max_batch, 2, B].
extern "C" __global__ void cupykv_write_positions(const int* __restrict__ snap, const int* __restrict__ out,
                                                  int* __restrict__ pages, int* __restrict__ offsets,
                                                  const int* __restrict__ layer_group,
                                                  const int* __restrict__ layer_koff, int num_layers,
                                                  int max_batch, int B, int capacity, int tpb, int shared)
{
    const int num_seqs = max(0, min(snap[H_NUM_SEQS], max_batch));
    const int* cu = snap + snap[H_OFF_CU_TOKENS];
    const int* start_pos = snap + snap[H_OFF_START_POS];
    const long long cu0 = cu[0];
    const long long total = min(max(static_cast<long long>(cu[num_seqs]) - cu0, 0LL),
                                static_cast<long long>(capacity));
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;

    for (long long t = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; t < total; t += stride) {
        // The entry that owns token t: the first s with cu[s + 1] - cu[0] > t (entries with no tokens are
        // skipped). With cu_tokens non-decreasing this is exact; otherwise it is some s, still in range.
        const long long target = cu0 + t;
        int lo = 0, hi = num_seqs;
        while (lo < hi) {
            const int mid = (lo + hi) >> 1;
            if (static_cast<long long>(cu[mid + 1]) <= target)
                lo = mid + 1;
            else
                hi = mid;
        }
        if (lo >= num_seqs)
            continue;
        const int s = lo;
        const long long pos = static_cast<long long>(start_pos[s]) + (target - cu[s]);
        long long block = pos < 0 ? 0 : pos / tpb;
        if (block > B - 1)
            block = B - 1;
        offsets[t] = static_cast<int>(pos & static_cast<long long>(tpb - 1));   // pos mod tpb, tpb = 2^k
        for (int l = 0; l < num_layers; ++l) {
            const int plane = shared ? layer_group[l] : l;
            const int k = out[((static_cast<long long>(plane) * max_batch + s) * 2) * B + block];   // role K
            int page = k;
            if (shared && k != BAD)
                page = static_cast<int>(static_cast<unsigned>(k) + static_cast<unsigned>(layer_koff[l]));
            pages[static_cast<long long>(l) * capacity + t] = page;
        }
    }
}

// KV storage writes (cupykv/storage.py): for each new token t < num_tokens, copy its K row (row = kv_heads *
// head_dim elements) to dst[page_t, offset_t] and its V row to dst[page_t + 1, offset_t], where dst is the
// group's page view [num_pages, tpb, row] and page_t = pages[t] (one layer's row of the write positions).
// Elements are copied as raw 2- or 4-byte words, so one kernel serves float16, bfloat16 and float32.
// A token whose page or offset is out of range (BAD included) is skipped and counted in *errors.
template <typename T>
__device__ __forceinline__ void write_kv(const int* __restrict__ pages, const int* __restrict__ offsets,
                                         const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ dst,
                                         int num_tokens, int row, int tpb, long long num_pages,
                                         int* __restrict__ errors)
{
    const long long n = static_cast<long long>(num_tokens) * row;
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
        const long long t = i / row;
        const long long e = i - t * row;
        const long long page = pages[t];
        const int off = offsets[t];
        if (page < 0 || page + 1 >= num_pages || off < 0 || off >= tpb) {
            if (e == 0)
                atomicAdd(errors, 1);
            continue;
        }
        dst[(page * tpb + off) * row + e] = k[i];
        dst[((page + 1) * tpb + off) * row + e] = v[i];
    }
}

extern "C" __global__ void cupykv_write_kv_u16(const int* pages, const int* offsets, const unsigned short* k,
                                               const unsigned short* v, unsigned short* dst, int num_tokens,
                                               int row, int tpb, long long num_pages, int* errors)
{
    write_kv<unsigned short>(pages, offsets, k, v, dst, num_tokens, row, tpb, num_pages, errors);
}

extern "C" __global__ void cupykv_write_kv_u32(const int* pages, const int* offsets, const unsigned int* k,
                                               const unsigned int* v, unsigned int* dst, int num_tokens,
                                               int row, int tpb, long long num_pages, int* errors)
{
    write_kv<unsigned int>(pages, offsets, k, v, dst, num_tokens, row, tpb, num_pages, errors);
}

// Test gate: holds the stream it runs on until the host writes a non-zero value into *flag (mapped
// pinned memory), so race tests can order "copy enqueued" before "host rewrites the source" without
// sleeps. The clock64() budget turns a test that forgets to open the gate into a failure the host can
// see (*timed_out) instead of a GPU that never drains. Launch with one thread.
extern "C" __global__ void cupykv_gate(volatile int* flag, int* timed_out, long long max_cycles)
{
    const long long start = clock64();
    while (*flag == 0) {
        if (clock64() - start > max_cycles) {
            *reinterpret_cast<volatile int*>(timed_out) = 1;
            // The host polls this word while the kernel may still be resident; push it out now.
            __threadfence_system();
            return;
        }
    }
}
