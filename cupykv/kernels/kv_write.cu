// cupykv KV storage writes (cupykv/storage.py): cupykv_write_kv_u16 / cupykv_write_kv_u32.
//
// For each new token t < num_tokens, copy its K row (row = kv_heads * head_dim elements) to
// dst[page_t, offset_t] and its V row to dst[page_t + 1, offset_t], where dst is the group's page view
// [num_pages, tpb, row] and page_t = pages[t] (one layer's row of the write positions).
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
