// Standalone harness for the flash-attn-train CUDA kernels: builds in seconds (one translation unit, no
// ggml build), runs the kernels of the patched fattn-train.cu directly on random inputs, and prints each
// TF32 kernel's worst error against the scalar f32 kernel and its median time over repeated launches.
//
//   nvcc -std=c++17 -O3 -arch=sm_90 -I$W/include -I$W/src -I$W/src/ggml-cuda tools/fa_train_harness.cu \
//        -Xlinker --unresolved-symbols=ignore-all -o /tmp/fa_harness   (W = .hotggml/work/ggml)
//   /tmp/fa_harness S Skv Nh Nkv D [causal | icausal | bias | iwindow:W | padding:N]
//
// The host functions of fattn-train.cu (dispatch, supports_op) reference ggml-cuda symbols this program
// does not link; they are never called here. For kernel iteration only: claims come from hotggml bench.
#include "ggml-cuda/fattn-train.cu"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); exit(1); } } while (0)

static float * dev_upload(const std::vector<float> & h) {
    float * d; CK(cudaMalloc(&d, h.size()*sizeof(float)));
    CK(cudaMemcpy(d, h.data(), h.size()*sizeof(float), cudaMemcpyHostToDevice));
    return d;
}

template <typename F>
static float time_ms(F launch, int reps = 7) {
    cudaEvent_t a, b; CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
    launch(); CK(cudaDeviceSynchronize());
    std::vector<float> t;
    for (int r = 0; r < reps; ++r) {
        CK(cudaEventRecord(a)); launch(); CK(cudaEventRecord(b)); CK(cudaEventSynchronize(b));
        float ms; CK(cudaEventElapsedTime(&ms, a, b)); t.push_back(ms);
    }
    std::sort(t.begin(), t.end());
    return t[t.size()/2];
}

static double worst_rel(const std::vector<float> & x, const std::vector<float> & ref) {
    double num = 0, den = 1e-5;
    for (size_t i = 0; i < x.size(); ++i) { num = std::max(num, (double) fabsf(x[i] - ref[i])); den = std::max(den, (double) fabsf(ref[i])); }
    return num/den;
}

template <typename K>
static void launch_k(K kernel, dim3 grid, dim3 nt, size_t smem, const fa_train_params & p) {
    CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) smem));
    kernel<<<grid, nt, smem>>>(p);
    CK(cudaGetLastError());
}

// float64 reference: O [D, Nh, S], LSE [Nh, S], and for dO the gradients dQ, dK, dV (q, k, v layouts; B = 1)
struct ref_out { std::vector<double> O, L, dQ, dK, dV; };

static ref_out reference(const std::vector<float> & q, const std::vector<float> & k, const std::vector<float> & v,
        const std::vector<half> & m, const std::vector<float> & dO, int S, int Skv, int Nh, int Nkv, int D, double scale) {
    ref_out r;
    r.O.assign((size_t) D*Nh*S, 0); r.L.assign((size_t) Nh*S, 0);
    r.dQ.assign(q.size(), 0); r.dK.assign(k.size(), 0); r.dV.assign(v.size(), 0);
    std::vector<double> s(Skv), P(Skv);
    for (int h = 0; h < Nh; ++h) for (int i = 0; i < S; ++i) {
        const int hk = h / (Nh/Nkv);
        const float * qi = &q[((size_t) h*S + i)*D];
        double M = -INFINITY;
        for (int j = 0; j < Skv; ++j) {
            const double mm = m.empty() ? 0.0 : (double) __half2float(m[(size_t) i*Skv + j]);
            double dot = 0; for (int c = 0; c < D; ++c) dot += (double) qi[c]*k[((size_t) hk*Skv + j)*D + c];
            s[j] = std::isinf(mm) ? -INFINITY : scale*dot + mm;
            M = std::max(M, s[j]);
        }
        if (M == -INFINITY) continue; // a fully masked row: O = LSE = dQ = 0
        double l = 0; for (int j = 0; j < Skv; ++j) { P[j] = std::exp(s[j] - M); l += P[j]; }
        const size_t row = (size_t) i*Nh + h;
        r.L[row] = M + std::log(l);
        double Di = 0;
        for (int c = 0; c < D; ++c) {
            double o = 0; for (int j = 0; j < Skv; ++j) o += P[j]/l*v[((size_t) hk*Skv + j)*D + c];
            r.O[row*D + c] = o; Di += o*dO[row*D + c];
        }
        for (int j = 0; j < Skv; ++j) {
            const double pj = P[j]/l;
            if (pj == 0) continue;
            double dp = 0; for (int c = 0; c < D; ++c) dp += dO[row*D + c]*v[((size_t) hk*Skv + j)*D + c];
            const double ds = pj*(dp - Di);
            for (int c = 0; c < D; ++c) {
                r.dQ[((size_t) h*S + i)*D + c] += scale*ds*k[((size_t) hk*Skv + j)*D + c];
                r.dK[((size_t) hk*Skv + j)*D + c] += scale*ds*qi[c];
                r.dV[((size_t) hk*Skv + j)*D + c] += pj*dO[row*D + c];
            }
        }
    }
    return r;
}

static double worst_rel_d(const std::vector<float> & x, const std::vector<double> & ref) {
    double num = 0, den = 1e-5;
    for (size_t i = 0; i < x.size(); ++i) {
        if (!std::isfinite(x[i])) return NAN;
        num = std::max(num, fabs(x[i] - ref[i])); den = std::max(den, fabs(ref[i]));
    }
    return num/den;
}

// the same bits (NaN included, which == would call different)
static bool same_bits(const std::vector<float> & a, const std::vector<float> & b) {
    return a.size() == b.size() && memcmp(a.data(), b.data(), a.size()*sizeof(float)) == 0;
}

int main(int argc, char ** argv) {
    if (argc < 6) { printf("usage: %s S Skv Nh Nkv D [causal]\n", argv[0]); return 2; }
    const int S = atoi(argv[1]), Skv = atoi(argv[2]), Nh = atoi(argv[3]), Nkv = atoi(argv[4]), D = atoi(argv[5]);
    // argv[6]: "causal" a stored f16 causal mask for every kernel; "icausal" the implicit causal mask for the
    // TF32 kernels (no mask in memory) against the f32 kernels on the stored one
    // "bias": a stored mask of finite biases with a fifth -INF, query row 1 and key 2 masked whole, NaN in K
    // and V at key 2 (garbage no result may see), and every kernel checked against a float64 reference
    // "iwindow:W": the implicit window |i' - j| <= W for the TF32 kernels, against the f32 kernels on it stored
    // "padding:N": a stored mask hiding the last N keys from every row (a cross-attention's padding), NaN in
    // their K and V, every kernel checked against a float64 reference
    const bool bias = argc > 6 && strcmp(argv[6], "bias") == 0;
    const int window = argc > 6 && strncmp(argv[6], "iwindow:", 8) == 0 ? atoi(argv[6] + 8) : -1;
    const int pad = argc > 6 && strncmp(argv[6], "padding:", 8) == 0 ? atoi(argv[6] + 8) : 0;
    const bool ref64 = bias || pad > 0; // garbage in K/V: checked against float64, not against the f32 kernels
    const bool causal = argc > 6 && !bias && window < 0 && pad == 0, implicit = (causal && strcmp(argv[6], "icausal") == 0) || window >= 0;
    std::mt19937 gen(42); std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::vector<float> q((size_t) D*S*Nh), k((size_t) D*Skv*Nkv), v((size_t) D*Skv*Nkv);
    for (auto & x : q) x = u(gen); for (auto & x : k) x = u(gen); for (auto & x : v) x = u(gen);
    std::vector<half> m;
    if (causal) {
        m.resize((size_t) S*Skv);
        for (int i = 0; i < S; ++i) for (int j = 0; j < Skv; ++j) m[(size_t) i*Skv + j] = __float2half(j <= i + (Skv - S) ? 0.0f : -INFINITY);
    }
    if (window >= 0) {
        m.resize((size_t) S*Skv);
        for (int i = 0; i < S; ++i) for (int j = 0; j < Skv; ++j) m[(size_t) i*Skv + j] = __float2half(abs(i + (Skv - S) - j) <= window ? 0.0f : -INFINITY);
    }
    if (bias) {
        m.resize((size_t) S*Skv);
        for (int i = 0; i < S; ++i) for (int j = 0; j < Skv; ++j) {
            const float x = 3.0f*u(gen);
            m[(size_t) i*Skv + j] = __float2half(i == 1 || j == 2 || gen() % 5 == 0 ? -INFINITY : x);
        }
    }
    if (pad > 0) {
        m.assign((size_t) S*Skv, __float2half(0.0f));
        for (int i = 0; i < S; ++i) for (int j = Skv - pad; j < Skv; ++j) m[(size_t) i*Skv + j] = __float2half(-INFINITY);
    }
    fa_train_params p = {};
    std::vector<float> kg = k, vg = v; // the device's copies: NaN at the masked key
    if (bias) for (int h = 0; h < Nkv; ++h) for (int c = 0; c < D; ++c) {
        kg[((size_t) h*Skv + 2)*D + c] = NAN; vg[((size_t) h*Skv + 2)*D + c] = NAN;
    }
    for (int h = 0; h < Nkv; ++h) for (int j = Skv - pad; j < Skv; ++j) for (int c = 0; c < D; ++c) {
        kg[((size_t) h*Skv + j)*D + c] = NAN; vg[((size_t) h*Skv + j)*D + c] = NAN;
    }
    p.q = dev_upload(q); p.k = dev_upload(kg); p.v = dev_upload(vg);
    p.q_nb1 = D; p.q_nb2 = (int64_t) D*S; p.q_nb3 = (int64_t) D*S*Nh;
    p.k_nb1 = D; p.k_nb2 = (int64_t) D*Skv; p.k_nb3 = (int64_t) D*Skv*Nkv;
    p.v_nb1 = D; p.v_nb2 = p.k_nb2; p.v_nb3 = p.k_nb3;
    if (!m.empty()) { half * dm; CK(cudaMalloc(&dm, m.size()*sizeof(half))); CK(cudaMemcpy(dm, m.data(), m.size()*sizeof(half), cudaMemcpyHostToDevice)); p.mask = dm; p.m_nb1 = Skv; p.m_nb3 = (int64_t) S*Skv; }
    p.m_ne3 = 1; p.window = -1; p.kv_split = 1;
    p.D = D; p.Dv = D; p.S = S; p.Skv = Skv; p.Nh = Nh; p.Nkv = Nkv; p.B = 1; p.gqa = Nh/Nkv; p.scale = 1.0f/sqrtf((float) D);
    p.vec_q = p.vec_k = p.vec_v = D % 4 == 0;
    const size_t nO = (size_t) D*Nh*S, nL = (size_t) Nh*S;
    CK(cudaMalloc(&p.O, nO*sizeof(float))); CK(cudaMalloc(&p.LSE, nL*sizeof(float)));

    const half * stored = p.mask;
    auto as_ref  = [&]() { p.mask = stored; p.causal = false; p.window = -1; };
    auto as_test = [&]() { if (implicit) { p.mask = nullptr; p.causal = causal; p.window = window; } };
    as_ref();
    auto run_read = [&](auto launch, std::vector<float> & O, std::vector<float> & L) {
        CK(cudaMemset(p.O, 0xFF, nO*sizeof(float))); CK(cudaMemset(p.LSE, 0xFF, nL*sizeof(float)));
        launch(); CK(cudaDeviceSynchronize());
        O.resize(nO); L.resize(nL);
        CK(cudaMemcpy(O.data(), p.O, nO*sizeof(float), cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(L.data(), p.LSE, nL*sizeof(float), cudaMemcpyDeviceToHost));
    };
    auto f32 = [&]() { const int R = FA_TRAIN_F32_BR; launch_k(fa_train_fwd_f32, dim3((S + R - 1)/R, Nh, 1), FA_TRAIN_F32_NT, fa_f32_get_layout(D, D, 0).total*sizeof(float), p); };
    auto v1 = [&]() { const int R = 16*FA_TRAIN_MMA_NW; launch_k(fa_train_fwd_tf32, dim3((S + R - 1)/R, Nh, 1), dim3(WARP_SIZE, FA_TRAIN_MMA_NW), fa_mma_get_layout(D, D, 0).total*sizeof(float), p); };
    const int Dreg = fa_reg_get_d(D, D);
    // the register kernels read the stored mask's cells: computed in each timed launch, as the backend does
    uint8_t * cells = nullptr;
    if (p.mask) CK(cudaMalloc(&cells, fa_train_cells_bytes(p)));
    auto with_cells = [&]() { fa_train_params pc = p; fa_train_cells_fill(pc, cells, 0); return pc; };
    // the TF32 copies of the streamed operands (fa_train_round_operands), made in each timed launch as the backend does
    float * operands; CK(cudaMalloc(&operands, ((size_t) Nkv*Skv + (size_t) Nh*S)*2*D*sizeof(float)));
    auto v2 = [&]() { fa_train_reg_launch(Dreg, false, false, with_cells(), nullptr, operands, 0); CK(cudaGetLastError()); };
    // without the copies: each streamed tile rounded where it lands (the same bits, checked below)
    auto v2_tiles = [&]() { fa_train_reg_launch(Dreg, false, false, with_cells(), nullptr, nullptr, 0); CK(cudaGetLastError()); };
    // the "x3" arm: the register kernels with the compensated product (the f32 precision on sm_80+)
    auto va = [&]() { fa_train_reg_launch(Dreg, true, false, with_cells(), nullptr, nullptr, 0); CK(cudaGetLastError()); };

    std::vector<float> Or, Lr, O1, L1, O2, L2, Oa, La;
    run_read(f32, Or, Lr);
    as_test();
    run_read(v1, O1, L1);
    const bool have_v2 = Dreg != 0, have_alt = Dreg != 0;
    if (have_v2) run_read(v2, O2, L2);
    if (have_alt) run_read(va, Oa, La);
    double visible = 0;
    for (int i = 0; i < S; ++i) for (int j = 0; j < Skv; ++j) visible += m.empty() || !std::isinf(__half2float(m[(size_t) i*Skv + j]));
    const double flops = 2.0*(2.0*D)*Nh*visible;
    printf("fwd S%d Skv%d Nh%d Nkv%d D%d %s\n", S, Skv, Nh, Nkv, D, bias ? "bias+NaN keys" : pad > 0 ? "padding+NaN keys" : window >= 0 ? "window (TF32 implicit)" :
           causal ? (implicit ? "causal (TF32 implicit)" : "causal") : "none");
    as_ref();
    const float tf = time_ms(f32);
    as_test();
    const float t1 = time_ms(v1);
    printf("  f32      %8.3f ms  %6.1f TFLOP/s\n", tf, flops/tf/1e9);
    printf("  tf32 v1  %8.3f ms  %6.1f TFLOP/s  err O %.2e LSE %.2e\n", t1, flops/t1/1e9, worst_rel(O1, Or), worst_rel(L1, Lr));
    if (have_v2) {
        const float t2 = time_ms(v2);
        printf("  tf32 reg %8.3f ms  %6.1f TFLOP/s  err O %.2e LSE %.2e  (v1/reg %.2fx)\n", t2, flops/t2/1e9, worst_rel(O2, Or), worst_rel(L2, Lr), t1/t2);
        std::vector<float> Ot, Lt;
        run_read(v2_tiles, Ot, Lt);
        const float tt = time_ms(v2_tiles);
        printf("  tf32 reg without the operand copies %8.3f ms (copies/without %.3fx), %s\n", tt, t2/tt,
               same_bits(Ot, O2) && same_bits(Lt, L2) ? "bitwise the same" : "DIFFERENT BITS");
    }
    if (have_alt) {
        const float ta = time_ms(va), t2 = time_ms(v2);
        printf("  f32 x3   %8.3f ms  %6.1f TFLOP/s  err O %.2e LSE %.2e  (x3/reg %.3fx, reg timed again %.3f ms)\n", ta, flops/ta/1e9,
               worst_rel(Oa, Or), worst_rel(La, Lr), ta/t2, t2);
    }

    // backward: O and LSE of the f32 forward, random dO, D_i; each path's dQ, dK, dV against the f32 kernels'
    std::vector<float> dO(nO);
    for (auto & x : dO) x = u(gen);
    as_ref();
    p.dO = dev_upload(dO);
    ref_out ref;
    if (ref64) {
        ref = reference(q, k, v, m, dO, S, Skv, Nh, Nkv, D, p.scale);
        printf("  vs float64: fwd f32 O %.2e LSE %.2e | tf32 v1 O %.2e LSE %.2e", worst_rel_d(Or, ref.O), worst_rel_d(Lr, ref.L),
               worst_rel_d(O1, ref.O), worst_rel_d(L1, ref.L));
        if (have_v2) printf(" | tf32 reg O %.2e LSE %.2e", worst_rel_d(O2, ref.O), worst_rel_d(L2, ref.L));
        if (have_alt) printf(" | f32 x3 O %.2e LSE %.2e", worst_rel_d(Oa, ref.O), worst_rel_d(La, ref.L));
        printf("\n");
        for (size_t e = 0; e < ref.O.size(); ++e) Or[e] = (float) ref.O[e];
        for (size_t e = 0; e < ref.L.size(); ++e) Lr[e] = (float) ref.L[e];
    }
    CK(cudaMemcpy(p.O, Or.data(), nO*sizeof(float), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(p.LSE, Lr.data(), nL*sizeof(float), cudaMemcpyHostToDevice));
    CK(cudaMalloc(&p.Di, nL*sizeof(float)));
    fa_train_di<<<(nL + 255)/256, 256>>>(p);
    const size_t nQ = q.size(), nK = k.size();
    CK(cudaMalloc(&p.dQ, nQ*sizeof(float))); CK(cudaMalloc(&p.dK, nK*sizeof(float))); CK(cudaMalloc(&p.dV, nK*sizeof(float)));
    auto grads = [&](auto dq, auto dkv, std::vector<float> * out) {
        CK(cudaMemset(p.dQ, 0xFF, nQ*sizeof(float))); CK(cudaMemset(p.dK, 0xFF, nK*sizeof(float))); CK(cudaMemset(p.dV, 0xFF, nK*sizeof(float)));
        dq(); dkv(); CK(cudaDeviceSynchronize());
        out[0].resize(nQ); out[1].resize(nK); out[2].resize(nK);
        CK(cudaMemcpy(out[0].data(), p.dQ, nQ*sizeof(float), cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(out[1].data(), p.dK, nK*sizeof(float), cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(out[2].data(), p.dV, nK*sizeof(float), cudaMemcpyDeviceToHost));
    };
    auto dq_f32  = [&]() { const int R = FA_TRAIN_F32_BR; launch_k(fa_train_bwd_dq_f32, dim3((S + R - 1)/R, Nh, 1), FA_TRAIN_F32_NT, fa_f32_get_layout(D, D, 1).total*sizeof(float), p); };
    auto dkv_f32 = [&]() { const int BC = FA_TRAIN_BC; launch_k(fa_train_bwd_dkv_f32, dim3((Skv + BC - 1)/BC, Nkv, 1), FA_TRAIN_F32_NT, fa_f32_get_layout(D, D, 2).total*sizeof(float), p); };
    auto dq_v1   = [&]() { const int R = 16*FA_TRAIN_MMA_NW; launch_k(fa_train_bwd_dq_tf32, dim3((S + R - 1)/R, Nh, 1), dim3(WARP_SIZE, FA_TRAIN_MMA_NW), fa_mma_get_layout(D, D, 1).total*sizeof(float), p); };
    auto dkv_v1  = [&]() { const int N = 16*FA_TRAIN_MMA_NW; launch_k(fa_train_bwd_dkv_tf32, dim3((Skv + N - 1)/N, Nkv, 1), dim3(WARP_SIZE, FA_TRAIN_MMA_NW), fa_mma_get_layout(D, D, 2).total*sizeof(float), p); };
    int nsm; CK(cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, 0));
    const int split = fa_dkv_split(p, nsm);
    float * scratch; CK(cudaMalloc(&scratch, 2*(size_t) split*nK*sizeof(float)));
    // the register backward as the backend launches it (one grid, dK/dV split as the backend does it), or
    // one kind of its blocks alone: want 1 = dQ, 2 = dK/dV, 3 = both
    auto bwd_reg = [&](bool x3, int want, bool copies = true) {
        fa_train_params ps = p; // the cells once per backward: with dQ (dK/dV alone reads those dQ's launch left)
        if (want & 1) ps = with_cells();
        else if (p.mask) { ps.cell_nx = (Skv + FA_CELL - 1)/FA_CELL; ps.cell_ny = (S + FA_CELL - 1)/FA_CELL; ps.cells = cells; }
        ps.kv_split = split;
        if (!(want & 1)) ps.dQ = nullptr;
        if (!(want & 2)) ps.dK = ps.dV = nullptr;
        switch (Dreg) { case 64: x3 ? fa_train_bwd_tf32_reg_launch<64, true>(ps, scratch, nullptr, 0) : fa_train_bwd_tf32_reg_launch<64, false>(ps, scratch, copies ? operands : nullptr, 0); break;
                        case 128: x3 ? fa_train_bwd_tf32_reg_launch<128, true>(ps, scratch, nullptr, 0) : fa_train_bwd_tf32_reg_launch<128, false>(ps, scratch, copies ? operands : nullptr, 0); break;
                        default: x3 ? fa_train_bwd_tf32_reg_launch<256, true>(ps, scratch, nullptr, 0) : fa_train_bwd_tf32_reg_launch<256, false>(ps, scratch, copies ? operands : nullptr, 0); }
        CK(cudaGetLastError());
    };
    auto dq_reg  = [&]() { bwd_reg(false, 1); };
    auto dkv_reg = [&]() { bwd_reg(false, 2); };
    auto bwd_one = [&]() { bwd_reg(false, 3); };
    auto bwd_one_tiles = [&]() { bwd_reg(false, 3, false); }; // no operand copies
    auto nothing = [&]() {};
    auto dq_alt  = [&]() { bwd_reg(true, 1); };
    auto dkv_alt = [&]() { bwd_reg(true, 2); };
    std::vector<float> gr[3], g1[3], g2[3], ga[3];
    as_ref();
    grads(dq_f32, dkv_f32, gr);
    const float tdq_f = time_ms(dq_f32), tkv_f = time_ms(dkv_f32);
    as_test();
    grads(dq_v1, dkv_v1, g1);
    const double bflops = 2.5*flops;
    const float tdq1 = time_ms(dq_v1), tkv1 = time_ms(dkv_v1);
    printf("bwd\n  f32      dQ %8.3f ms dKV %8.3f ms  %6.1f TFLOP/s\n", tdq_f, tkv_f, bflops/(tdq_f + tkv_f)/1e9);
    printf("  tf32 v1  dQ %8.3f ms dKV %8.3f ms  %6.1f TFLOP/s  err dQ %.2e dK %.2e dV %.2e\n", tdq1, tkv1, bflops/(tdq1 + tkv1)/1e9,
           worst_rel(g1[0], gr[0]), worst_rel(g1[1], gr[1]), worst_rel(g1[2], gr[2]));
    if (ref64) {
        printf("  vs float64: bwd f32 dQ %.2e dK %.2e dV %.2e | tf32 v1 dQ %.2e dK %.2e dV %.2e\n",
               worst_rel_d(gr[0], ref.dQ), worst_rel_d(gr[1], ref.dK), worst_rel_d(gr[2], ref.dV),
               worst_rel_d(g1[0], ref.dQ), worst_rel_d(g1[1], ref.dK), worst_rel_d(g1[2], ref.dV));
    }
    if (have_v2) {
        grads(dq_reg, dkv_reg, g2);
        const float tdq2 = time_ms(dq_reg), tkv2 = time_ms(dkv_reg);
        printf("  tf32 reg dQ %8.3f ms dKV %8.3f ms (split %d)  %6.1f TFLOP/s  err dQ %.2e dK %.2e dV %.2e  (v1/reg %.2fx)\n", tdq2, tkv2,
               split, bflops/(tdq2 + tkv2)/1e9, worst_rel(g2[0], gr[0]), worst_rel(g2[1], gr[1]), worst_rel(g2[2], gr[2]),
               (tdq1 + tkv1)/(tdq2 + tkv2));
        if (ref64) {
            printf("  vs float64: bwd tf32 reg dQ %.2e dK %.2e dV %.2e\n",
                   worst_rel_d(g2[0], ref.dQ), worst_rel_d(g2[1], ref.dK), worst_rel_d(g2[2], ref.dV));
        }
        // the one grid: the same bits as the kinds launched alone, and its time against their sum
        std::vector<float> g3[3];
        grads(bwd_one, nothing, g3);
        const bool same = g3[0] == g2[0] && g3[1] == g2[1] && g3[2] == g2[2];
        const float t1g = time_ms(bwd_one), tsep = time_ms(dq_reg) + time_ms(dkv_reg), t1g2 = time_ms(bwd_one);
        printf("  tf32 reg one grid %8.3f ms (again %.3f), dQ + dKV alone %.3f ms: one/alone %.3fx, %s\n",
               t1g, t1g2, tsep, std::min(t1g, t1g2)/tsep, same ? "bitwise the same" : "DIFFERENT BITS");
        std::vector<float> g4[3];
        grads(bwd_one_tiles, nothing, g4);
        const float tt = time_ms(bwd_one_tiles);
        printf("  tf32 reg one grid without the operand copies %8.3f ms (copies/without %.3fx), %s\n", tt, std::min(t1g, t1g2)/tt,
               same_bits(g4[0], g3[0]) && same_bits(g4[1], g3[1]) && same_bits(g4[2], g3[2]) ? "bitwise the same" : "DIFFERENT BITS");
    }
    if (have_alt) {
        grads(dq_alt, dkv_alt, ga);
        const float tdqa = time_ms(dq_alt), tkva = time_ms(dkv_alt), tdq2 = time_ms(dq_reg), tkv2 = time_ms(dkv_reg);
        printf("  f32 x3   dQ %8.3f ms dKV %8.3f ms  %6.1f TFLOP/s  err dQ %.2e dK %.2e dV %.2e  (x3/reg %.3fx; reg again %.3f + %.3f ms)\n",
               tdqa, tkva, bflops/(tdqa + tkva)/1e9, worst_rel(ga[0], gr[0]), worst_rel(ga[1], gr[1]), worst_rel(ga[2], gr[2]),
               (tdqa + tkva)/(tdq2 + tkv2), tdq2, tkv2);
        if (ref64) {
            printf("  vs float64: bwd f32 x3 dQ %.2e dK %.2e dV %.2e\n",
                   worst_rel_d(ga[0], ref.dQ), worst_rel_d(ga[1], ref.dK), worst_rel_d(ga[2], ref.dV));
        }
    }
    return 0;
}
