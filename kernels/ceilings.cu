// Bandwidth ceilings of the machine, measured at run time (questprof/measure/ceilings.py).
// The read kernel is also the calibration kernel of every byte counter (CUPTI, ncu, NVML GPM):
// it reads exactly n float4 and writes nothing on real data, so its DRAM bytes are known.

// Four independent 16-byte loads per iteration keep enough bytes in flight to reach 4.49 TB/s
// on an H200 (one load per iteration with one wave of blocks stays well under it).
extern "C" __global__ void ceilings_read(const float4* __restrict__ x, long long n,
                                         float* __restrict__ sink) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    float acc = 0.0f;
    for (; i + 3 * stride < n; i += 4 * stride) {
        float4 a = x[i], b = x[i + stride], c = x[i + 2 * stride], d = x[i + 3 * stride];
        acc += (a.x + a.y + a.z + a.w) + (b.x + b.y + b.z + b.w)
             + (c.x + c.y + c.z + c.w) + (d.x + d.y + d.z + d.w);
    }
    for (; i < n; i += stride) {
        float4 a = x[i];
        acc += a.x + a.y + a.z + a.w;
    }
    // Never true on random data, but the compiler cannot know: the loads stay.
    if (acc == 1.2345e30f) sink[0] = acc;
}

// Copy: n float4 read and n float4 written; its bandwidth counts both.
extern "C" __global__ void ceilings_copy(const float4* __restrict__ x, float4* __restrict__ y,
                                         long long n) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + stride < n; i += 2 * stride) {
        float4 a = x[i], b = x[i + stride];
        y[i] = a;
        y[i + stride] = b;
    }
    for (; i < n; i += stride) y[i] = x[i];
}
