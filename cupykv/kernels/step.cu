// cupykv step kernels: apply table deltas to the device mirror, then build the page tables and the write
// positions (cupykv_apply_deltas, cupykv_build_step), or the whole step, snapshot copy included, in one
// launch (cupykv_step, near the end of this file: what the manager's pipeline runs; cupykv_step_inline, at
// the end, for a step whose snapshot fits the launch's parameters).
//
// Every kernel reads its per-step counts from the snapshot header on the device, never from launch
// arguments. That keeps launches identical from step to step (a CUDA graph can replay them with a grid
// sized for capacity) and means a stale host-side hint can only change how much of the grid idles,
// never what is computed. (cupykv_step's one exception: a phase given no blocks does not run; the plan gives
// the apply phase none only for a step without deltas.)
//
// The contract these kernels implement is "The conversion contract" in docs/design.md; cupykv/reference.py
// is the oracle and cupykv/backends/host.py holds NumPy emulations of the same kernels.
//
// This file defines none of the constants it shares with Python. The snapshot header word indices (H_*),
// HEADER_WORDS, MODE_FULL / MODE_DELTA (the header's H_MODE: FULL writes the batch's entries whole; DELTA
// writes whole only the entries the host lists, contexts among them, and the changed cells of the others),
// BAD, STEP_THREADS (the block size of every launch), INLINE_SNAPSHOT_WORDS and SMALL_INLINE_SNAPSHOT_WORDS
// come from cupykv/staging.py, cupykv/layout.py and cupykv/kernels/__init__.py: the backend generates
// `constexpr int NAME = value;` lines and prepends them to this file when it loads the module
// (kernels.module_source("step") is the exact source it compiles).

// slot * scale + offset. Unsigned arithmetic so that an out-of-range product wraps exactly like the
// reference's int64 -> int32 store instead of being undefined behaviour.
__device__ __forceinline__ int page_index(int slot, int scale, int offset)
{
    return static_cast<int>(static_cast<unsigned>(slot) * static_cast<unsigned>(scale) +
                            static_cast<unsigned>(offset));
}

// The run r with run_coff[r] <= i < run_coff[r + 1] (run_coff is increasing, run_coff[0] = 0).
__device__ __forceinline__ int find_run(const int* __restrict__ run_coff, int num_runs, int i)
{
    int lo = 0, hi = num_runs;
    while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if (run_coff[mid] <= i)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

// The i-th of the step's changed cells (i < H_NUM_CELLS): its flat index into the table [P, rows, B] and its
// value. Run r covers cells [run_coff[r], run_coff[r + 1]) from run_start[r] on; its values start at
// values[run_value[r]], or, for a fill run (run_value[r] = ~v, negative), every cell takes values[v].
struct Delta {
    long long cell;
    int value;
};

__device__ __forceinline__ Delta delta_at(const int* snap, int i)
{
    const int* run_coff = snap + snap[H_OFF_RUN_COFF];
    const int r = find_run(run_coff, snap[H_NUM_RUNS], i);
    const int k = i - run_coff[r];
    const int v = snap[snap[H_OFF_RUN_VALUE] + r];
    return {static_cast<long long>(snap[snap[H_OFF_RUN_START] + r]) + k,
            snap[snap[H_OFF_VALUES] + (v >= 0 ? v + k : ~v)]};
}

// Apply the step's table deltas to the mirror [P, rows, B]: one thread per changed cell (grid-stride, so
// any fixed grid covers any number of cells). Runs are mostly one or two cells long in decode steps, so a
// thread per cell keeps every lane busy where a block per run would leave most of them idle.
__device__ void apply_deltas(const int* snap, int* mirror, long long mirror_size, int block, int nblocks)
{
    const int num_cells = snap[H_NUM_CELLS];
    for (int i = block * blockDim.x + threadIdx.x; i < num_cells; i += nblocks * blockDim.x) {
        const Delta d = delta_at(snap, i);
        if (0 <= d.cell && d.cell < mirror_size)
            mirror[d.cell] = d.value;
    }
}

extern "C" __global__ void cupykv_apply_deltas(const int* __restrict__ snap, int* __restrict__ mirror,
                                               long long mirror_size)
{
    apply_deltas(snap, mirror, mirror_size, static_cast<int>(blockIdx.x), static_cast<int>(gridDim.x));
}

// base * scale + offset, BAD for BAD: the page of a block that has its own slot.
__device__ __forceinline__ int slot_entry(int base, int scale, int offset)
{
    return base == BAD ? BAD : page_index(base, scale, offset);
}

// An output table cell: slot_entry, except that a BAD base takes the group's null slot (CacheSpec.null_slot;
// group_null[p], BAD when the spec has none), so tile-based consumers that load a whole tile read a
// zero-filled page instead of page -1. Write positions keep BAD (write_positions passes null = BAD), so no
// write ever targets the null slot.
__device__ __forceinline__ int table_entry(int base, int null, int scale, int offset)
{
    return slot_entry(base == BAD ? null : base, scale, offset);
}

// Page index of block b for one layer and role (the conversion contract, docs/design.md). Blocks outside
// [beg, end) use the base slot (a BAD base: the null slot, BAD for none); callers pass an empty range for
// generation entries, so only contexts take the scratch path. slots is null when the step has no scratch
// columns; slot 0 is then used, as the host emulation does, rather than reading whatever section follows
// in the snapshot.
__device__ __forceinline__ int per_layer_entry(int base, int null, int b, int beg, int end, const int* slots,
                                               int scale, int offset)
{
    if (beg <= b && b < end) {
        // Two pages (K, V) per scratch block, packed densely over the request's scratch slots; each layer
        // starts at its own offset inside the slot so that consecutive layers rotate through the pages.
        const int t = (b - beg) * 2;
        const int slot = slots ? slots[t / scale] : 0;
        return page_index(slot, scale, (t % scale + offset) % scale);
    }
    return table_entry(base, null, scale, offset);
}

// What one step kernel needs, read once from the launch arguments and the snapshot header.
struct StepArgs {
    const int* snap;
    const int* mirror;        // [P, rows, B], deltas already applied
    int* out;                 // [planes, max_batch, 2, B]; planes = L (PER_LAYER) or P (shared)
    int* row_entry;           // [rows]: the entry at which each row's tables were last written whole
    int* pages;               // [L, capacity]
    int* offsets;             // [capacity]
    const int* layer_koff;
    const int* group_scale;
    const int* group_null;    // [P]: each group's null slot, or BAD (CacheSpec.null_slot off)
    const int* group_layers;  // [P + 1 + L]: starts, then each group's layers (Layout.group_layers)
    int num_layers, num_groups, rows, max_batch, B, capacity, tpb, shared;
};

// The layers of group p (Layout.group_layers): layer(j) for j in [first, last).
struct GroupLayers {
    const int* layers;
    int first, last;
    __device__ __forceinline__ int layer(int j) const { return layers[j]; }
};

__device__ __forceinline__ GroupLayers layers_of(const StepArgs& a, int p)
{
    return {a.group_layers + a.num_groups + 1, a.group_layers[p], a.group_layers[p + 1]};
}

// The output planes of group p's tables: plane(j) for j in [first, last), and the K offset koff(j) its
// pages get. PER_LAYER: the group's layers, each with its own offset; SHARED: plane p alone, offset 0 (K =
// base * scale, V = K + 1; the consumer adds the layer's offset).
struct TablePlanes {
    GroupLayers g;
    const int* layer_koff;
    int p;
    bool shared;
    __device__ __forceinline__ int plane(int j) const { return shared ? p : g.layer(j); }
    __device__ __forceinline__ int koff(int j) const { return shared ? 0 : layer_koff[g.layer(j)]; }
};

__device__ __forceinline__ TablePlanes table_planes(const StepArgs& a, int p)
{
    TablePlanes t{layers_of(a, p), a.layer_koff, p, a.shared != 0};
    if (t.shared) {
        t.g.first = 0;
        t.g.last = 1;
    }
    return t;
}

// The context scratch range and slots of batch entry s in group p (an empty range for generation entries).
struct Scratch {
    int beg = 0, end = 0;
    const int* slots = nullptr;
};

__device__ __forceinline__ Scratch scratch_of(const int* snap, int p, int s)
{
    Scratch sc;
    const int num_contexts = snap[H_NUM_CONTEXTS];
    if (s < num_contexts) {
        const int ps = p * num_contexts + s;
        sc.beg = snap[snap[H_OFF_BEGS] + ps];
        sc.end = snap[snap[H_OFF_ENDS] + ps];
        const int width = snap[H_SCRATCH_WIDTH];
        if (width > 0)
            sc.slots = snap + snap[H_OFF_SCRATCH] + static_cast<long long>(ps) * width;
    }
    return sc;
}

__device__ __forceinline__ int clamp_row(int row, int rows)
{
    return min(max(row, 0), rows - 1);   // a corrupt snapshot (unsafe staging) stays inside the buffers
}

static_assert(QUAD_BLOCKS * sizeof(int) == sizeof(int4), "a quad of blocks is one int4 load or store");

// How many threads share one item's layers: the threads a grid of `stride` leaves to each of `items`, at most
// `num_layers` (no group has more). 1 when the items fill the grid, so a large batch keeps a thread per item.
template <typename Index>
__device__ __forceinline__ int layer_split(Index stride, Index items, int num_layers)
{
    return static_cast<int>(max(Index(1), min(stride / max(items, Index(1)), static_cast<Index>(num_layers))));
}

// FULL mode: every output cell of the batch's rows, out[plane, s, role, b] for s < num_seqs, and the null page
// (BAD without a null slot) for the padding rows [num_seqs, pad_to). A work item is (group, entry, quad of 4
// blocks): one 16-byte mirror load, then two 16-byte stores (K, V) into planes of the group (its layers,
// PER_LAYER; the group's own plane, SHARED). What an item needs (its row, scratch range, scale) is looked up
// once for all the planes it writes: looked up per plane, the same lookups held large builds well below the
// write bandwidth (docs/host_profile.md in git history).
// When the grid has more threads than there are items (small batches: step_grid then sizes it up to a thread
// per plane quad), each group's layers are split over `split` threads per item, so a batch of one still
// spreads over many blocks. Consecutive threads take consecutive quads of the same layers, so a warp's
// stores are contiguous (512 bytes where the warp stays in one row): the write pattern of a memset.
// Also records in row_entry, for the changed cells of later steps, the entry each row was written at.
// entries: the entries to write (a DELTA step's rebuilt ones, padding rows among them; per_group covers
// that many), or nullptr: the batch's entries and padding rows [0, per_group / (B / QUAD_BLOCKS)).
// Index is int when the work count fits (64-bit division costs several times more), else long long.
template <typename Index>
__device__ void full_tables(const StepArgs& a, int block, int nblocks, Index per_group, Index items,
                            const int* entries)
{
    const int* snap = a.snap;
    const int quads = a.B / QUAD_BLOCKS;
    const int num_seqs = max(0, min(snap[H_NUM_SEQS], a.max_batch));
    const int live = max(num_seqs, min(snap[H_PAD_TO], a.max_batch));
    const int* copy_idx = snap + snap[H_OFF_COPY_IDX];
    const Index stride = static_cast<Index>(nblocks) * blockDim.x;
    const int split = a.shared ? 1 : layer_split(stride, items, a.num_layers);
    const Index total = items * split;

    for (Index k = static_cast<Index>(block) * blockDim.x + threadIdx.x; k < total; k += stride) {
        const int part = static_cast<int>(k / items);      // this thread's share of the group's layers
        const Index i = k - part * items;
        const int p = static_cast<int>(i / per_group);
        const Index q = i - p * per_group;
        const int e = static_cast<int>(q / quads);
        const int b0 = static_cast<int>(q - static_cast<Index>(e) * quads) * QUAD_BLOCKS;
        const int s = entries ? min(max(entries[e], 0), live - 1) : e;
        int4 base = make_int4(BAD, BAD, BAD, BAD);   // a padding row: every cell as for a BAD base
        Scratch sc;
        if (s < num_seqs) {
            const int row = clamp_row(copy_idx[s], a.rows);
            if (p == 0 && b0 == 0 && part == 0)
                a.row_entry[row] = s;
            base = *reinterpret_cast<const int4*>(a.mirror + (static_cast<long long>(p) * a.rows + row) * a.B + b0);
            if (!a.shared)
                sc = scratch_of(snap, p, s);
        }
        const int scale = a.group_scale[p];
        const int null = a.group_null[p];
        const TablePlanes planes = table_planes(a, p);     // SHARED: no scratch either
        for (int j = planes.g.first + part; j < planes.g.last; j += split) {
            const int plane = planes.plane(j);
            const int off = planes.koff(j);
            const int4 kq = make_int4(per_layer_entry(base.x, null, b0 + 0, sc.beg, sc.end, sc.slots, scale, off),
                                      per_layer_entry(base.y, null, b0 + 1, sc.beg, sc.end, sc.slots, scale, off),
                                      per_layer_entry(base.z, null, b0 + 2, sc.beg, sc.end, sc.slots, scale, off),
                                      per_layer_entry(base.w, null, b0 + 3, sc.beg, sc.end, sc.slots, scale, off));
            const int4 vq = make_int4(
                per_layer_entry(base.x, null, b0 + 0, sc.beg, sc.end, sc.slots, scale, off + 1),
                per_layer_entry(base.y, null, b0 + 1, sc.beg, sc.end, sc.slots, scale, off + 1),
                per_layer_entry(base.z, null, b0 + 2, sc.beg, sc.end, sc.slots, scale, off + 1),
                per_layer_entry(base.w, null, b0 + 3, sc.beg, sc.end, sc.slots, scale, off + 1));
            int* dst = a.out + ((static_cast<long long>(plane) * a.max_batch + s) * 2) * a.B + b0;
            *reinterpret_cast<int4*>(dst) = kq;
            *reinterpret_cast<int4*>(dst + a.B) = vq;
        }
    }
}

// The changed cells (the snapshot's deltas) of the entries this step does not write whole: in DELTA mode
// the batch's entries but the rebuilt ones, and in both modes the entries past the batch that keep a row's
// tables (the held section), so that a later step finds them current. One thread per changed cell: the
// cell's row was last written whole at entry e = row_entry[row]; the cell goes there if this step has the
// row at e (a generation entry of the batch, or held past it), and is skipped otherwise (the row left e,
// or e is a context). A thread writing an entry whole may change row_entry[row] while a thread here reads
// it; either value leads to a skip or to the entry being written whole, with the same value for the cell.
// A cell is written into the layers of its group (Layout.group_layers). A few dozen cells per decode step
// instead of the whole live output. In a step whose table threads have nothing else to write (spread: DELTA
// with no rebuilt entry, a steady decode step), each cell's layers are split over the threads the cells leave
// idle, as full_tables splits them: one thread writing every layer of a 52-layer group is a chain of dependent
// loads, microseconds long, that the whole step waits for. A step that writes entries whole keeps a thread
// per cell: there every table thread has a share of those entries, and a split would put a cell's lookups
// ahead of it on each of them (an 8-chunk context step, whose cells are thousands, took 1-2.7 us longer).
__device__ void delta_tables(const StepArgs& a, int block, int nblocks, bool spread)
{
    const int* snap = a.snap;
    const int num_cells = snap[H_NUM_CELLS];
    const int num_seqs = max(0, min(snap[H_NUM_SEQS], a.max_batch));
    const int num_contexts = snap[H_NUM_CONTEXTS];
    const int live = max(num_seqs, min(snap[H_PAD_TO], a.max_batch));
    const bool full = snap[H_MODE] != MODE_DELTA;     // every entry of the batch is written whole
    const int num_held = min(max(snap[H_NUM_HELD], 0), a.max_batch - live);
    const int* held = snap + snap[H_OFF_HELD];
    const int* copy_idx = snap + snap[H_OFF_COPY_IDX];
    const long long plane_cells = static_cast<long long>(a.rows) * a.B;
    const int stride = nblocks * blockDim.x;
    const int split = a.shared || !spread ? 1 : layer_split(stride, num_cells, a.num_layers);

    // (num_cells * split <= max(num_cells, stride): an int, as num_cells is)
    for (int k = block * blockDim.x + threadIdx.x; k < num_cells * split; k += stride) {
        const int part = k / num_cells;         // this thread's share of the group's layers
        const int i = k - part * num_cells;
        const Delta d = delta_at(snap, i);
        const long long cell = d.cell;
        const int p = static_cast<int>(cell / plane_cells);
        const int row = static_cast<int>((cell % plane_cells) / a.B);
        const int b = static_cast<int>(cell % a.B);
        if (cell < 0 || p >= a.num_groups)
            continue;
        const int s = a.row_entry[row];
        const bool here = s < live ? !full && s >= num_contexts && s < num_seqs && copy_idx[s] == row
                                   : s - live < num_held && held[s - live] == row;
        if (s < 0 || !here)
            continue;
        const int base = d.value;
        const int scale = a.group_scale[p];
        const int null = a.group_null[p];
        const TablePlanes planes = table_planes(a, p);
        for (int j = planes.g.first + part; j < planes.g.last; j += split) {
            const int plane = planes.plane(j);
            const int off = planes.koff(j);
            int* dst = a.out + ((static_cast<long long>(plane) * a.max_batch + s) * 2) * a.B + b;
            dst[0] = table_entry(base, null, scale, off);
            dst[a.B] = table_entry(base, null, scale, off + 1);
        }
    }
}

// Where each new token of the step goes: pages[l, t] = the K page index of new token t for layer l (V = K + 1),
// offsets[t] = its position inside the page. Computed from the mirror with the same rules as the tables
// (scratch blocks of contexts land on their scratch pages; shared tables get the layer's K offset added), so
// it does not wait for the table writes; a BAD base stays BAD here, null slot or not (storage skips and counts
// such a token), so no write ever targets the null slot. t runs over the step's new tokens in batch order: entry s owns
// [cu_tokens[s], cu_tokens[s+1]) and its first new token is at sequence position start_pos[s]. Everything is
// clamped, so a corrupt snapshot (unsafe staging) writes garbage inside the buffers, never outside them.
// A thread per (group, token), tokens fastest: it finds the token's entry and mirror cell once, then writes
// the token's page for each layer of the group (a warp's stores of pages[l, t] are contiguous). A thread per
// (layer, token) would repeat the entry search, a chain of dependent loads for context tokens, per layer.
// When the grid has more threads than (group, token) items (a decode step: the host grows its grid towards a
// thread per (layer, token)), each item's layers are split over `split` threads instead, as in full_tables: a
// decode step would otherwise write all of a group's layers from one thread per token, a chain of dependent
// loads per layer that the whole step waits for.
// Index is int when the work count fits, else long long (as in full_tables).
template <typename Index>
__device__ void write_positions(const StepArgs& a, int block, int nblocks, Index total)
{
    const int* snap = a.snap;
    const int num_seqs = max(0, min(snap[H_NUM_SEQS], a.max_batch));
    const int* copy_idx = snap + snap[H_OFF_COPY_IDX];
    const int* cu = snap + snap[H_OFF_CU_TOKENS];
    const int* start_pos = snap + snap[H_OFF_START_POS];
    const long long cu0 = cu[0];
    const Index work = total * a.num_groups;
    const Index stride = static_cast<Index>(nblocks) * blockDim.x;
    const int split = layer_split(stride, work, a.num_layers);

    for (Index k = static_cast<Index>(block) * blockDim.x + threadIdx.x; k < work * split; k += stride) {
        const int part = static_cast<int>(k / work);      // this thread's share of the group's layers
        const Index i = k - part * work;
        const int p = static_cast<int>(i / total);
        const Index t = i - p * total;
        // The entry that owns token t: the first s with cu[s + 1] - cu[0] > t (entries with no tokens are
        // skipped). With cu_tokens non-decreasing this is exact; otherwise it is some s, still in range.
        // Entry t is tried first: in a decode step every entry has one token and owns token t = s, and
        // checking it is two independent loads where the search is a chain of dependent ones.
        const long long target = cu0 + t;
        int s = static_cast<int>(min(static_cast<long long>(t), static_cast<long long>(num_seqs - 1)));
        if (!(cu[s] <= target && target < static_cast<long long>(cu[s + 1]))) {
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
            s = lo;
        }
        const int row = clamp_row(copy_idx[s], a.rows);
        const long long pos = static_cast<long long>(start_pos[s]) + (target - cu[s]);
        const int block_of = static_cast<int>(min(max(pos, 0LL) / a.tpb, static_cast<long long>(a.B - 1)));
        if (p == 0 && part == 0)
            a.offsets[t] = static_cast<int>(pos & static_cast<long long>(a.tpb - 1));   // pos mod tpb, tpb = 2^k
        const int scale = a.group_scale[p];
        const int base = a.mirror[(static_cast<long long>(p) * a.rows + row) * a.B + block_of];
        Scratch sc;
        if (!a.shared)
            sc = scratch_of(snap, p, s);
        const GroupLayers g = layers_of(a, p);
        for (int j = g.first + part; j < g.last; j += split) {
            const int l = g.layer(j);
            const int off = a.layer_koff[l];
            // SHARED: the K page with the layer's offset; PER_LAYER: scratch blocks of contexts too.
            const int page = a.shared ? slot_entry(base, scale, off)
                                      : per_layer_entry(base, BAD, block_of, sc.beg, sc.end, sc.slots, scale, off);
            a.pages[static_cast<long long>(l) * a.capacity + t] = page;
        }
    }
}

// full_tables over `count` entries (of `entries`, or the first ones), with the narrowest index that fits.
__device__ void full_tables_of(const StepArgs& a, int block, int nblocks, int count, const int* entries)
{
    const long long per_group = static_cast<long long>(count) * (a.B / QUAD_BLOCKS);
    const long long items = per_group * a.num_groups;
    // int while the work (items * split <= max(items, threads of the grid)) and a last stride fit
    if (items <= 0x7FFFFFFFLL - 0x7FFFFFFLL && static_cast<long long>(nblocks) * blockDim.x <= 0x7FFFFFFLL)
        full_tables<int>(a, block, nblocks, static_cast<int>(per_group), static_cast<int>(items), entries);
    else
        full_tables<long long>(a, block, nblocks, per_group, items, entries);
}

// Blocks [0, table_blocks) of `nblocks` build the tables (FULL or DELTA, as the header says); the rest write
// the positions. Both parts read only the mirror and the snapshot, so they need no ordering between them.
__device__ void build_step(const StepArgs& a, int block, int nblocks, int table_blocks)
{
    if (block < table_blocks) {
        const int num_seqs = max(0, min(a.snap[H_NUM_SEQS], a.max_batch));
        const int live = max(num_seqs, min(a.snap[H_PAD_TO], a.max_batch));   // padding rows are written too
        const bool delta = a.snap[H_MODE] == MODE_DELTA;
        const int rebuilt = delta ? min(max(a.snap[H_NUM_REBUILT], 0), live) : 0;
        delta_tables(a, block, table_blocks, delta && rebuilt == 0);
        if (!delta)
            full_tables_of(a, block, table_blocks, live, nullptr);
        else if (rebuilt > 0)
            full_tables_of(a, block, table_blocks, rebuilt, a.snap + a.snap[H_OFF_REBUILT]);
    } else {
        const int* cu = a.snap + a.snap[H_OFF_CU_TOKENS];
        const int num_seqs = max(0, min(a.snap[H_NUM_SEQS], a.max_batch));
        const long long total = min(max(static_cast<long long>(cu[num_seqs]) - cu[0], 0LL),
                                    static_cast<long long>(a.capacity));
        const long long pos_threads = static_cast<long long>(nblocks - table_blocks) * blockDim.x;
        if (total * a.num_groups <= 0x7FFFFFFFLL - 0x7FFFFFFLL && pos_threads <= 0x7FFFFFFLL)
            write_positions<int>(a, block - table_blocks, nblocks - table_blocks, static_cast<int>(total));
        else
            write_positions<long long>(a, block - table_blocks, nblocks - table_blocks, total);
    }
}

// The step's tables and write positions in one launch, after cupykv_apply_deltas. Every part grid-strides
// and reads its counts from the header, so any grid is correct; the host sizes it for the step.
extern "C" __global__ void __launch_bounds__(STEP_THREADS)
cupykv_build_step(const int* __restrict__ snap, const int* __restrict__ mirror, int* __restrict__ out,
                  int* __restrict__ row_entry, int* __restrict__ pages, int* __restrict__ offsets,
                  const int* __restrict__ layer_koff, const int* __restrict__ group_scale,
                  const int* __restrict__ group_null, const int* __restrict__ group_layers, int num_layers,
                  int num_groups, int rows, int max_batch, int B, int capacity, int tpb, int shared,
                  int table_blocks)
{
    const StepArgs a{snap, mirror, out, row_entry, pages, offsets, layer_koff, group_scale,
                     group_null, group_layers, num_layers, num_groups, rows, max_batch, B, capacity, tpb, shared};
    build_step(a, static_cast<int>(blockIdx.x), static_cast<int>(gridDim.x), table_blocks);
}

// ---- The whole step in one launch ------------------------------------------------------------------------
//
// cupykv_step does what the snapshot copy, cupykv_apply_deltas and cupykv_build_step do one after the other,
// in phases inside one grid: copy the snapshot from the pinned ring slot (read over the bus: host memory that
// the device addresses directly) into its device twin; apply the deltas to the mirror; build the tables and
// write positions. A phase's blocks wait for the phases it reads from: the apply for the copy; DELTA tables
// (they read only the snapshot) for the copy; FULL tables, DELTA tables that rebuild entries and the write
// positions (they read the mirror) for the apply as well. That saves the GPU two dependent operations per
// step, and the host two launches.
//
// Roles go by ticket, not blockIdx: a block takes the next ticket when it starts running, so every block a
// waiting block waits for holds a smaller ticket and is already resident; none of them waits for a larger
// one, so the grid always makes progress however many blocks fit on the device at once.
//
// sync[STEP_SYNC_WORDS] (device memory, zero between launches): [0] the next ticket, [1] copy blocks done, [2] apply blocks
// done, [3] blocks exited. The last block to exit zeroes them for the next launch; launches that share a sync
// buffer must not overlap (one mirror's steps run in order on its manager stream).
constexpr int SYNC_TICKET = 0, SYNC_COPIED = 1, SYNC_APPLIED = 2, SYNC_EXITED = 3;
static_assert(SYNC_EXITED + 1 == STEP_SYNC_WORDS, "the phase counters fill the sync buffer the backend allocates");

__device__ __forceinline__ void phase_done(int* sync, int which)
{
    __threadfence();              // this thread's writes are visible device-wide before the count says so
    __syncthreads();
    if (threadIdx.x == 0)
        atomicAdd(sync + which, 1);
}

__device__ __forceinline__ void wait_phase(int* sync, int which, int blocks)
{
    if (blocks == 0)              // a phase with no blocks (no deltas to apply): nothing to read the count for
        return;
    if (threadIdx.x == 0) {
        while (atomicAdd(sync + which, 0) < blocks)
            __nanosleep(64);
        __threadfence();
    }
    __syncthreads();
}

// The apply and build phases of the block holding ticket t (tickets [0, copy_blocks) copy the snapshot).
__device__ void apply_and_build(int t, const int* snap, int* mirror, long long mirror_size, int* out,
                                int* row_entry, int* pages, int* offsets, const int* layer_koff,
                                const int* group_scale, const int* group_null, const int* group_layers,
                                int num_layers, int num_groups, int rows, int max_batch, int B, int capacity,
                                int tpb, int shared, int copy_blocks, int apply_blocks, int table_blocks,
                                int* sync)
{
    if (t < copy_blocks + apply_blocks) {
        wait_phase(sync, SYNC_COPIED, copy_blocks);
        apply_deltas(snap, mirror, mirror_size, t - copy_blocks, apply_blocks);
        phase_done(sync, SYNC_APPLIED);
        return;
    }
    const int block = t - copy_blocks - apply_blocks;
    const int nblocks = static_cast<int>(gridDim.x) - copy_blocks - apply_blocks;
    wait_phase(sync, SYNC_COPIED, copy_blocks);
    const bool reads_mirror = block >= table_blocks || snap[H_MODE] != MODE_DELTA || snap[H_NUM_REBUILT] > 0;
    if (reads_mirror)
        wait_phase(sync, SYNC_APPLIED, apply_blocks);
    const StepArgs a{snap, mirror, out, row_entry, pages, offsets, layer_koff, group_scale, group_null,
                     group_layers, num_layers, num_groups, rows, max_batch, B, capacity, tpb, shared};
    build_step(a, block, nblocks, table_blocks);
}

__device__ __forceinline__ int take_ticket(int* sync)
{
    __shared__ int ticket;
    if (threadIdx.x == 0)
        ticket = atomicAdd(sync + SYNC_TICKET, 1);
    __syncthreads();
    return ticket;
}

__device__ __forceinline__ void count_exit(int* sync)
{
    __syncthreads();
    if (threadIdx.x == 0 && atomicAdd(sync + SYNC_EXITED, 1) == static_cast<int>(gridDim.x) - 1) {
        // Every block has passed its waits: nobody reads the counters again in this launch.
        sync[SYNC_TICKET] = sync[SYNC_COPIED] = sync[SYNC_APPLIED] = sync[SYNC_EXITED] = 0;
        __threadfence();
    }
}

extern "C" __global__ void __launch_bounds__(STEP_THREADS)
cupykv_step(const int* host_snap, int* snap, int copy_words, int* mirror, long long mirror_size, int* out,
            int* row_entry, int* pages, int* offsets, const int* __restrict__ layer_koff,
            const int* __restrict__ group_scale, const int* __restrict__ group_null,
            const int* __restrict__ group_layers, int num_layers, int num_groups, int rows, int max_batch,
            int B, int capacity, int tpb, int shared, int copy_blocks, int apply_blocks, int table_blocks,
            int* sync)
{
    const int t = take_ticket(sync);
    if (t < copy_blocks) {
        // 16-byte words where both buffers allow it (ring slots are), then the tail one word at a time.
        const int stride = copy_blocks * blockDim.x;
        const bool vec = ((reinterpret_cast<unsigned long long>(host_snap) |
                           reinterpret_cast<unsigned long long>(snap)) & 15) == 0;
        const int quads = vec ? copy_words / 4 : 0;
        for (int i = t * blockDim.x + threadIdx.x; i < quads; i += stride)
            reinterpret_cast<int4*>(snap)[i] = reinterpret_cast<const int4*>(host_snap)[i];
        for (int i = quads * 4 + t * blockDim.x + threadIdx.x; i < copy_words; i += stride)
            snap[i] = host_snap[i];
        phase_done(sync, SYNC_COPIED);
    } else {
        apply_and_build(t, snap, mirror, mirror_size, out, row_entry, pages, offsets, layer_koff, group_scale,
                        group_null, group_layers, num_layers, num_groups, rows, max_batch, B, capacity, tpb,
                        shared, copy_blocks, apply_blocks, table_blocks, sync);
    }
    count_exit(sync);
}

// ---- A small step's snapshot in the launch ---------------------------------------------------------------
//
// cupykv_step_inline is cupykv_step without the copy phase: the snapshot (its first INLINE_SNAPSHOT_WORDS
// words, at least all the step uses) is a parameter of the launch. The driver copies a launch's parameters
// when the launch is enqueued, so this is a snapshot too, taken then; the phases read it from the constant
// bank instead of reading pinned memory over the bus, and none of them waits for a copy. Its parameters
// stay within the 4 KB every CUDA device takes (tests/test_kernel_compile.py checks the total).
// cupykv_step_inline_small is the same for a snapshot of at most SMALL_INLINE_SNAPSHOT_WORDS words (a small
// batch's decode step): the driver copies the whole parameter block into every launch, and a smaller block
// costs the host less.
template <int WORDS>
struct InlineSnapshot {
    int words[WORDS];
};

// An inline kernel for snapshot structs of WORDS words: cupykv_step's parameters from the mirror on but the
// copy's block count, after the snapshot.
#define STEP_INLINE_KERNEL(NAME, WORDS)                                                                           \
    extern "C" __global__ void __launch_bounds__(STEP_THREADS)                                                    \
    NAME(const __grid_constant__ InlineSnapshot<WORDS> s, int* mirror, long long mirror_size, int* out,           \
         int* row_entry, int* pages, int* offsets, const int* __restrict__ layer_koff,                            \
         const int* __restrict__ group_scale, const int* __restrict__ group_null,                                 \
         const int* __restrict__ group_layers, int num_layers, int num_groups, int rows, int max_batch, int B,    \
         int capacity, int tpb, int shared, int apply_blocks, int table_blocks, int* sync)                        \
    {                                                                                                             \
        apply_and_build(take_ticket(sync), s.words, mirror, mirror_size, out, row_entry, pages, offsets,          \
                        layer_koff, group_scale, group_null, group_layers, num_layers, num_groups, rows,          \
                        max_batch, B, capacity, tpb, shared, 0, apply_blocks, table_blocks, sync);                \
        count_exit(sync);                                                                                         \
    }

STEP_INLINE_KERNEL(cupykv_step_inline, INLINE_SNAPSHOT_WORDS)
STEP_INLINE_KERNEL(cupykv_step_inline_small, SMALL_INLINE_SNAPSHOT_WORDS)
