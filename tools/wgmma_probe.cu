// The wgmma operand layout of the flash-attention training kernels, checked on the device (sm_90a):
//   nvcc -std=c++17 -arch=sm_90a -I<ggml>/include -I<ggml>/src -I<ggml>/src/ggml-cuda tools/wgmma_probe.cu \
//        -Xlinker --unresolved-symbols=ignore-all -o /tmp/wgmma_probe && /tmp/wgmma_probe
// Stages A, A2 (64 x K) and B, B2 (N x K) with fa_stage_async in the wgmma's swizzled layout (rows of K floats in
// tiles of LD = K rounded up to 32, zeros past K: a head size padded to its instance), runs fa_abt with
// two products (one warpgroup: C = A B^T and E = A2 B2^T, k steps alternating in one commit group) and compares
// each warp's accumulator tiles with the products computed on the host in double. Values are small integers
// (exact in TF32 and f32), so any layout error shows as a mismatch, not as rounding.
#include "ggml-cuda/fattn-train-mma.cuh"

#include <cstdio>
#include <vector>

template <int NS, int K>
static __global__ void probe_kernel(const float * A, const float * B, float * C) {
    extern __shared__ float raw[];
    float * sm = fa_smem_aligned<true>(raw);
    constexpr int N = 8*NS, LD = (K + 31)/32*32, NT = 128;
    float * As = sm, * Bs = sm + 64*LD, * A2s = Bs + N*LD, * B2s = A2s + 64*LD;
    fa_stage_async<LD, 64, NT, true>(As, A, K, 64, K, K % 4 == 0);
    fa_stage_async<LD, N, NT, true>(Bs, B, K, N, K, K % 4 == 0);
    fa_stage_async<LD, 64, NT, true>(A2s, A + 64*K, K, 64, K, K % 4 == 0);
    fa_stage_async<LD, N, NT, true>(B2s, B + N*K, K, N, K, K % 4 == 0);
    cp_async_wait_all();
    fa_finish_tile<LD, 64, NT, false, true>(As, nullptr);
    fa_finish_tile<LD, N, NT, false, true>(Bs, nullptr);
    fa_finish_tile<LD, 64, NT, false, true>(A2s, nullptr);
    fa_finish_tile<LD, N, NT, false, true>(B2s, nullptr);
    __syncthreads();
    tile<16, 8, float> S[NS], E[NS];
    fa_abt<NS, K, LD, K, LD, 64, N, false, true, true>(S, As, 0, Bs, E, A2s, B2s);
    const int g = threadIdx.x / 4, t = threadIdx.x % 4, r0 = threadIdx.y*16;
    for (int n = 0; n < NS; ++n) {
        for (int e = 0; e < 4; ++e) {
            C[(r0 + g + 8*(e/2))*N + 8*n + 2*t + e%2] = S[n].x[e];
            C[64*N + (r0 + g + 8*(e/2))*N + 8*n + 2*t + e%2] = E[n].x[e];
        }
    }
}

template <int NS, int K>
static int probe() {
    const int N = 8*NS;
    std::vector<float> A(2*64*K), B(2*N*K), C(2*64*N); // the second halves: A2, B2, E
    for (int r = 0; r < 128; ++r) for (int k = 0; k < K; ++k) A[r*K + k] = (float) ((r*7 + k*3) % 11 - 5);
    for (int n = 0; n < 2*N; ++n) for (int k = 0; k < K; ++k) B[n*K + k] = (float) ((n*5 + k*13) % 9 - 4);
    float * dA, * dB, * dC;
    cudaMalloc(&dA, A.size()*4); cudaMalloc(&dB, B.size()*4); cudaMalloc(&dC, C.size()*4);
    cudaMemcpy(dA, A.data(), A.size()*4, cudaMemcpyHostToDevice);
    cudaMemcpy(dB, B.data(), B.size()*4, cudaMemcpyHostToDevice);
    cudaMemset(dC, 0xFF, C.size()*4);
    const size_t smem = 2*(64 + N)*((K + 31)/32*32)*4 + 1024;
    cudaFuncSetAttribute(probe_kernel<NS, K>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) smem);
    probe_kernel<NS, K><<<1, dim3(32, 4), smem>>>(dA, dB, dC);
    const cudaError_t err = cudaDeviceSynchronize();
    if (err != cudaSuccess) {
        printf("wgmma probe n%d k%d: %s\n", N, K, cudaGetErrorString(err));
        return 1;
    }
    cudaMemcpy(C.data(), dC, C.size()*4, cudaMemcpyDeviceToHost);
    int bad = 0;
    for (int q = 0; q < 2; ++q) for (int r = 0; r < 64; ++r) for (int n = 0; n < N; ++n) {
        double ref = 0;
        for (int k = 0; k < K; ++k) ref += (double) A[(q*64 + r)*K + k]*B[(q*N + n)*K + k];
        if (C[(q*64 + r)*N + n] != (float) ref) {
            if (bad++ < 6) printf("  %s[%d][%d] = %g, expected %g\n", q ? "E" : "C", r, n, C[(q*64 + r)*N + n], ref);
        }
    }
    printf("wgmma probe 2 x m64n%dk8 x %d: %s (%d of %d wrong)\n", N, K/8, bad ? "FAIL" : "ok", bad, 2*64*N);
    cudaFree(dA); cudaFree(dB); cudaFree(dC);
    return bad != 0;
}

int main() {
    int fails = 0;
    fails += probe<1, 64>();
    fails += probe<2, 128>();
    fails += probe<2, 80>();
    fails += probe<4, 64>();
    fails += probe<8, 64>();
    fails += probe<2, 256>();
    return fails != 0;
}
