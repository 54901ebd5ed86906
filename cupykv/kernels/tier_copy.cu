// cupykv host-tier copies (cupykv/host_tier.py): cupykv_copy_runs.
//
// Copies runs of bytes between device memory and pinned host memory, either way, with the SMs (under
// unified addressing a pinned buffer's host address is a device address too), not with a copy engine.
// On the H200 a copy engine running a large device-to-host copy starts no device-to-host copy of any
// other stream until it has finished, chunked or not, so a suspend made of memcpys held up every small
// copy an engine makes meanwhile (the sampled tokens of each step) for the whole suspend; and a memcpy
// per run blocks the host once the stream's queue is full (a fragmented request: thousands of runs).
// This kernel is one launch for all runs and leaves the copy engines to the engine's own copies
// (docs/performance.md, "Host tier").
//
// runs: [num_runs, 3] (destination byte offset, source byte offset, bytes), in pinned host memory.
// Every block walks the runs in order, TIER_COPY_RUNS_PER_STAGE at a time through shared memory (one
// round trip over the bus per stage, not one per run and thread), and the grid's threads stride over
// each run's 16-byte words (its bytes where the run is not 16-byte aligned). Runs must not overlap.
extern "C" __global__ void __launch_bounds__(TIER_COPY_THREADS)
cupykv_copy_runs(const long long* __restrict__ runs, int num_runs, unsigned char* __restrict__ dst,
                 const unsigned char* __restrict__ src)
{
    __shared__ long long stage[3 * TIER_COPY_RUNS_PER_STAGE];
    const long long first = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
    for (int base = 0; base < num_runs; base += TIER_COPY_RUNS_PER_STAGE) {
        const int count = min(TIER_COPY_RUNS_PER_STAGE, num_runs - base);
        __syncthreads();                    // every thread is done with the previous stage
        for (int i = threadIdx.x; i < 3 * count; i += blockDim.x)
            stage[i] = runs[3LL * base + i];
        __syncthreads();
        for (int r = 0; r < count; ++r) {
            unsigned char* d = dst + stage[3 * r];
            const unsigned char* s = src + stage[3 * r + 1];
            const long long n = stage[3 * r + 2];
            const unsigned long long align = reinterpret_cast<unsigned long long>(d) |
                                             reinterpret_cast<unsigned long long>(s) |
                                             static_cast<unsigned long long>(n);
            if ((align & 15) == 0) {
                uint4* d16 = reinterpret_cast<uint4*>(d);
                const uint4* s16 = reinterpret_cast<const uint4*>(s);
                for (long long i = first; i < n / 16; i += stride)
                    d16[i] = s16[i];
            } else {
                for (long long i = first; i < n; i += stride)
                    d[i] = s[i];
            }
        }
    }
}
