// Standalone harness for the flash-attn-train CUDA kernels: builds in seconds per instance (no ggml build), runs
// the kernels of the patched fattn-train.cu and fattn-train-mma.cuh directly on random inputs, and prints each
// register-family arm's worst error against the scalar f32 kernels (and, in the modes with garbage K/V, against
// a float64 reference) and its median time over repeated launches.
//
//   bash tools/fa-harness.sh OUTDIR "S Skv Nh Nkv D [mode]" ...     (builds it, see there)
//   /tmp/fa_harness S Skv Nh Nkv D [causal | icausal | bias | iwindow:W | padding:N]
//   env: DV=N (Dv != D), FA_SMEM_KB=99|163|227 (the shared-memory class whose configuration runs; default: the
//   device's), REPS=N (timed launches per median, default 7), KV=f16|bf16|q8_0 (K and V also stored in that type:
//   every arm reads the stored values dequantized, and the register kernels reading them as stored are timed beside
//   the f32 arms, forward and dQ alone, with their results bitwise compared: the same values rounded the same way)
//
// Modes: "causal" a stored f16 causal mask for every kernel; "icausal" the implicit causal mask for the register
// kernels against the f32 kernels on the stored one; "bias": a stored mask of finite biases with a fifth -INF,
// query row 1 and key 2 masked whole, NaN in K and V at key 2, every kernel checked against float64;
// "iwindow:W": the implicit window |i' - j| <= W for the register kernels, the f32 kernels on it stored
// (iwindow:0 with S = Skv: every row sees one key, so dQ = dK = 0: their largest entries are printed against the
// natural magnitude scale |dO| |v| |k|); "padding:N": a stored mask hiding the last N keys from every row, NaN
// in their K and V, every kernel checked against float64.
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
    float * d; CK(cudaMalloc(&d, std::max<size_t>(h.size(), 1)*sizeof(float)));
    CK(cudaMemcpy(d, h.data(), h.size()*sizeof(float), cudaMemcpyHostToDevice));
    return d;
}

static int g_reps = 7;

template <typename F>
static float time_ms(F launch) {
    cudaEvent_t a, b; CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
    launch(); CK(cudaDeviceSynchronize());
    std::vector<float> t;
    for (int r = 0; r < g_reps; ++r) {
        CK(cudaEventRecord(a)); launch(); CK(cudaEventRecord(b)); CK(cudaEventSynchronize(b));
        float ms; CK(cudaEventElapsedTime(&ms, a, b)); t.push_back(ms);
    }
    std::sort(t.begin(), t.end());
    return t[t.size()/2];
}

static double worst_rel(const std::vector<float> & x, const std::vector<float> & ref) {
    double num = 0, den = 1e-5;
    for (size_t i = 0; i < x.size(); ++i) {
        if (!std::isfinite(x[i]) && std::isfinite(ref[i])) return NAN;
        num = std::max(num, (double) fabsf(x[i] - ref[i])); den = std::max(den, (double) fabsf(ref[i]));
    }
    return num/den;
}

static double max_abs(const std::vector<float> & x) {
    double m = 0; for (float v : x) m = std::max(m, (double) fabsf(v)); return m;
}

// float64 reference: O [Dv, Nh, S], LSE [Nh, S], and for dO the gradients dQ, dK, dV (q, k, v layouts; B = 1)
struct ref_out { std::vector<double> O, L, dQ, dK, dV; };

static ref_out reference(const std::vector<float> & q, const std::vector<float> & k, const std::vector<float> & v,
        const std::vector<half> & m, const std::vector<float> & dO, int S, int Skv, int Nh, int Nkv, int D, int Dv, double scale) {
    ref_out r;
    r.O.assign((size_t) Dv*Nh*S, 0); r.L.assign((size_t) Nh*S, 0);
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
        for (int c = 0; c < Dv; ++c) {
            double o = 0; for (int j = 0; j < Skv; ++j) o += P[j]/l*v[((size_t) hk*Skv + j)*Dv + c];
            r.O[row*Dv + c] = o; Di += o*dO[row*Dv + c];
        }
        for (int j = 0; j < Skv; ++j) {
            const double pj = P[j]/l;
            if (pj == 0) continue;
            double dp = 0; for (int c = 0; c < Dv; ++c) dp += dO[row*Dv + c]*v[((size_t) hk*Skv + j)*Dv + c];
            const double ds = pj*(dp - Di);
            for (int c = 0; c < D; ++c) {
                r.dQ[((size_t) h*S + i)*D + c] += scale*ds*k[((size_t) hk*Skv + j)*D + c];
                r.dK[((size_t) hk*Skv + j)*D + c] += scale*ds*qi[c];
            }
            for (int c = 0; c < Dv; ++c) r.dV[((size_t) hk*Skv + j)*Dv + c] += pj*dO[row*Dv + c];
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

// K or V in a stored type (KV=): x rounded to the values the type dequantizes to (ggml's quantize_row_q8_0_ref:
// d = amax/127 as f16, q = round(x/d)), and the stored bytes, rows of D elements; rows listed in nan_rows hold NaN
struct stored_kv {
    std::vector<uint8_t> bytes;
    size_t row_bytes = 0;
};

static stored_kv store_kv(std::vector<float> & x, int D, int type, const std::vector<bool> & nan_row) {
    stored_kv st;
    const size_t rows = x.size()/D;
    st.row_bytes = type == GGML_TYPE_Q8_0 ? (size_t) D/QK8_0*sizeof(block_q8_0) : 2*(size_t) D;
    st.bytes.resize(rows*st.row_bytes);
    for (size_t r = 0; r < rows; ++r) {
        float * xr = x.data() + r*D;
        uint8_t * out = st.bytes.data() + r*st.row_bytes;
        if (type == GGML_TYPE_Q8_0) {
            for (int b0 = 0; b0 < D; b0 += QK8_0) {
                float amax = 0.0f;
                for (int j = 0; j < QK8_0; ++j) amax = std::max(amax, fabsf(xr[b0 + j]));
                const float d = amax/127.0f, id = d ? 1.0f/d : 0.0f;
                block_q8_0 blk;
                blk.d = nan_row[r] ? __ushort_as_half((unsigned short) 0x7E00) : __float2half(d);
                for (int j = 0; j < QK8_0; ++j) {
                    blk.qs[j] = (int8_t) roundf(xr[b0 + j]*id);
                    xr[b0 + j] = nan_row[r] ? NAN : blk.qs[j]*__half2float(blk.d);
                }
                memcpy(out + b0/QK8_0*sizeof(block_q8_0), &blk, sizeof(blk));
            }
        } else {
            for (int j = 0; j < D; ++j) {
                uint16_t h;
                if (type == GGML_TYPE_F16) {
                    h = nan_row[r] ? 0x7E00 : __half_as_ushort(__float2half(xr[j]));
                    xr[j] = __half2float(__ushort_as_half(h));
                } else {
                    uint32_t u; memcpy(&u, &xr[j], 4);
                    h = nan_row[r] ? 0x7FC0 : (uint16_t) ((u + 0x7FFF + ((u >> 16) & 1)) >> 16); // nearest even
                    u = (uint32_t) h << 16; memcpy(&xr[j], &u, 4);
                }
                memcpy(out + 2*j, &h, 2);
            }
        }
    }
    return st;
}

int main(int argc, char ** argv) {
    if (argc < 6) { printf("usage: %s S Skv Nh Nkv D [mode]\n", argv[0]); return 2; }
    const int S = atoi(argv[1]), Skv = atoi(argv[2]), Nh = atoi(argv[3]), Nkv = atoi(argv[4]), D = atoi(argv[5]);
    const int Dv = getenv("DV") ? atoi(getenv("DV")) : D;
    if (getenv("REPS")) g_reps = std::max(1, atoi(getenv("REPS")));
    const bool bias = argc > 6 && strcmp(argv[6], "bias") == 0;
    const int window = argc > 6 && strncmp(argv[6], "iwindow:", 8) == 0 ? atoi(argv[6] + 8) : -1;
    const int pad = argc > 6 && strncmp(argv[6], "padding:", 8) == 0 ? atoi(argv[6] + 8) : 0;
    const bool ref64 = bias || pad > 0; // garbage in K/V: checked against float64, not against the f32 kernels
    const bool causal = argc > 6 && !bias && window < 0 && pad == 0, implicit = (causal && strcmp(argv[6], "icausal") == 0) || window >= 0;

    // the register family's instance and configuration, as the backend picks them
    const fa_train_instance * inst = fa_train_instance_for(D, Dv);
    if (!inst) { printf("no instance for D %d Dv %d\n", D, Dv); return 2; }
    int dev_kb; CK(cudaDeviceGetAttribute(&dev_kb, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
    size_t budget = (size_t) dev_kb;
    if (getenv("FA_SMEM_KB")) budget = std::min(budget, (size_t) atoi(getenv("FA_SMEM_KB"))*1024);
    fa_train_kernel kt;
    kt.family = FA_TRAIN_TF32; kt.inst = inst; kt.cls = fa_train_smem_class(budget);
    if (kt.cls < 0) { printf("budget %zu below the smallest class\n", budget); return 2; }
    kt.limit = fa_smem_class_bytes[kt.cls];
    fa_train_kernel kx = kt; kx.family = FA_TRAIN_F32_X3;
    const int rows = inst->bwd_rows(kt.cls);

    std::mt19937 gen(42); std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::vector<float> q((size_t) D*S*Nh), k((size_t) D*Skv*Nkv), v((size_t) Dv*Skv*Nkv);
    for (auto & x : q) x = u(gen); for (auto & x : k) x = u(gen); for (auto & x : v) x = u(gen);
    std::vector<half> m;
    auto stored = [&](auto entry) { m.resize((size_t) S*Skv); for (int i = 0; i < S; ++i) for (int j = 0; j < Skv; ++j) m[(size_t) i*Skv + j] = __float2half(entry(i, j)); };
    if (causal) stored([&](int i, int j) { return j <= i + (Skv - S) ? 0.0f : -INFINITY; });
    if (window >= 0) stored([&](int i, int j) { return abs(i + (Skv - S) - j) <= window ? 0.0f : -INFINITY; });
    if (bias) stored([&](int i, int j) { const float x = 3.0f*u(gen); return i == 1 || j == 2 || gen() % 5 == 0 ? -INFINITY : x; });
    if (pad > 0) stored([&](int, int j) { return j >= Skv - pad ? -INFINITY : 0.0f; });
    fa_train_params p = {};
    // KV=: K and V stored in that type too; every arm reads the values it dequantizes to
    const char * kv_env = getenv("KV");
    const int kv_type = !kv_env ? -1 : !strcmp(kv_env, "f16") ? GGML_TYPE_F16 : !strcmp(kv_env, "bf16") ? GGML_TYPE_BF16 :
        !strcmp(kv_env, "q8_0") ? GGML_TYPE_Q8_0 : -2;
    if (kv_type == -2 || (kv_type == GGML_TYPE_Q8_0 && (D % QK8_0 || Dv % QK8_0))) { printf("KV=%s: f16, bf16 or q8_0 (D, Dv multiples of 32)\n", kv_env); return 2; }
    std::vector<bool> nan_key((size_t) Nkv*Skv, false);
    for (int h = 0; h < Nkv; ++h) for (int j = 0; j < Skv; ++j) nan_key[(size_t) h*Skv + j] = (bias && j == 2) || j >= Skv - pad;
    stored_kv ks, vs;
    if (kv_type >= 0) {
        const std::vector<bool> none(nan_key.size(), false);
        ks = store_kv(k, D, kv_type, none); vs = store_kv(v, Dv, kv_type, none); // the values every arm reads
        std::vector<float> kn = k, vn = v;
        ks = store_kv(kn, D, kv_type, nan_key); vs = store_kv(vn, Dv, kv_type, nan_key); // the bytes, NaN at masked keys
    }
    std::vector<float> kg = k, vg = v; // the device's copies: NaN at the masked keys
    for (int h = 0; h < Nkv; ++h) for (int j = 0; j < Skv; ++j) {
        if (!((bias && j == 2) || j >= Skv - pad)) continue;
        for (int c = 0; c < D; ++c) kg[((size_t) h*Skv + j)*D + c] = NAN;
        for (int c = 0; c < Dv; ++c) vg[((size_t) h*Skv + j)*Dv + c] = NAN;
    }
    p.q = dev_upload(q); p.k = dev_upload(kg); p.v = dev_upload(vg);
    p.q_nb1 = D; p.q_nb2 = (int64_t) D*S; p.q_nb3 = (int64_t) D*S*Nh;
    p.k_nb1 = D; p.k_nb2 = (int64_t) D*Skv; p.k_nb3 = (int64_t) D*Skv*Nkv;
    p.v_nb1 = Dv; p.v_nb2 = (int64_t) Dv*Skv; p.v_nb3 = (int64_t) Dv*Skv*Nkv;
    if (!m.empty()) { half * dm; CK(cudaMalloc(&dm, m.size()*sizeof(half))); CK(cudaMemcpy(dm, m.data(), m.size()*sizeof(half), cudaMemcpyHostToDevice)); p.mask = dm; p.m_nb1 = Skv; p.m_nb3 = (int64_t) S*Skv; }
    p.m_ne3 = 1; p.window = -1; p.kv_split = 1;
    p.D = D; p.Dv = Dv; p.S = S; p.Skv = Skv; p.Nh = Nh; p.Nkv = Nkv; p.B = 1; p.gqa = Nh/Nkv; p.scale = 1.0f/sqrtf((float) D);
    p.vec_q = p.vec_k = D % 4 == 0; p.vec_v = p.vec_do = Dv % 4 == 0;
    const size_t nO = (size_t) Dv*Nh*S, nL = (size_t) Nh*S;
    CK(cudaMalloc(&p.O, nO*sizeof(float))); CK(cudaMalloc(&p.LSE, nL*sizeof(float)));

    const half * stored_mask = p.mask;
    auto as_ref  = [&]() { p.mask = stored_mask; p.causal = false; p.window = -1; };
    auto as_test = [&]() { if (implicit) { p.mask = nullptr; p.causal = causal; p.window = window; } };
    as_ref();
    auto run_read = [&](auto launch, std::vector<float> & O, std::vector<float> & L) {
        CK(cudaMemset(p.O, 0xFF, nO*sizeof(float))); CK(cudaMemset(p.LSE, 0xFF, nL*sizeof(float)));
        launch(); CK(cudaDeviceSynchronize());
        O.resize(nO); L.resize(nL);
        CK(cudaMemcpy(O.data(), p.O, nO*sizeof(float), cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(L.data(), p.LSE, nL*sizeof(float), cudaMemcpyDeviceToHost));
    };
    const size_t f32_limit = (size_t) dev_kb;
    auto f32 = [&]() { const int R = FA_TRAIN_F32_BR; fa_train_launch(fa_train_f32<0>, dim3((S + R - 1)/R, Nh, 1), FA_TRAIN_F32_NT, fa_f32_get_layout(D, Dv, 0).total*sizeof(float), f32_limit, p, 0); };
    // the register kernels read the stored mask's cells: computed in each timed launch, as the backend does
    uint8_t * cells = nullptr;
    const size_t ncells = (size_t) ((S + FA_CELL - 1)/FA_CELL)*((Skv + FA_CELL - 1)/FA_CELL);
    if (p.mask) CK(cudaMalloc(&cells, ncells));
    auto with_cells = [&]() {
        fa_train_params pc = p;
        if (pc.mask) {
            pc.cell_nx = (Skv + FA_CELL - 1)/FA_CELL; pc.cell_ny = (S + FA_CELL - 1)/FA_CELL; pc.cells = cells;
            fa_train_mask_cells<<<dim3((pc.cell_nx + 127)/128, pc.cell_ny, 1), 128>>>(pc, cells);
        }
        return pc;
    };
    // the TF32 copies of the streamed operands (fa_train_round_operands), made in each timed launch as the backend does
    float * operands; CK(cudaMalloc(&operands, ((size_t) Nkv*Skv + (size_t) Nh*S)*(D + Dv)*sizeof(float)));
    auto reg = [&](const fa_train_kernel & kk, bool back, fa_train_params pp, bool copies) {
        if (kk.family == FA_TRAIN_TF32 && copies) fa_train_round_operands(pp, back, operands, 0);
        kk.inst->launch(pp, back, kk.family == FA_TRAIN_F32_X3, kk.cls, kk.limit, 0); CK(cudaGetLastError());
    };
    auto v2       = [&]() { reg(kt, false, with_cells(), true); };
    auto v2_tiles = [&]() { reg(kt, false, with_cells(), false); }; // each streamed tile rounded where it lands
    auto va       = [&]() { reg(kx, false, with_cells(), false); }; // the compensated product (the f32 precision)

    std::vector<float> Or, Lr, O2, L2, Oa, La;
    run_read(f32, Or, Lr);
    as_test();
    run_read(v2, O2, L2);
    run_read(va, Oa, La);
    double visible = 0;
    for (int i = 0; i < S; ++i) for (int j = 0; j < Skv; ++j) visible += m.empty() || !std::isinf(__half2float(m[(size_t) i*Skv + j]));
    const double flops = 2.0*(D + Dv)*Nh*visible;
    printf("fwd S%d Skv%d Nh%d Nkv%d D%d Dv%d %s: instance d%d x %d, smem class %d KB (budget %zu), bwd rows %d\n", S, Skv, Nh, Nkv, D, Dv,
           bias ? "bias+NaN keys" : pad > 0 ? "padding+NaN keys" : window >= 0 ? "window (implicit)" : causal ? (implicit ? "causal (implicit)" : "causal") : "none",
           inst->dk, inst->dvk, (int) (fa_smem_class_bytes[kt.cls]/1024), budget, rows);
    as_ref();
    const float tf = time_ms(f32);
    as_test();
    printf("  f32 scalar %8.3f ms  %6.1f TFLOP/s\n", tf, flops/tf/1e9);
    const float t2 = time_ms(v2);
    printf("  tf32 reg   %8.3f ms  %6.1f TFLOP/s  err O %.2e LSE %.2e\n", t2, flops/t2/1e9, worst_rel(O2, Or), worst_rel(L2, Lr));
    {
        std::vector<float> Ot, Lt;
        run_read(v2_tiles, Ot, Lt);
        const float tt = time_ms(v2_tiles);
        printf("  tf32 reg without the operand copies %8.3f ms (copies/without %.3fx), %s\n", tt, t2/tt,
               same_bits(Ot, O2) && same_bits(Lt, L2) ? "bitwise the same" : "DIFFERENT BITS");
    }
    const float ta = time_ms(va);
    printf("  f32 x3     %8.3f ms  %6.1f TFLOP/s  err O %.2e LSE %.2e  (x3/tf32 %.3fx)\n", ta, flops/ta/1e9, worst_rel(Oa, Or), worst_rel(La, Lr), ta/t2);

    // backward: O and LSE of the f32 forward, random dO, D_i; each path's dQ, dK, dV against the f32 kernels'
    std::vector<float> dO(nO);
    for (auto & x : dO) x = u(gen);
    as_ref();
    p.dO = dev_upload(dO);
    ref_out ref;
    if (ref64) {
        ref = reference(q, k, v, m, dO, S, Skv, Nh, Nkv, D, Dv, p.scale);
        printf("  vs float64: fwd f32 O %.2e LSE %.2e | tf32 reg O %.2e LSE %.2e | f32 x3 O %.2e LSE %.2e\n", worst_rel_d(Or, ref.O), worst_rel_d(Lr, ref.L),
               worst_rel_d(O2, ref.O), worst_rel_d(L2, ref.L), worst_rel_d(Oa, ref.O), worst_rel_d(La, ref.L));
        for (size_t e = 0; e < ref.O.size(); ++e) Or[e] = (float) ref.O[e];
        for (size_t e = 0; e < ref.L.size(); ++e) Lr[e] = (float) ref.L[e];
    }
    // each precision's backward reads its own forward's O, as in a graph; D_i: fa_train_di for the scalar kernels,
    // the register kernels' launch forms its own (fa_train_di_reg)
    CK(cudaMalloc(&p.Di, nL*sizeof(float)));
    auto set_fwd = [&](const std::vector<float> & O, const std::vector<float> & L) {
        CK(cudaMemcpy(p.O, O.data(), nO*sizeof(float), cudaMemcpyHostToDevice));
        CK(cudaMemcpy(p.LSE, L.data(), nL*sizeof(float), cudaMemcpyHostToDevice));
        fa_train_di<<<(nL + 255)/256, 256>>>(p); CK(cudaDeviceSynchronize());
    };
    const size_t nQ = q.size(), nK = k.size(), nV = v.size();
    CK(cudaMalloc(&p.dQ, nQ*sizeof(float))); CK(cudaMalloc(&p.dK, nK*sizeof(float))); CK(cudaMalloc(&p.dV, nV*sizeof(float)));
    auto grads = [&](auto launch, std::vector<float> * out) {
        CK(cudaMemset(p.dQ, 0xFF, nQ*sizeof(float))); CK(cudaMemset(p.dK, 0xFF, nK*sizeof(float))); CK(cudaMemset(p.dV, 0xFF, nV*sizeof(float)));
        launch(); CK(cudaDeviceSynchronize());
        out[0].resize(nQ); out[1].resize(nK); out[2].resize(nV);
        CK(cudaMemcpy(out[0].data(), p.dQ, nQ*sizeof(float), cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(out[1].data(), p.dK, nK*sizeof(float), cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(out[2].data(), p.dV, nV*sizeof(float), cudaMemcpyDeviceToHost));
    };
    auto bwd_f32 = [&]() {
        const int R = FA_TRAIN_F32_BR, BC = FA_TRAIN_BC;
        fa_train_launch(fa_train_f32<1>, dim3((S + R - 1)/R, Nh, 1), FA_TRAIN_F32_NT, fa_f32_get_layout(D, Dv, 1).total*sizeof(float), f32_limit, p, 0);
        fa_train_launch(fa_train_f32<2>, dim3((Skv + BC - 1)/BC, Nkv, 1), FA_TRAIN_F32_NT, fa_f32_get_layout(D, Dv, 2).total*sizeof(float), f32_limit, p, 0);
    };
    int nsm; CK(cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, 0));
    const int split = fa_dkv_split(p, rows, nsm);
    const size_t stride = (std::max(nK, nV) + 3)/4*4; // as the backend: parts in whole 16-byte units
    float * scratch; CK(cudaMalloc(&scratch, 2*(size_t) split*stride*sizeof(float)));
    // the register backward as the backend launches it (one grid, dK/dV split as the backend does it, the parts
    // summed), or one kind of its blocks alone: want 1 = dQ, 2 = dK/dV, 3 = both
    auto bwd_reg = [&](const fa_train_kernel & kk, int want, bool copies) {
        fa_train_params ps = with_cells();
        ps.kv_split = split;
        if (!(want & 1)) ps.dQ = nullptr;
        if (!(want & 2)) ps.dK = ps.dV = nullptr;
        fa_train_params pp = ps;
        if (split > 1 && (want & 2)) { pp.dK = scratch; pp.dV = scratch + split*stride; pp.part_stride = stride; }
        reg(kk, true, pp, copies);
        if (split > 1 && (want & 2)) {
            fa_train_sum_parts<<<(nK + 255)/256, 256>>>(pp.dK, nK, stride, split, ps.dK);
            fa_train_sum_parts<<<(nV + 255)/256, 256>>>(pp.dV, nV, stride, split, ps.dV);
        }
        CK(cudaGetLastError());
    };
    std::vector<float> gr[3], g2[3], g3[3], g4[3], ga[3];
    set_fwd(Or, Lr);
    grads(bwd_f32, gr);
    const float tbf = time_ms(bwd_f32);
    const double bflops = 2.5*flops;
    printf("bwd (split %d)\n  f32 scalar %8.3f ms  %6.1f TFLOP/s\n", split, tbf, bflops/tbf/1e9);
    if (ref64) {
        printf("  vs float64: bwd f32 dQ %.2e dK %.2e dV %.2e\n", worst_rel_d(gr[0], ref.dQ), worst_rel_d(gr[1], ref.dK), worst_rel_d(gr[2], ref.dV));
    }
    as_test();
    set_fwd(O2, L2);
    grads([&]() { bwd_reg(kt, 1, true); }, g2);
    grads([&]() { bwd_reg(kt, 2, true); }, g3);
    g2[1] = g3[1]; g2[2] = g3[2];
    const float tdq = time_ms([&]() { bwd_reg(kt, 1, true); }), tkv = time_ms([&]() { bwd_reg(kt, 2, true); });
    grads([&]() { bwd_reg(kt, 3, true); }, g3);
    const float t1g = time_ms([&]() { bwd_reg(kt, 3, true); });
    printf("  tf32 reg one grid %8.3f ms  %6.1f TFLOP/s  err dQ %.2e dK %.2e dV %.2e; dQ alone %.3f + dKV alone %.3f ms (one/alone %.3fx), %s\n",
           t1g, bflops/t1g/1e9, worst_rel(g3[0], gr[0]), worst_rel(g3[1], gr[1]), worst_rel(g3[2], gr[2]), tdq, tkv, t1g/(tdq + tkv),
           same_bits(g3[0], g2[0]) && same_bits(g3[1], g2[1]) && same_bits(g3[2], g2[2]) ? "bitwise the same as alone" : "DIFFERENT BITS alone");
    grads([&]() { bwd_reg(kt, 3, false); }, g4);
    const float tt = time_ms([&]() { bwd_reg(kt, 3, false); });
    printf("  tf32 reg one grid without the operand copies %8.3f ms (copies/without %.3fx), %s\n", tt, t1g/tt,
           same_bits(g4[0], g3[0]) && same_bits(g4[1], g3[1]) && same_bits(g4[2], g3[2]) ? "bitwise the same" : "DIFFERENT BITS");
    if (ref64) {
        printf("  vs float64: bwd tf32 reg dQ %.2e dK %.2e dV %.2e\n", worst_rel_d(g3[0], ref.dQ), worst_rel_d(g3[1], ref.dK), worst_rel_d(g3[2], ref.dV));
    }
    set_fwd(Oa, La);
    grads([&]() { bwd_reg(kx, 3, false); }, ga);
    const float tba = time_ms([&]() { bwd_reg(kx, 3, false); });
    printf("  f32 x3 one grid   %8.3f ms  %6.1f TFLOP/s  err dQ %.2e dK %.2e dV %.2e  (x3/tf32 %.3fx)\n", tba, bflops/tba/1e9,
           worst_rel(ga[0], gr[0]), worst_rel(ga[1], gr[1]), worst_rel(ga[2], gr[2]), tba/t1g);
    if (ref64) {
        printf("  vs float64: bwd f32 x3 dQ %.2e dK %.2e dV %.2e\n", worst_rel_d(ga[0], ref.dQ), worst_rel_d(ga[1], ref.dK), worst_rel_d(ga[2], ref.dV));
    }
    if (window == 0 && S == Skv) { // one visible key per row: dQ = dK = 0, measured against scale |dO| |v| |k|
        const double natural = p.scale*max_abs(dO)*max_abs(v)*max_abs(k);
        printf("  one key per row: max|dQ|, max|dK| / natural magnitude: tf32 %.2e %.2e, f32 x3 %.2e %.2e, f32 scalar %.2e %.2e (bar 1e-6)\n",
               max_abs(g3[0])/natural, max_abs(g3[1])/natural, max_abs(ga[0])/natural, max_abs(ga[1])/natural,
               max_abs(gr[0])/natural, max_abs(gr[1])/natural);
    }
    if (kv_type >= 0) { // the register kernels reading K and V as stored, against the f32 arms on their values
        fa_train_params pk = p;
        uint8_t * dk, * dv;
        CK(cudaMalloc(&dk, ks.bytes.size())); CK(cudaMemcpy(dk, ks.bytes.data(), ks.bytes.size(), cudaMemcpyHostToDevice));
        CK(cudaMalloc(&dv, vs.bytes.size())); CK(cudaMemcpy(dv, vs.bytes.data(), vs.bytes.size(), cudaMemcpyHostToDevice));
        pk.k = (const float *) dk; pk.v = (const float *) dv; pk.kv_stored = true; pk.k_type = pk.v_type = kv_type;
        pk.k_nb1 = ks.row_bytes; pk.k_nb2 = ks.row_bytes*Skv; pk.k_nb3 = pk.k_nb2*Nkv;
        pk.v_nb1 = vs.row_bytes; pk.v_nb2 = vs.row_bytes*Skv; pk.v_nb3 = pk.v_nb2*Nkv;
        const auto unit = [](size_t rb) { return rb % 16 == 0 ? 16 : rb % 8 == 0 ? 8 : rb % 4 == 0 ? 4 : 0; };
        pk.k_unit = unit(ks.row_bytes); pk.v_unit = unit(vs.row_bytes);
        const fa_train_params pf = p;
        std::vector<float> Os, Ls, Osx, Lsx;
        auto fwd_stored = [&](const fa_train_kernel & kk) { // a forward's params: no gradient pointers (the Q8 kernels ask)
            p = pk; fa_train_params pc = with_cells(); p = pf; pc.dK = pc.dV = nullptr; reg(kk, false, pc, true);
        };
        run_read([&]() { fwd_stored(kt); }, Os, Ls);
        run_read([&]() { fwd_stored(kx); }, Osx, Lsx);
        const float tfs = time_ms([&]() { fwd_stored(kt); }), tff = time_ms(v2), tfs2 = time_ms([&]() { fwd_stored(kt); });
        printf("stored K/V (%s, units %d/%d): fwd tf32 %.3f ms vs f32 K/V %.3f ms (%.3fx), repeat %.3f; tf32 %s, x3 %s vs the f32 K/V arms\n",
               kv_env, pk.k_unit, pk.v_unit, tfs, tff, tfs/tff, tfs2, same_bits(Os, O2) && same_bits(Ls, L2) ? "bitwise the same" : "DIFFERENT BITS",
               same_bits(Osx, Oa) && same_bits(Lsx, La) ? "bitwise the same" : "DIFFERENT BITS");
        // dQ alone (a frozen cache), each precision on its own forward, as a graph runs it
        auto dq_stored = [&](const fa_train_kernel & kk) {
            p = pk; fa_train_params pc = with_cells(); p = pf;
            pc.dK = pc.dV = nullptr; reg(kk, true, pc, true);
        };
        std::vector<float> gs[3], gf[3], gsx[3];
        set_fwd(O2, L2);
        grads([&]() { dq_stored(kt); }, gs); // against g2: the f32 K/V arm's dQ alone on the same forward
        const float tbs = time_ms([&]() { dq_stored(kt); }), tbf2 = time_ms([&]() { bwd_reg(kt, 1, true); });
        set_fwd(Oa, La);
        grads([&]() { bwd_reg(kx, 1, false); }, gf);
        grads([&]() { dq_stored(kx); }, gsx);
        printf("  dQ alone tf32 %.3f ms vs f32 K/V %.3f ms (%.3fx); tf32 %s (err dQ %.2e vs f32 scalar), x3 %s\n", tbs, tbf2, tbs/tbf2,
               same_bits(gs[0], g2[0]) ? "bitwise the same" : "DIFFERENT BITS", worst_rel(gs[0], gr[0]),
               same_bits(gsx[0], gf[0]) ? "bitwise the same" : "DIFFERENT BITS");
    }
    return 0;
}
