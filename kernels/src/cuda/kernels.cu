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

// Raises *flag (to 1) when any of the n values is NaN or an infinity; every writer writes the
// same value, so the result does not depend on which thread wins.
extern "C" __global__ void flag_non_finite_f32(const float* x, u64 n, u32* flag) {
    for (u64 i = global_index(); i < n; i += global_stride()) {
        if (!isfinite(x[i])) *flag = 1u;
    }
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

// ---- column sums: two deterministic passes -------------------------------------------------
//
// Pass one cuts the rows into chunks of COLUMN_CHUNK_ROWS; a block of 32 x COLUMN_ROW_THREADS
// threads sums one chunk of 32 columns (thread (x, y) adds rows y, y + 8, ... of the chunk in
// order, then row y = 0 adds the eight in order) into `partials[chunk * cols + col]`. Pass two
// sums each column's chunks with one warp: lane l adds chunks l, l + 32, ... in order, then the
// fixed butterfly. Every order depends on the shape alone, so the bits repeat.

#define COLUMN_CHUNK_ROWS 128
#define COLUMN_ROW_THREADS 8

extern "C" __global__ void column_partials_f32(const float* x, float* partials, u64 rows, u64 cols) {
    __shared__ float sums[COLUMN_ROW_THREADS][33];
    u64 col = (u64)blockIdx.x * 32 + threadIdx.x;
    u64 chunks = (rows + COLUMN_CHUNK_ROWS - 1) / COLUMN_CHUNK_ROWS;
    for (u64 chunk = blockIdx.y; chunk < chunks; chunk += gridDim.y) {
        u64 r0 = chunk * COLUMN_CHUNK_ROWS;
        u64 r1 = r0 + COLUMN_CHUNK_ROWS < rows ? r0 + COLUMN_CHUNK_ROWS : rows;
        float acc = 0.0f;
        if (col < cols) {
            for (u64 r = r0 + threadIdx.y; r < r1; r += COLUMN_ROW_THREADS) acc += x[r * cols + col];
        }
        sums[threadIdx.y][threadIdx.x] = acc;
        __syncthreads();
        if (threadIdx.y == 0 && col < cols) {
            float t = 0.0f;
            for (int k = 0; k < COLUMN_ROW_THREADS; ++k) t += sums[k][threadIdx.x];
            partials[chunk * cols + col] = t;
        }
        __syncthreads();
    }
}

// LayerNorm's parameter gradients as column partials: dgamma's chunks (dy * xhat) first, then
// dbeta's (dy), each `chunks * cols` long.
extern "C" __global__ void layer_norm_param_partials_f32(const float* x, const float* mean, const float* rstd,
                                                         const float* dy, float* partials, u64 rows, u64 cols) {
    __shared__ float gsums[COLUMN_ROW_THREADS][33];
    __shared__ float bsums[COLUMN_ROW_THREADS][33];
    u64 col = (u64)blockIdx.x * 32 + threadIdx.x;
    u64 chunks = (rows + COLUMN_CHUNK_ROWS - 1) / COLUMN_CHUNK_ROWS;
    for (u64 chunk = blockIdx.y; chunk < chunks; chunk += gridDim.y) {
        u64 r0 = chunk * COLUMN_CHUNK_ROWS;
        u64 r1 = r0 + COLUMN_CHUNK_ROWS < rows ? r0 + COLUMN_CHUNK_ROWS : rows;
        float g = 0.0f, b = 0.0f;
        if (col < cols) {
            for (u64 r = r0 + threadIdx.y; r < r1; r += COLUMN_ROW_THREADS) {
                float d = dy[r * cols + col];
                g += d * ((x[r * cols + col] - mean[r]) * rstd[r]);
                b += d;
            }
        }
        gsums[threadIdx.y][threadIdx.x] = g;
        bsums[threadIdx.y][threadIdx.x] = b;
        __syncthreads();
        if (threadIdx.y == 0 && col < cols) {
            float tg = 0.0f, tb = 0.0f;
            for (int k = 0; k < COLUMN_ROW_THREADS; ++k) {
                tg += gsums[k][threadIdx.x];
                tb += bsums[k][threadIdx.x];
            }
            partials[chunk * cols + col] = tg;
            partials[(chunks + chunk) * cols + col] = tb;
        }
        __syncthreads();
    }
}

// out[j] (+)= the sum of partials[c * cols + j] over c; one warp per column.
extern "C" __global__ void sum_partials_f32(const float* partials, float* out, u64 chunks, u64 cols, int accumulate) {
    u64 col = warp_row();
    if (col >= cols) return;
    float acc = 0.0f;
    for (u64 c = lane(); c < chunks; c += 32) acc += partials[c * cols + col];
    acc = warp_sum(acc);
    if (lane() == 0) out[col] = accumulate ? out[col] + acc : acc;
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
    u32 label = labels[row];
    if ((u64)label >= cols) {
        // Refused by the label check queued before; no logit is read by this label.
        if (lane() == 0) {
            row_loss[row] = 0.0;
            row_hit[row] = 0;
        }
        return;
    }
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

// The same sums by table row, for small tables: a block of EMBED_THREADS threads takes one row
// and EMBED_THREADS of its columns, reads the ids through shared memory in order and adds the
// gradient rows whose id is its row. Each element adds the same terms in the same order as the
// kernel above, so both give the same bits; this one runs vocab x (width / EMBED_THREADS)
// blocks in parallel instead of width threads over every id.
#define EMBED_THREADS 128
#define EMBED_ID_TILE 1024

extern "C" __global__ void embedding_backward_rows_f32(const float* ids, const float* dy, float* dtable, u64 n,
                                                       u64 width, u64 vocab) {
    __shared__ float tile[EMBED_ID_TILE];
    u64 col = (u64)blockIdx.x * EMBED_THREADS + threadIdx.x;
    for (u64 row = blockIdx.y; row < vocab; row += gridDim.y) {
        float acc = col < width ? dtable[row * width + col] : 0.0f;
        float id = (float)row;
        for (u64 i0 = 0; i0 < n; i0 += EMBED_ID_TILE) {
            u64 len = n - i0 < EMBED_ID_TILE ? n - i0 : EMBED_ID_TILE;
            __syncthreads();
            for (u64 i = threadIdx.x; i < len; i += EMBED_THREADS) tile[i] = ids[i0 + i];
            __syncthreads();
            if (col < width) {
                for (u64 i = 0; i < len; ++i) {
                    if (tile[i] == id) acc += dy[(i0 + i) * width + col];
                }
            }
        }
        if (col < width) dtable[row * width + col] = acc;
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

// ---- causal attention, tiled: one thread per query (forward) or key (backward) row ---------
//
// For head widths D in {16, 32, 64}: a block of ATT_TILE threads takes ATT_TILE consecutive rows
// of one (sequence, head); the other side's rows stream through shared memory ATT_TILE at a
// time, so a thread's dot products read shared memory (a broadcast: every thread reads the same
// key) and its own row in registers, with no shuffles. Per row the terms are taken in the same
// order as the one-warp kernels (keys in order, online softmax), dot products in feature order.
// Grid: x = row tiles, y = batch * heads.

#define ATT_TILE 64

template <int D>
__device__ __forceinline__ float dot_shared(const float* mine, const float* shared_row) {
    float s = 0.0f;
#pragma unroll
    for (int f = 0; f < D; ++f) s += mine[f] * shared_row[f];
    return s;
}

// Loads rows [r0, r0 + ATT_TILE) (those below `seq`) of the D-wide slice at `column` of a
// row-major [batch * seq, stride] tensor into `tile`.
template <int D>
__device__ __forceinline__ void load_tile(float (*tile)[D], const float* base, u64 r0, u64 seq, u64 stride,
                                          u64 column) {
    for (int e = threadIdx.x; e < ATT_TILE * D; e += ATT_TILE) {
        int r = e / D, f = e % D;
        u64 row = r0 + r;
        tile[r][f] = row < seq ? base[row * stride + column + f] : 0.0f;
    }
}

template <int D>
__device__ void attention_tiled(const float* qkv, float* out, float* lse, u64 seq, u64 heads, u64 width,
                                float scale) {
    __shared__ float ks[ATT_TILE][D];
    __shared__ float vs[ATT_TILE][D];
    u64 bh = blockIdx.y, b = bh / heads, h = bh % heads;
    u64 t = (u64)blockIdx.x * ATT_TILE + threadIdx.x;
    u64 stride = 3 * width;
    const float* base = qkv + b * seq * stride;
    float q[D], acc[D];
    bool live = t < seq;
#pragma unroll
    for (int f = 0; f < D; ++f) {
        q[f] = live ? base[t * stride + h * D + f] : 0.0f;
        acc[f] = 0.0f;
    }
    float m = neg_infinity(), l = 0.0f;
    u64 last = (u64)blockIdx.x * ATT_TILE + ATT_TILE - 1;
    if (last >= seq) last = seq - 1;
    for (u64 s0 = 0; s0 <= last; s0 += ATT_TILE) {
        __syncthreads();
        load_tile<D>(ks, base, s0, seq, stride, width + h * D);
        load_tile<D>(vs, base, s0, seq, stride, 2 * width + h * D);
        __syncthreads();
        if (!live || s0 > t) continue;
        u64 n = t - s0 + 1 < ATT_TILE ? t - s0 + 1 : ATT_TILE;
        for (u64 j = 0; j < n; ++j) {
            float score = dot_shared<D>(q, ks[j]) * scale;
            float m_new = fmaxf(m, score);
            float correction = expf(m - m_new);
            float p = expf(score - m_new);
            l = l * correction + p;
#pragma unroll
            for (int f = 0; f < D; ++f) acc[f] = acc[f] * correction + p * vs[j][f];
            m = m_new;
        }
    }
    if (!live) return;
    float* o = out + (b * seq + t) * width + h * D;
#pragma unroll
    for (int f = 0; f < D; ++f) o[f] = acc[f] / l;
    lse[bh * seq + t] = m + logf(l);
}

// Per query row t: delta_t = dout_t . out_t and dq_t = scale * sum_{s<=t} P_ts (dP_ts - delta_t) k_s.
template <int D>
__device__ void attention_backward_queries_tiled(const float* qkv, const float* out, const float* lse,
                                                 const float* dout, float* dqkv, float* delta, u64 seq,
                                                 u64 heads, u64 width, float scale) {
    __shared__ float ks[ATT_TILE][D];
    __shared__ float vs[ATT_TILE][D];
    u64 bh = blockIdx.y, b = bh / heads, h = bh % heads;
    u64 t = (u64)blockIdx.x * ATT_TILE + threadIdx.x;
    u64 stride = 3 * width;
    const float* base = qkv + b * seq * stride;
    bool live = t < seq;
    float q[D], go[D], acc[D];
    float dt = 0.0f;
#pragma unroll
    for (int f = 0; f < D; ++f) {
        q[f] = live ? base[t * stride + h * D + f] : 0.0f;
        go[f] = live ? dout[(b * seq + t) * width + h * D + f] : 0.0f;
        float o = live ? out[(b * seq + t) * width + h * D + f] : 0.0f;
        dt += go[f] * o;
        acc[f] = 0.0f;
    }
    float l = live ? lse[bh * seq + t] : 0.0f;
    u64 last = (u64)blockIdx.x * ATT_TILE + ATT_TILE - 1;
    if (last >= seq) last = seq - 1;
    for (u64 s0 = 0; s0 <= last; s0 += ATT_TILE) {
        __syncthreads();
        load_tile<D>(ks, base, s0, seq, stride, width + h * D);
        load_tile<D>(vs, base, s0, seq, stride, 2 * width + h * D);
        __syncthreads();
        if (!live || s0 > t) continue;
        u64 n = t - s0 + 1 < ATT_TILE ? t - s0 + 1 : ATT_TILE;
        for (u64 j = 0; j < n; ++j) {
            float p = expf(dot_shared<D>(q, ks[j]) * scale - l);
            float ds = p * (dot_shared<D>(go, vs[j]) - dt) * scale;
#pragma unroll
            for (int f = 0; f < D; ++f) acc[f] += ds * ks[j][f];
        }
    }
    if (!live) return;
    float* dq = dqkv + (b * seq + t) * stride + h * D;
#pragma unroll
    for (int f = 0; f < D; ++f) dq[f] = acc[f];
    delta[bh * seq + t] = dt;
}

// Per key row s: dk_s = scale * sum_{t>=s} P_ts (dP_ts - delta_t) q_t and dv_s = sum_{t>=s} P_ts dout_t.
template <int D>
__device__ void attention_backward_keys_tiled(const float* qkv, const float* lse, const float* dout,
                                              const float* delta, float* dqkv, u64 seq, u64 heads, u64 width,
                                              float scale) {
    __shared__ float qs[ATT_TILE][D];
    __shared__ float gos[ATT_TILE][D];
    __shared__ float lses[ATT_TILE];
    __shared__ float deltas[ATT_TILE];
    u64 bh = blockIdx.y, b = bh / heads, h = bh % heads;
    u64 s = (u64)blockIdx.x * ATT_TILE + threadIdx.x;
    u64 stride = 3 * width;
    const float* base = qkv + b * seq * stride;
    const float* dbase = dout + b * seq * width;
    bool live = s < seq;
    float k[D], v[D], dk[D], dv[D];
#pragma unroll
    for (int f = 0; f < D; ++f) {
        k[f] = live ? base[s * stride + width + h * D + f] : 0.0f;
        v[f] = live ? base[s * stride + 2 * width + h * D + f] : 0.0f;
        dk[f] = 0.0f;
        dv[f] = 0.0f;
    }
    for (u64 t0 = (u64)blockIdx.x * ATT_TILE; t0 < seq; t0 += ATT_TILE) {
        __syncthreads();
        load_tile<D>(qs, base, t0, seq, stride, h * D);
        load_tile<D>(gos, dbase, t0, seq, width, h * D);
        u64 tt = t0 + threadIdx.x;
        lses[threadIdx.x] = tt < seq ? lse[bh * seq + tt] : 0.0f;
        deltas[threadIdx.x] = tt < seq ? delta[bh * seq + tt] : 0.0f;
        __syncthreads();
        if (!live) continue;
        u64 first = s > t0 ? s - t0 : 0;
        u64 n = seq - t0 < ATT_TILE ? seq - t0 : ATT_TILE;
        for (u64 j = first; j < n; ++j) {
            float p = expf(dot_shared<D>(qs[j], k) * scale - lses[j]);
            float ds = p * (dot_shared<D>(gos[j], v) - deltas[j]) * scale;
#pragma unroll
            for (int f = 0; f < D; ++f) {
                dk[f] += ds * qs[j][f];
                dv[f] += p * gos[j][f];
            }
        }
    }
    if (!live) return;
    float* dkr = dqkv + (b * seq + s) * stride + width + h * D;
    float* dvr = dqkv + (b * seq + s) * stride + 2 * width + h * D;
#pragma unroll
    for (int f = 0; f < D; ++f) {
        dkr[f] = dk[f];
        dvr[f] = dv[f];
    }
}

#define ATTENTION_TILED(D)                                                                                  \
    extern "C" __global__ void attention_tiled_##D(const float* qkv, float* out, float* lse, u64 seq,      \
                                                   u64 heads, u64 width, float scale) {                    \
        attention_tiled<D>(qkv, out, lse, seq, heads, width, scale);                                       \
    }                                                                                                      \
    extern "C" __global__ void attention_backward_queries_tiled_##D(                                       \
        const float* qkv, const float* out, const float* lse, const float* dout, float* dqkv, float* delta, \
        u64 seq, u64 heads, u64 width, float scale) {                                                      \
        attention_backward_queries_tiled<D>(qkv, out, lse, dout, dqkv, delta, seq, heads, width, scale);   \
    }                                                                                                      \
    extern "C" __global__ void attention_backward_keys_tiled_##D(const float* qkv, const float* lse,       \
                                                                 const float* dout, const float* delta,    \
                                                                 float* dqkv, u64 seq, u64 heads,          \
                                                                 u64 width, float scale) {                 \
        attention_backward_keys_tiled<D>(qkv, lse, dout, delta, dqkv, seq, heads, width, scale);           \
    }

ATTENTION_TILED(16)
ATTENTION_TILED(32)
ATTENTION_TILED(64)

// ---- bf16 operands for tensor-core products ------------------------------------------------
//
// f32 to bf16 by round-to-nearest-even (NaN kept quiet), as `half`'s `bf16::from_f32` on the
// host, so the wire's and the products' roundings agree.

__device__ __forceinline__ unsigned short f32_to_bf16(float x) {
    u32 bits = __float_as_uint(x);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((bits >> 16) | 0x0040u);
    u32 rounding = 0x7fffu + ((bits >> 16) & 1u);
    return (unsigned short)((bits + rounding) >> 16);
}

extern "C" __global__ void to_bf16(const float* x, unsigned short* out, u64 n) {
    for (u64 i = global_index(); i < n; i += global_stride()) out[i] = f32_to_bf16(x[i]);
}

// ---- causal attention on tensor cores: head width 64, bf16 products, f32 softmax -----------
//
// Flash attention (`--precision bf16`): Q K^T, P V and the backward's products run as bf16
// `mma.sync.m16n8k16` on tensor cores with f32 accumulation; the softmax statistics, the
// running maximum and sum, delta and every output stay f32, and no T x T matrix is written.
// Tensors stay f32 in memory: a tile is rounded to bf16 (round to nearest even, as `to_bf16`)
// as it is staged in shared memory. Each warp owns 16 rows of its block (queries in the forward
// and the dq pass, keys in the dk/dv pass); the other side streams through shared memory
// FA_TILE rows at a time. Shared rows are FA_PAD bf16 wide (144 bytes) so that the eight rows
// a fragment load touches fall in distinct banks. The backward is two passes, as the tiled
// kernels': dq and delta per query block, then dk and dv per key block, so no value is summed
// with atomics and the result depends only on the shape. Needs sm_80 or newer (the host picks
// these kernels only there); older targets compile empty bodies.
//
// Fragment layout of m16n8k16 (g = lane / 4, c = lane % 4): A (16 x 16, row-major) registers
// hold rows g and g + 8 at columns 2c, 2c + 1 (a0, a1) and 2c + 8, 2c + 9 (a2, a3); B (16 x 8)
// holds rows 2c, 2c + 1 (b0) and 2c + 8, 2c + 9 (b1) of column g; the f32 accumulator holds
// rows g (d0, d1) and g + 8 (d2, d3) at columns 2c, 2c + 1.

#define FA_D 64
#define FA_TILE 64
#define FA_PAD 72
#define FA_FORWARD_WARPS 8
#define FA_BACKWARD_WARPS 4
#define LOG2_E 1.4426950408889634f
#define LN_2 0.6931471805599453f

typedef unsigned short bf16_bits;

#if __CUDA_ARCH__ >= 800
// Two f32 rounded to bf16 (round to nearest even), `lo` in the low half.
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// c += a b on tensor cores: a 16 x 16 bf16 (row-major), b 16 x 8 bf16, c 16 x 8 f32.
__device__ __forceinline__ void mma_bf16(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 shared_pair(const bf16_bits* p) {
    return *(const u32*)p;
}

// Rows [r0, r0 + rows) of the FA_D-wide slice at `column` of a row-major f32 [.., stride]
// tensor, rows at or past `seq` as zeros, into `tile` as bf16, row-major.
__device__ __forceinline__ void fa_stage_rows(bf16_bits (*tile)[FA_PAD], int rows, const float* base, u64 r0,
                                              u64 seq, u64 stride, u64 column) {
    for (int e = threadIdx.x; e < rows * (FA_D / 4); e += blockDim.x) {
        int r = e / (FA_D / 4), f = (e % (FA_D / 4)) * 4;
        u64 row = r0 + r;
        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (row < seq) v = *(const float4*)(base + row * stride + column + f);
        *(uint2*)&tile[r][f] = make_uint2(pack_bf16(v.x, v.y), pack_bf16(v.z, v.w));
    }
}

// The same slice transposed: `tile[f][r]` holds row r's feature f.
__device__ __forceinline__ void fa_stage_columns(bf16_bits (*tile)[FA_PAD], const float* base, u64 r0, u64 seq,
                                                 u64 stride, u64 column) {
    for (int e = threadIdx.x; e < FA_TILE * (FA_D / 4); e += blockDim.x) {
        int r = e / (FA_D / 4), f = (e % (FA_D / 4)) * 4;
        u64 row = r0 + r;
        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (row < seq) v = *(const float4*)(base + row * stride + column + f);
        tile[f][r] = f32_to_bf16(v.x);
        tile[f + 1][r] = f32_to_bf16(v.y);
        tile[f + 2][r] = f32_to_bf16(v.z);
        tile[f + 3][r] = f32_to_bf16(v.w);
    }
}

// A warp's A fragments of its 16 rows (from `first`) of a staged FA_D-wide tile.
__device__ __forceinline__ void fa_row_fragments(u32 (*frag)[4], const bf16_bits (*tile)[FA_PAD], int first) {
    int g = (threadIdx.x % 32) >> 2, c = threadIdx.x & 3;
#pragma unroll
    for (int kk = 0; kk < FA_D / 16; ++kk) {
        frag[kk][0] = shared_pair(&tile[first + g][kk * 16 + 2 * c]);
        frag[kk][1] = shared_pair(&tile[first + g + 8][kk * 16 + 2 * c]);
        frag[kk][2] = shared_pair(&tile[first + g][kk * 16 + 8 + 2 * c]);
        frag[kk][3] = shared_pair(&tile[first + g + 8][kk * 16 + 8 + 2 * c]);
    }
}

// acc[n] (16 x 8 f32, n over FA_TILE / 8 column blocks) = a (16 x FA_D) times the transpose of
// `tile` (FA_TILE x FA_D rows): row r of the result against tile row n * 8 + column.
__device__ __forceinline__ void fa_times_rows(float (*acc)[4], const u32 (*a)[4], const bf16_bits (*tile)[FA_PAD]) {
    int g = (threadIdx.x % 32) >> 2, c = threadIdx.x & 3;
#pragma unroll
    for (int n = 0; n < FA_TILE / 8; ++n) {
        acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < FA_D / 16; ++kk)
            mma_bf16(acc[n], a[kk], shared_pair(&tile[n * 8 + g][kk * 16 + 2 * c]),
                     shared_pair(&tile[n * 8 + g][kk * 16 + 8 + 2 * c]));
    }
}

// acc[n] (16 x 8, n over FA_D / 8 feature blocks) += p (16 x FA_TILE, f32 accumulator layout,
// rounded to bf16 here) times the tile whose transpose is `tile_t` ([feature][row]).
__device__ __forceinline__ void fa_accumulate(float (*acc)[4], const float (*p)[4], const bf16_bits (*tile_t)[FA_PAD]) {
    int g = (threadIdx.x % 32) >> 2, c = threadIdx.x & 3;
#pragma unroll
    for (int kk = 0; kk < FA_TILE / 16; ++kk) {
        u32 a[4] = {pack_bf16(p[2 * kk][0], p[2 * kk][1]), pack_bf16(p[2 * kk][2], p[2 * kk][3]),
                    pack_bf16(p[2 * kk + 1][0], p[2 * kk + 1][1]), pack_bf16(p[2 * kk + 1][2], p[2 * kk + 1][3])};
#pragma unroll
        for (int n = 0; n < FA_D / 8; ++n)
            mma_bf16(acc[n], a, shared_pair(&tile_t[n * 8 + g][kk * 16 + 2 * c]),
                     shared_pair(&tile_t[n * 8 + g][kk * 16 + 8 + 2 * c]));
    }
}
#endif

extern "C" __global__ void __launch_bounds__(FA_FORWARD_WARPS * 32)
    attention_mma_64(const float* qkv, float* out, float* lse, u64 seq, u64 heads, u64 width, float scale) {
#if __CUDA_ARCH__ >= 800
    __shared__ __align__(16) bf16_bits qs[FA_FORWARD_WARPS * 16][FA_PAD];
    __shared__ __align__(16) bf16_bits ks[FA_TILE][FA_PAD];
    __shared__ __align__(16) bf16_bits vt[FA_D][FA_PAD];
    const int rows = FA_FORWARD_WARPS * 16;
    u64 bh = blockIdx.y, b = bh / heads, h = bh % heads;
    // The longest rows (most keys) start first.
    u64 q0 = (u64)(gridDim.x - 1 - blockIdx.x) * rows;
    u64 stride = 3 * width;
    const float* base = qkv + b * seq * stride;
    int warp = threadIdx.x / 32, g = (threadIdx.x % 32) >> 2, c = threadIdx.x & 3;
    int first = warp * 16;
    fa_stage_rows(qs, rows, base, q0, seq, stride, h * FA_D);
    __syncthreads();
    u32 qf[FA_D / 16][4];
    fa_row_fragments(qf, qs, first);
    float o[FA_D / 8][4];
#pragma unroll
    for (int n = 0; n < FA_D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m[2] = {neg_infinity(), neg_infinity()}, l[2] = {0.0f, 0.0f};
    u64 row[2] = {q0 + first + g, q0 + first + g + 8};
    float to_log2 = scale * LOG2_E;
    u64 last = q0 + rows - 1 < seq - 1 ? q0 + rows - 1 : seq - 1;
    for (u64 k0 = 0; k0 <= last; k0 += FA_TILE) {
        __syncthreads();
        fa_stage_rows(ks, FA_TILE, base, k0, seq, stride, width + h * FA_D);
        fa_stage_columns(vt, base, k0, seq, stride, 2 * width + h * FA_D);
        __syncthreads();
        // Every key of this tile comes after every row of this warp.
        if (k0 > q0 + first + 15) continue;
        float s[FA_TILE / 8][4];
        fa_times_rows(s, qf, ks);
        float top[2] = {m[0], m[1]};
#pragma unroll
        for (int n = 0; n < FA_TILE / 8; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                u64 key = k0 + n * 8 + 2 * c + (i & 1);
                float v = key > row[i >> 1] ? neg_infinity() : s[n][i] * to_log2;
                s[n][i] = v;
                top[i >> 1] = fmaxf(top[i >> 1], v);
            }
        float correction[2], partial[2] = {0.0f, 0.0f};
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            top[r] = fmaxf(top[r], __shfl_xor_sync(FULL_MASK, top[r], 1));
            top[r] = fmaxf(top[r], __shfl_xor_sync(FULL_MASK, top[r], 2));
            correction[r] = exp2f(m[r] - top[r]);
            m[r] = top[r];
        }
#pragma unroll
        for (int n = 0; n < FA_TILE / 8; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                float p = exp2f(s[n][i] - m[i >> 1]);
                s[n][i] = p;
                partial[i >> 1] += p;
            }
#pragma unroll
        for (int r = 0; r < 2; ++r) l[r] = l[r] * correction[r] + partial[r];
#pragma unroll
        for (int n = 0; n < FA_D / 8; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) o[n][i] *= correction[i >> 1];
        fa_accumulate(o, s, vt);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(FULL_MASK, l[r], 1);
        l[r] += __shfl_xor_sync(FULL_MASK, l[r], 2);
    }
#pragma unroll
    for (int n = 0; n < FA_D / 8; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            u64 t = row[i >> 1];
            if (t < seq) out[(b * seq + t) * width + h * FA_D + n * 8 + 2 * c + (i & 1)] = o[n][i] / l[i >> 1];
        }
    if (c == 0)
#pragma unroll
        for (int r = 0; r < 2; ++r)
            if (row[r] < seq) lse[bh * seq + row[r]] = (m[r] + log2f(l[r])) * LN_2;
#endif
}

// Per query row t: delta_t = dout_t . out_t (f32) and dq_t = scale * sum_{s<=t} P_ts (dP_ts - delta_t) k_s.
extern "C" __global__ void __launch_bounds__(FA_BACKWARD_WARPS * 32)
    attention_backward_queries_mma_64(const float* qkv, const float* out, const float* lse, const float* dout,
                                      float* dqkv, float* delta, u64 seq, u64 heads, u64 width, float scale) {
#if __CUDA_ARCH__ >= 800
    __shared__ __align__(16) bf16_bits ks[FA_TILE][FA_PAD];
    __shared__ __align__(16) bf16_bits kt[FA_D][FA_PAD];
    __shared__ __align__(16) bf16_bits vs[FA_TILE][FA_PAD];
    __shared__ float row_lse[FA_BACKWARD_WARPS * 16];
    __shared__ float row_delta[FA_BACKWARD_WARPS * 16];
    const int rows = FA_BACKWARD_WARPS * 16;
    u64 bh = blockIdx.y, b = bh / heads, h = bh % heads;
    u64 q0 = (u64)(gridDim.x - 1 - blockIdx.x) * rows;
    u64 stride = 3 * width;
    const float* base = qkv + b * seq * stride;
    const float* dbase = dout + b * seq * width;
    int warp = threadIdx.x / 32, g = (threadIdx.x % 32) >> 2, c = threadIdx.x & 3;
    int first = warp * 16;
    // delta in f32 from the f32 tensors, features in order; lse into base-2 units.
    for (int r = threadIdx.x; r < rows; r += blockDim.x) {
        u64 t = q0 + r;
        float d = 0.0f;
        if (t < seq) {
            const float* go = dbase + t * width + h * FA_D;
            const float* o = out + (b * seq + t) * width + h * FA_D;
            for (int f = 0; f < FA_D; ++f) d += go[f] * o[f];
            delta[bh * seq + t] = d;
        }
        row_delta[r] = d;
        row_lse[r] = t < seq ? lse[bh * seq + t] * LOG2_E : 0.0f;
    }
    // Q and dO fragments, staged through the key tiles' memory.
    fa_stage_rows(ks, rows, base, q0, seq, stride, h * FA_D);
    fa_stage_rows(vs, rows, dbase, q0, seq, width, h * FA_D);
    __syncthreads();
    u32 qf[FA_D / 16][4], gf[FA_D / 16][4];
    fa_row_fragments(qf, ks, first);
    fa_row_fragments(gf, vs, first);
    u64 row[2] = {q0 + first + g, q0 + first + g + 8};
    float lse2[2] = {row_lse[first + g], row_lse[first + g + 8]};
    float dt[2] = {row_delta[first + g], row_delta[first + g + 8]};
    float dq[FA_D / 8][4];
#pragma unroll
    for (int n = 0; n < FA_D / 8; ++n) dq[n][0] = dq[n][1] = dq[n][2] = dq[n][3] = 0.0f;
    float to_log2 = scale * LOG2_E;
    u64 last = q0 + rows - 1 < seq - 1 ? q0 + rows - 1 : seq - 1;
    for (u64 k0 = 0; k0 <= last; k0 += FA_TILE) {
        __syncthreads();
        fa_stage_rows(ks, FA_TILE, base, k0, seq, stride, width + h * FA_D);
        fa_stage_columns(kt, base, k0, seq, stride, width + h * FA_D);
        fa_stage_rows(vs, FA_TILE, base, k0, seq, stride, 2 * width + h * FA_D);
        __syncthreads();
        if (k0 > q0 + first + 15) continue;
        float s[FA_TILE / 8][4], dp[FA_TILE / 8][4];
        fa_times_rows(s, qf, ks);
        fa_times_rows(dp, gf, vs);
#pragma unroll
        for (int n = 0; n < FA_TILE / 8; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                u64 key = k0 + n * 8 + 2 * c + (i & 1);
                int r = i >> 1;
                float p = key > row[r] ? 0.0f : exp2f(s[n][i] * to_log2 - lse2[r]);
                s[n][i] = p * (dp[n][i] - dt[r]) * scale;
            }
        fa_accumulate(dq, s, kt);
    }
#pragma unroll
    for (int n = 0; n < FA_D / 8; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            u64 t = row[i >> 1];
            if (t < seq) dqkv[(b * seq + t) * stride + h * FA_D + n * 8 + 2 * c + (i & 1)] = dq[n][i];
        }
#endif
}

// Per key row s: dk_s = scale * sum_{t>=s} P_ts (dP_ts - delta_t) q_t and dv_s = sum_{t>=s} P_ts dout_t.
extern "C" __global__ void __launch_bounds__(FA_BACKWARD_WARPS * 32)
    attention_backward_keys_mma_64(const float* qkv, const float* lse, const float* dout, const float* delta,
                                   float* dqkv, u64 seq, u64 heads, u64 width, float scale) {
#if __CUDA_ARCH__ >= 800
    __shared__ __align__(16) bf16_bits qs[FA_TILE][FA_PAD];
    __shared__ __align__(16) bf16_bits qt[FA_D][FA_PAD];
    __shared__ __align__(16) bf16_bits gs[FA_TILE][FA_PAD];
    __shared__ __align__(16) bf16_bits gt[FA_D][FA_PAD];
    __shared__ float col_lse[FA_TILE];
    __shared__ float col_delta[FA_TILE];
    const int rows = FA_BACKWARD_WARPS * 16;
    u64 bh = blockIdx.y, b = bh / heads, h = bh % heads;
    // The first keys see the most queries and start first.
    u64 k0 = (u64)blockIdx.x * rows;
    u64 stride = 3 * width;
    const float* base = qkv + b * seq * stride;
    const float* dbase = dout + b * seq * width;
    int warp = threadIdx.x / 32, g = (threadIdx.x % 32) >> 2, c = threadIdx.x & 3;
    int first = warp * 16;
    fa_stage_rows(qs, rows, base, k0, seq, stride, width + h * FA_D);
    fa_stage_rows(gs, rows, base, k0, seq, stride, 2 * width + h * FA_D);
    __syncthreads();
    u32 kf[FA_D / 16][4], vf[FA_D / 16][4];
    fa_row_fragments(kf, qs, first);
    fa_row_fragments(vf, gs, first);
    u64 key[2] = {k0 + first + g, k0 + first + g + 8};
    float dk[FA_D / 8][4], dv[FA_D / 8][4];
#pragma unroll
    for (int n = 0; n < FA_D / 8; ++n) {
        dk[n][0] = dk[n][1] = dk[n][2] = dk[n][3] = 0.0f;
        dv[n][0] = dv[n][1] = dv[n][2] = dv[n][3] = 0.0f;
    }
    float to_log2 = scale * LOG2_E;
    for (u64 t0 = k0; t0 < seq; t0 += FA_TILE) {
        __syncthreads();
        fa_stage_rows(qs, FA_TILE, base, t0, seq, stride, h * FA_D);
        fa_stage_columns(qt, base, t0, seq, stride, h * FA_D);
        fa_stage_rows(gs, FA_TILE, dbase, t0, seq, width, h * FA_D);
        fa_stage_columns(gt, dbase, t0, seq, width, h * FA_D);
        for (int j = threadIdx.x; j < FA_TILE; j += blockDim.x) {
            u64 t = t0 + j;
            // A query past the end contributes nothing: its probability is exp2(-inf) = 0.
            col_lse[j] = t < seq ? lse[bh * seq + t] * LOG2_E : __int_as_float(0x7f800000);
            col_delta[j] = t < seq ? delta[bh * seq + t] : 0.0f;
        }
        __syncthreads();
        float p[FA_TILE / 8][4], ds[FA_TILE / 8][4];
        fa_times_rows(p, kf, qs);
        fa_times_rows(ds, vf, gs);
#pragma unroll
        for (int n = 0; n < FA_TILE / 8; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                int j = n * 8 + 2 * c + (i & 1);
                u64 t = t0 + j;
                float pv = t < key[i >> 1] ? 0.0f : exp2f(p[n][i] * to_log2 - col_lse[j]);
                p[n][i] = pv;
                ds[n][i] = pv * (ds[n][i] - col_delta[j]) * scale;
            }
        fa_accumulate(dv, p, gt);
        fa_accumulate(dk, ds, qt);
    }
#pragma unroll
    for (int n = 0; n < FA_D / 8; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            u64 s = key[i >> 1];
            if (s < seq) {
                u64 at = (b * seq + s) * stride + h * FA_D + n * 8 + 2 * c + (i & 1);
                dqkv[at + width] = dk[n][i];
                dqkv[at + 2 * width] = dv[n][i];
            }
        }
#endif
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

extern "C" __global__ void lion_f32(float* w, const float* g, float* m, u64 n, float lr, float beta1,
                                    float beta2, float weight_decay) {
    for (u64 i = global_index(); i < n; i += global_stride()) {
        float wi = w[i], gi = g[i], mi = m[i];
        float c = beta1 * mi + (1.0f - beta1) * gi;
        float sign = (float)(c > 0.0f) - (float)(c < 0.0f);
        w[i] = wi - lr * (sign + weight_decay * wi);
        m[i] = beta2 * mi + (1.0f - beta2) * gi;
    }
}

// Delay compensation (DC-ASGD): g += lambda g g (w - ws); the adaptive form first moves the
// mean square ms toward g^2 and divides lambda by sqrt(ms + eps) per element.
extern "C" __global__ void delay_compensate_f32(float* g, const float* w, const float* ws, float* ms, u64 n,
                                                float lambda, int adaptive, float decay, float eps) {
    for (u64 i = global_index(); i < n; i += global_stride()) {
        float gi = g[i];
        float l = lambda;
        if (adaptive) {
            float msi = decay * ms[i] + (1.0f - decay) * gi * gi;
            ms[i] = msi;
            l = lambda / sqrtf(msi + eps);
        }
        g[i] = gi + l * gi * gi * (w[i] - ws[i]);
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
