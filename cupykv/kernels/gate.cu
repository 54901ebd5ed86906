// cupykv test gate (cupykv_gate), used by the race and graph tests through CudaBackend.gate().
//
// Holds the stream it runs on until the host writes a non-zero value into *flag (mapped pinned memory),
// so race tests can order "copy enqueued" before "host rewrites the source" without sleeps. The clock64()
// budget turns a test that forgets to open the gate into a failure the host can see (*timed_out) instead
// of a GPU that never drains. Launch with one thread.
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
