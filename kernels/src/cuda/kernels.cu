// The CUDA backend's kernels, compiled at run time by NVRTC (no CUDA headers: only built-ins).
//
// Every kernel is deterministic: no floating-point atomics, and every reduction has an order that
// depends only on the problem's shape (a warp's butterfly, a column summed over rows in order, a
// fixed grid of partial sums), never on scheduling. Sizes are 64-bit; loops are grid-stride so any
// launch covers any size.

typedef unsigned long long u64;
typedef unsigned int u32;

#define FULL_MASK 0xffffffffu
#define MAX_HEAD_DIM 256
#define LANE_SLOTS (MAX_HEAD_DIM / 32)

__device__ __forceinline__ u64 global_index() {
    return (u64)blockIdx.x * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ u64 global_stride() {
    return (u64)gridDim.x * blockDim.x;
}

__device__ __forceinline__ float neg_infinity() {
    return __int_as_float(0xff800000);
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(FULL_MASK, v, offset);
    return v;
}

__device__ __forceinline__ double warp_sum_f64(double v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(FULL_MASK, v, offset);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, offset));
    return v;
}

// The warp handling row `row` when each block holds blockDim.x / 32 warps, and this thread's lane.
__device__ __forceinline__ u64 warp_row() {
    return (u64)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
}

__device__ __forceinline__ int lane() {
    return threadIdx.x & 31;
}

// ---- elementwise ----------------------------------------------------------------------------

extern "C" __global__ void fill_f32(float* x, u64 n, float value) {
    for (u64 i = global_index(); i < n; i += global_stride()) x[i] = value;
}

extern "C" __global__ void mul_f32(const float* a, const float* b, float* out, u64 n) {
    for (u64 i = global_index(); i < n; i += global_stride()) out[i] = a[i] * b[i];
}

extern "C" __global__ void axpy_f32(float alpha, const float* x, float* y, u64 n) {
    for (u64 i = global_index(); i < n; i += global_stride()) y[i] += alpha * x[i];
}

extern "C" __global__ void scale_f32(float alpha, float* x, u64 n) {
    for (u64 i = global_index(); i < n; i += global_stride()) x[i] *= alpha;
}

extern "C" __global__ void add_bias_f32(float* y, const float* bias, u64 rows, u64 cols) {
    u64 n = rows * cols;
    for (u64 i = global_index(); i < n; i += global_stride()) y[i] += bias[i % cols];
}

// One thread per column, rows summed in order (as the CPU backend sums them).
extern "C" __global__ void sum_rows_f32(const float* x, float* out, u64 rows, u64 cols, int accumulate) {
    for (u64 j = global_index(); j < cols; j += global_stride()) {
        float acc = accumulate ? out[j] : 0.0f;
        for (u64 i = 0; i < rows; ++i) acc += x[i * cols + j];
        out[j] = acc;
    }
}

// 32 x 32 tiles through shared memory; blocks of 32 x 8 threads, grid over (cols, rows) tiles,
// row tiles looped past the grid's height.
extern "C" __global__ void transpose_f32(const float* a, float* out, u64 rows, u64 cols) {
    __shared__ float tile[32][33];
    u64 c0 = (u64)blockIdx.x * 32;
    for (u64 r0 = (u64)blockIdx.y * 32; r0 < rows; r0 += (u64)gridDim.y * 32) {
        for (int dy = threadIdx.y; dy < 32; dy += 8) {
            u64 r = r0 + dy, c = c0 + threadIdx.x;
            if (r < rows && c < cols) tile[dy][threadIdx.x] = a[r * cols + c];
        }
        __syncthreads();
        for (int dy = threadIdx.y; dy < 32; dy += 8) {
            u64 c = c0 + dy, r = r0 + threadIdx.x;
            if (r < rows && c < cols) out[c * rows + r] = tile[threadIdx.x][dy];
        }
        __syncthreads();
    }
}

// Activation codes: 0 relu, 1 gelu (tanh approximation), 2 tanh, 3 sigmoid.
#define SQRT_2_OVER_PI 0.7978846f
#define GELU_C 0.044715f

__device__ __forceinline__ float sigmoid(float x) {
    return 1.0f / (1.0f + expf(-x));
}

__device__ __forceinline__ float activate(int act, float x) {
    switch (act) {
        case 0: return fmaxf(x, 0.0f);
        case 1: return 0.5f * x * (1.0f + tanhf(SQRT_2_OVER_PI * (x + GELU_C * x * x * x)));
        case 2: return tanhf(x);
        default: return sigmoid(x);
    }
}

__device__ __forceinline__ float activate_grad(int act, float x) {
    switch (act) {
        case 0: return x > 0.0f ? 1.0f : 0.0f;
        case 1: {
            float t = tanhf(SQRT_2_OVER_PI * (x + GELU_C * x * x * x));
            return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * SQRT_2_OVER_PI * (1.0f + 3.0f * GELU_C * x * x);
        }
        case 2: {
            float t = tanhf(x);
            return 1.0f - t * t;
        }
        default: {
            float s = sigmoid(x);
            return s * (1.0f - s);
        }
    }
}

extern "C" __global__ void activation_f32(int act, const float* x, float* y, u64 n) {
    for (u64 i = global_index(); i < n; i += global_stride()) y[i] = activate(act, x[i]);
}

extern "C" __global__ void activation_backward_f32(int act, const float* x, const float* dy, float* dx, u64 n) {
    for (u64 i = global_index(); i < n; i += global_stride()) {
        // ReLU passes the gradient through unchanged (no multiply by 1), as the CPU does.
        dx[i] = act == 0 ? (x[i] > 0.0f ? dy[i] : 0.0f) : dy[i] * activate_grad(act, x[i]);
    }
}

// ---- layer normalisation: one warp per row, sums in f64 ------------------------------------

extern "C" __global__ void layer_norm_f32(const float* x, const float* gamma, const float* beta, float eps,
                                          float* y, float* mean, float* rstd, u64 rows, u64 cols) {
    u64 row = warp_row();
    if (row >= rows) return;
    const float* xr = x + row * cols;
    double s = 0.0;
    for (u64 j = lane(); j < cols; j += 32) s += (double)xr[j];
    double mu = warp_sum_f64(s) / (double)cols;
    double v = 0.0;
    for (u64 j = lane(); j < cols; j += 32) {
        double d = (double)xr[j] - mu;
        v += d * d;
    }
    double var = warp_sum_f64(v) / (double)cols;
    float m = (float)mu, r = (float)(1.0 / sqrt(var + (double)eps));
    for (u64 j = lane(); j < cols; j += 32) y[row * cols + j] = (xr[j] - m) * r * gamma[j] + beta[j];
    if (lane() == 0) {
        mean[row] = m;
        rstd[row] = r;
    }
}

// dx = rstd * (g*dy - mean(g*dy) - xhat * mean(g*dy*xhat)).
extern "C" __global__ void layer_norm_backward_input_f32(const float* x, const float* gamma, const float* mean,
                                                         const float* rstd, const float* dy, float* dx,
                                                         u64 rows, u64 cols) {
    u64 row = warp_row();
    if (row >= rows) return;
    const float* xr = x + row * cols;
    const float* dyr = dy + row * cols;
    float m = mean[row], r = rstd[row];
    double s1 = 0.0, s2 = 0.0;
    for (u64 j = lane(); j < cols; j += 32) {
        float gd = gamma[j] * dyr[j];
        s1 += (double)gd;
        s2 += (double)gd * (double)((xr[j] - m) * r);
    }
    float m1 = (float)(warp_sum_f64(s1) / (double)cols);
    float m2 = (float)(warp_sum_f64(s2) / (double)cols);
    for (u64 j = lane(); j < cols; j += 32) {
        float xhat = (xr[j] - m) * r;
        dx[row * cols + j] = r * (gamma[j] * dyr[j] - m1 - xhat * m2);
    }
}

// One thread per feature, rows in order.
extern "C" __global__ void layer_norm_backward_params_f32(const float* x, const float* mean, const float* rstd,
                                                          const float* dy, float* dgamma, float* dbeta,
                                                          u64 rows, u64 cols, int accumulate) {
    for (u64 j = global_index(); j < cols; j += global_stride()) {
        float g = accumulate ? dgamma[j] : 0.0f, b = accumulate ? dbeta[j] : 0.0f;
        for (u64 i = 0; i < rows; ++i) {
            float d = dy[i * cols + j];
            g += d * ((x[i * cols + j] - mean[i]) * rstd[i]);
            b += d;
        }
        dgamma[j] = g;
        dbeta[j] = b;
    }
}

// ---- ids: labels and token ids are checked on the device, the first bad position reported ---

extern "C" __global__ void check_labels_u32(const u32* labels, u64 n, u64 classes, unsigned int* first_bad) {
    for (u64 i = global_index(); i < n; i += global_stride()) {
        if ((u64)labels[i] >= classes) atomicMin(first_bad, (unsigned int)i);
    }
}

extern "C" __global__ void check_ids_f32(const float* ids, u64 n, u64 vocab, unsigned int* first_bad) {
    for (u64 i = global_index(); i < n; i += global_stride()) {
        float v = ids[i];
        bool whole = v >= 0.0f && floorf(v) == v;
        if (!(whole && (double)v < (double)vocab)) atomicMin(first_bad, (unsigned int)i);
    }
}

// ---- softmax cross-entropy: one warp per row; per-row loss (f64) and hit, summed on the host ---

extern "C" __global__ void softmax_xent_f32(const float* logits, const u32* labels, u64 rows, u64 cols,
                                            float grad_scale, float* dlogits, double* row_loss,
                                            int* row_hit) {
    u64 row = warp_row();
    if (row >= rows) return;
    const float* lr = logits + row * cols;
    // Arg-max with the first maximum winning: each lane keeps its first maximum, then the warp
    // keeps the largest value and, among equals, the smallest index.
    float best = neg_infinity();
    u64 arg = 0;
    for (u64 j = lane(); j < cols; j += 32) {
        if (lr[j] > best) {
            best = lr[j];
            arg = j;
        }
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
        float ob = __shfl_xor_sync(FULL_MASK, best, offset);
        u64 oa = __shfl_xor_sync(FULL_MASK, arg, offset);
        if (ob > best || (ob == best && oa < arg)) {
            best = ob;
            arg = oa;
        }
    }
    double s = 0.0;
    for (u64 j = lane(); j < cols; j += 32) s += exp((double)(lr[j] - best));
    double lse = log(warp_sum_f64(s));
    u32 label = labels[row];
    if (lane() == 0) {
        row_loss[row] = lse - (double)(lr[label] - best);
        row_hit[row] = arg == (u64)label ? 1 : 0;
    }
    if (dlogits) {
        for (u64 j = lane(); j < cols; j += 32) {
            float p = (float)exp((double)(lr[j] - best) - lse);
            float y = j == (u64)label ? 1.0f : 0.0f;
            dlogits[row * cols + j] = (p - y) * grad_scale;
        }
    }
}

// ---- embedding ------------------------------------------------------------------------------

extern "C" __global__ void embedding_f32(const float* ids, const float* table, float* out, u64 n, u64 width) {
    u64 total = n * width;
    for (u64 i = global_index(); i < total; i += global_stride()) {
        u64 row = i / width, col = i % width;
        out[i] = table[(u64)ids[row] * width + col];
    }
}

// One thread per column of the table: the ids are visited in order, so repeated ids add their
// rows in order and no two threads write one element.
extern "C" __global__ void embedding_backward_f32(const float* ids, const float* dy, float* dtable, u64 n, u64 width) {
    for (u64 col = global_index(); col < width; col += global_stride()) {
        for (u64 i = 0; i < n; ++i) dtable[(u64)ids[i] * width + col] += dy[i * width + col];
    }
}

// ---- causal attention: one warp per query (forward) or key (backward) row ------------------
//
// qkv is [batch * seq, 3C]; head h of token t reads q at column h*d, k at C + h*d, v at 2C + h*d.
// Each lane holds up to LANE_SLOTS of the head's d features (d <= MAX_HEAD_DIM, checked on the
// host).

__device__ __forceinline__ float lane_dot(const float* a, const float* b, int d) {
    float s = 0.0f;
    for (int j = lane(); j < d; j += 32) s += a[j] * b[j];
    return warp_sum(s);
}

extern "C" __global__ void attention_f32(const float* qkv, float* out, float* lse, u64 batch, u64 seq,
                                         u64 heads, u64 width, float scale) {
    u64 row = warp_row();
    u64 rows = batch * heads * seq;
    if (row >= rows) return;
    int d = (int)(width / heads);
    u64 t = row % seq, h = (row / seq) % heads, b = row / (seq * heads);
    u64 stride = 3 * width;
    const float* q = qkv + (b * seq + t) * stride + h * d;
    float acc[LANE_SLOTS];
    for (int k = 0; k < LANE_SLOTS; ++k) acc[k] = 0.0f;
    float m = neg_infinity(), l = 0.0f;
    for (u64 s = 0; s <= t; ++s) {
        const float* kr = qkv + (b * seq + s) * stride + width + h * d;
        const float* vr = qkv + (b * seq + s) * stride + 2 * width + h * d;
        float score = lane_dot(q, kr, d) * scale;
        float m_new = fmaxf(m, score);
        float correction = expf(m - m_new);
        float p = expf(score - m_new);
        l = l * correction + p;
        for (int k = 0; k < LANE_SLOTS; ++k) {
            int j = lane() + 32 * k;
            if (j < d) acc[k] = acc[k] * correction + p * vr[j];
        }
        m = m_new;
    }
    float* o = out + (b * seq + t) * width + h * d;
    for (int k = 0; k < LANE_SLOTS; ++k) {
        int j = lane() + 32 * k;
        if (j < d) o[j] = acc[k] / l;
    }
    if (lane() == 0) lse[(b * heads + h) * seq + t] = m + logf(l);
}

// Per query row t: delta_t = dout_t . out_t (kept for the key pass) and
// dq_t = scale * sum_{s<=t} P_ts (dP_ts - delta_t) k_s.
extern "C" __global__ void attention_backward_queries_f32(const float* qkv, const float* out, const float* lse,
                                                          const float* dout, float* dqkv, float* delta,
                                                          u64 batch, u64 seq, u64 heads, u64 width,
                                                          float scale) {
    u64 row = warp_row();
    u64 rows = batch * heads * seq;
    if (row >= rows) return;
    int d = (int)(width / heads);
    u64 t = row % seq, h = (row / seq) % heads, b = row / (seq * heads);
    u64 stride = 3 * width;
    const float* q = qkv + (b * seq + t) * stride + h * d;
    const float* o = out + (b * seq + t) * width + h * d;
    const float* go = dout + (b * seq + t) * width + h * d;
    float dt = lane_dot(go, o, d);
    float l = lse[(b * heads + h) * seq + t];
    float acc[LANE_SLOTS];
    for (int k = 0; k < LANE_SLOTS; ++k) acc[k] = 0.0f;
    for (u64 s = 0; s <= t; ++s) {
        const float* kr = qkv + (b * seq + s) * stride + width + h * d;
        const float* vr = qkv + (b * seq + s) * stride + 2 * width + h * d;
        float p = expf(lane_dot(q, kr, d) * scale - l);
        float ds = p * (lane_dot(go, vr, d) - dt) * scale;
        for (int k = 0; k < LANE_SLOTS; ++k) {
            int j = lane() + 32 * k;
            if (j < d) acc[k] += ds * kr[j];
        }
    }
    float* dq = dqkv + (b * seq + t) * stride + h * d;
    for (int k = 0; k < LANE_SLOTS; ++k) {
        int j = lane() + 32 * k;
        if (j < d) dq[j] = acc[k];
    }
    if (lane() == 0) delta[(b * heads + h) * seq + t] = dt;
}

// Per key row s: dk_s = scale * sum_{t>=s} P_ts (dP_ts - delta_t) q_t and dv_s = sum_{t>=s} P_ts dout_t.
extern "C" __global__ void attention_backward_keys_f32(const float* qkv, const float* lse, const float* dout,
                                                       const float* delta, float* dqkv, u64 batch, u64 seq,
                                                       u64 heads, u64 width, float scale) {
    u64 row = warp_row();
    u64 rows = batch * heads * seq;
    if (row >= rows) return;
    int d = (int)(width / heads);
    u64 s = row % seq, h = (row / seq) % heads, b = row / (seq * heads);
    u64 stride = 3 * width;
    const float* kr = qkv + (b * seq + s) * stride + width + h * d;
    const float* vr = qkv + (b * seq + s) * stride + 2 * width + h * d;
    float dk[LANE_SLOTS], dv[LANE_SLOTS];
    for (int k = 0; k < LANE_SLOTS; ++k) {
        dk[k] = 0.0f;
        dv[k] = 0.0f;
    }
    for (u64 t = s; t < seq; ++t) {
        const float* q = qkv + (b * seq + t) * stride + h * d;
        const float* go = dout + (b * seq + t) * width + h * d;
        u64 at = (b * heads + h) * seq + t;
        float p = expf(lane_dot(q, kr, d) * scale - lse[at]);
        float ds = p * (lane_dot(go, vr, d) - delta[at]) * scale;
        for (int k = 0; k < LANE_SLOTS; ++k) {
            int j = lane() + 32 * k;
            if (j < d) {
                dk[k] += ds * q[j];
                dv[k] += p * go[j];
            }
        }
    }
    float* dkr = dqkv + (b * seq + s) * stride + width + h * d;
    float* dvr = dqkv + (b * seq + s) * stride + 2 * width + h * d;
    for (int k = 0; k < LANE_SLOTS; ++k) {
        int j = lane() + 32 * k;
        if (j < d) {
            dkr[j] = dk[k];
            dvr[j] = dv[k];
        }
    }
}

// ---- optimizer updates (PyTorch semantics, as the CPU backend) -----------------------------

extern "C" __global__ void sgd_f32(float* w, const float* g, float* buf, u64 n, float lr, float momentum,
                                   int nesterov, float weight_decay) {
    for (u64 i = global_index(); i < n; i += global_stride()) {
        float d = g[i] + weight_decay * w[i];
        if (buf) {
            float b = momentum * buf[i] + d;
            buf[i] = b;
            w[i] -= lr * (nesterov ? d + momentum * b : b);
        } else {
            w[i] -= lr * d;
        }
    }
}

extern "C" __global__ void adam_f32(float* w, const float* g, float* m, float* v, u64 n, float lr, float beta1,
                                    float beta2, float eps, float weight_decay, int decoupled,
                                    float bias_correction1, float bias_correction2) {
    for (u64 i = global_index(); i < n; i += global_stride()) {
        float wi = w[i];
        float gi = decoupled ? g[i] : g[i] + weight_decay * wi;
        if (decoupled) wi -= lr * weight_decay * wi;
        float mi = beta1 * m[i] + (1.0f - beta1) * gi;
        float vi = beta2 * v[i] + (1.0f - beta2) * gi * gi;
        m[i] = mi;
        v[i] = vi;
        float mhat = mi / bias_correction1, vhat = vi / bias_correction2;
        w[i] = wi - lr * mhat / (sqrtf(vhat) + eps);
    }
}

// ---- reductions to f64: a fixed grid of partial sums, added in order on the host -----------
//
// Launched with exactly REDUCE_BLOCKS blocks of REDUCE_THREADS threads whatever n is, so the
// summation order depends on n alone.

#define REDUCE_THREADS 256

extern "C" __global__ void partial_sums_f32(const float* x, u64 n, int squares, double* partials) {
    __shared__ double shared[REDUCE_THREADS];
    double s = 0.0;
    for (u64 i = global_index(); i < n; i += global_stride()) {
        double v = (double)x[i];
        s += squares ? v * v : v;
    }
    shared[threadIdx.x] = s;
    __syncthreads();
    for (int half = REDUCE_THREADS / 2; half > 0; half >>= 1) {
        if (threadIdx.x < half) shared[threadIdx.x] += shared[threadIdx.x + half];
        __syncthreads();
    }
    if (threadIdx.x == 0) partials[blockIdx.x] = shared[0];
}
