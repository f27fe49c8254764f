// Throughput of mma.sync m16n8k8 TF32 (HMMA.1688.F32.TF32) on this GPU: the ceiling the register kernels of
// fattn-train.cu can reach, against the TF32 ceiling of cuBLAS (wgmma) that bench prints. Each warp runs
// NACC independent accumulator chains; blocks of W warps, BPS blocks per SM. Prints TFLOP/s per config.
//   nvcc -O3 -arch=sm_90 -o /tmp/mma_rate tools/mma_rate.cu && /tmp/mma_rate
#include <cstdio>
#include <cuda_runtime.h>

template <int NACC>
__global__ void mma_loop(float * out, int iters) {
    float a0 = threadIdx.x*1e-3f, a1 = a0 + 1, a2 = a0 + 2, a3 = a0 + 3, b0 = a0*0.5f, b1 = a1*0.5f;
    float c[NACC][4] = {};
    for (int it = 0; it < iters; ++it) {
#pragma unroll
        for (int n = 0; n < NACC; ++n) {
            asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                : "+f"(c[n][0]), "+f"(c[n][1]), "+f"(c[n][2]), "+f"(c[n][3])
                : "r"(__float_as_uint(a0)), "r"(__float_as_uint(a1)), "r"(__float_as_uint(a2)), "r"(__float_as_uint(a3)),
                  "r"(__float_as_uint(b0)), "r"(__float_as_uint(b1)));
        }
    }
    float s = 0;
    for (int n = 0; n < NACC; ++n) s += c[n][0] + c[n][1] + c[n][2] + c[n][3];
    out[blockIdx.x*blockDim.x + threadIdx.x] = s;
}

template <int NACC>
static void run(int warps, int bps, int sms, float * out) {
    const int iters = 4096, blocks = sms*bps;
    cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
    mma_loop<NACC><<<blocks, 32*warps>>>(out, 16);
    cudaEventRecord(e0);
    mma_loop<NACC><<<blocks, 32*warps>>>(out, iters);
    cudaEventRecord(e1); cudaEventSynchronize(e1);
    float ms; cudaEventElapsedTime(&ms, e0, e1);
    const double flops = 2.0*16*8*8*(double) NACC*iters*warps*blocks;
    printf("warps/SM %3d  chains/warp %2d  %7.1f TFLOP/s\n", warps*bps, NACC, flops/ms/1e9);
}

int main() {
    int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    float * out; cudaMalloc(&out, sms*8*1024*sizeof(float));
    for (int bps : {2, 4, 8}) {
        run<1>(4, bps, sms, out); run<2>(4, bps, sms, out); run<4>(4, bps, sms, out); run<8>(4, bps, sms, out); run<16>(4, bps, sms, out);
    }
    return 0;
}
