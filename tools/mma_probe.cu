// Probe of the TF32 mma A-operand lane map (the one fattn-train.cu's fa_load_a uses).
//
// mma.sync.m16n8k8 .tf32: A is 16 x 8 (row), B 8 x 8 (col), C 16 x 8. With g = lane/4, t = lane%4 the
// A registers are a0 (g, t), a1 (g+8, t), a2 (g, t+4), a3 (g+8, t+4); tile<16, 8, float> of mma.cuh maps
// x[l] to (8*(l/2) + g, 2t + l%2), the ACCUMULATOR's map. This loads A both ways, multiplies by a B of
// small integers (exact in TF32) and compares with the CPU product: the A map must be exact, the
// accumulator map must not be (else the probe proves nothing). Exit 0 only when both hold.
#include <cstdio>
#include <cuda_runtime.h>

__global__ void probe(const float * A, const float * B, float * C, bool accumulator_map) {
    const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
    float a[4];
    for (int l = 0; l < 4; ++l) {
        const int i = accumulator_map ? 8*(l/2) + g : g + 8*(l % 2);
        const int j = accumulator_map ? 2*t + l % 2  : t + 4*(l/2);
        a[l] = A[i*8 + j];
    }
    const float b0 = B[t*8 + g], b1 = B[(t + 4)*8 + g]; // B (k, n) row-major: b0 (k = t, n = g), b1 (k = t+4)
    float c[4] = {0, 0, 0, 0};
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(__float_as_uint(a[0])), "r"(__float_as_uint(a[1])), "r"(__float_as_uint(a[2])), "r"(__float_as_uint(a[3])),
          "r"(__float_as_uint(b0)), "r"(__float_as_uint(b1)));
    for (int l = 0; l < 4; ++l) {
        C[(8*(l/2) + g)*8 + 2*t + l % 2] = c[l];
    }
}

static int run(bool accumulator_map, const float * hA, const float * hB, const float * ref) {
    float * dA, * dB, * dC, hC[128];
    cudaMalloc(&dA, 128*4); cudaMalloc(&dB, 64*4); cudaMalloc(&dC, 128*4);
    cudaMemcpy(dA, hA, 128*4, cudaMemcpyHostToDevice);
    cudaMemcpy(dB, hB, 64*4, cudaMemcpyHostToDevice);
    probe<<<1, 32>>>(dA, dB, dC, accumulator_map);
    if (cudaMemcpy(hC, dC, 128*4, cudaMemcpyDeviceToHost) != cudaSuccess) {
        printf("CUDA error: %s\n", cudaGetErrorString(cudaGetLastError()));
        return -1;
    }
    int wrong = 0;
    for (int e = 0; e < 128; ++e) {
        wrong += hC[e] != ref[e];
    }
    cudaFree(dA); cudaFree(dB); cudaFree(dC);
    return wrong;
}

int main() {
    float A[128], B[64], ref[128];
    for (int e = 0; e < 128; ++e) A[e] = (float) ((e*7) % 13 - 6);
    for (int e = 0; e < 64;  ++e) B[e] = (float) ((e*5) % 11 - 5);
    for (int i = 0; i < 16; ++i) for (int n = 0; n < 8; ++n) {
        float s = 0; for (int k = 0; k < 8; ++k) s += A[i*8 + k]*B[k*8 + n];
        ref[i*8 + n] = s;
    }
    const int wrong_a = run(false, A, B, ref), wrong_acc = run(true, A, B, ref);
    printf("mma m16n8k8 tf32 A-operand map: %d of 128 wrong (want 0); accumulator map as A: %d of 128 wrong (want > 0)\n",
           wrong_a, wrong_acc);
    return wrong_a == 0 && wrong_acc > 0 ? 0 : 1;
}
