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

// The label of a row that is not a loss term (`IGNORED_LABEL` in `backend.rs`: the first token
// of a packed document).
#define IGNORED_LABEL 0xffffffffu

extern "C" __global__ void check_labels_u32(const u32* labels, u64 n, u64 classes, unsigned int* first_bad) {
    for (u64 i = global_index(); i < n; i += global_stride()) {
        u32 label = labels[i];
        if (label != IGNORED_LABEL && (u64)label >= classes) atomicMin(first_bad, (unsigned int)i);
    }
}

// A token id's table row: the id when it is a whole number below vocab, else vocab (no row).
// The check below reports a bad id; the embedding's kernels skip it (a zero row forward, no
// term backward), so a bad id is never read or written past the table, whenever its check is
// read.
__device__ __forceinline__ u64 token_row(float v, u64 vocab) {
    bool whole = v >= 0.0f && floorf(v) == v;
    return whole && (double)v < (double)vocab ? (u64)v : vocab;
}

extern "C" __global__ void check_ids_f32(const float* ids, u64 n, u64 vocab, unsigned int* first_bad) {
    for (u64 i = global_index(); i < n; i += global_stride()) {
        if (token_row(ids[i], vocab) == vocab) atomicMin(first_bad, (unsigned int)i);
    }
}

// Packed documents' starts (see "packed documents" below): each a whole number no later than
// its own token's index t in its sequence of `seq`, and documents contiguous (past a sequence's
// first token, a start is its predecessor's or t itself).
extern "C" __global__ void check_document_starts_f32(const float* starts, u64 n, u64 seq, unsigned int* first_bad) {
    for (u64 i = global_index(); i < n; i += global_stride()) {
        float v = starts[i];
        u64 t = i % seq;
        bool whole = v >= 0.0f && floorf(v) == v;
        bool ok = whole && (double)v <= (double)t && (t == 0 || v == starts[i - 1] || (double)v == (double)t);
        if (!ok) atomicMin(first_bad, (unsigned int)i);
    }
}

// ---- softmax cross-entropy: one warp per row; per-row loss (f64) and hit, summed on the host ---
// A row holds `stride` logits, of which the first `cols` are classes; the rest are a padded
// vocabulary's columns, outside the softmax, with a zero gradient. A row labelled
// IGNORED_LABEL is not a loss term: loss 0, hit -1 (not counted), a zero gradient row.

extern "C" __global__ void softmax_xent_f32(const float* logits, const u32* labels, u64 rows, u64 cols,
                                            u64 stride, float grad_scale, float* dlogits,
                                            double* row_loss, int* row_hit) {
    u64 row = warp_row();
    if (row >= rows) return;
    u32 label = labels[row];
    if (label == IGNORED_LABEL) {
        if (lane() == 0) {
            row_loss[row] = 0.0;
            row_hit[row] = -1;
        }
        if (dlogits)
            for (u64 j = lane(); j < stride; j += 32) dlogits[row * stride + j] = 0.0f;
        return;
    }
    if ((u64)label >= cols) {
        // Refused by the label check queued before; no logit is read by this label.
        if (lane() == 0) {
            row_loss[row] = 0.0;
            row_hit[row] = 0;
        }
        return;
    }
    const float* lr = logits + row * stride;
    // One read for the arg-max and the sum of exponentials: each lane keeps its first maximum
    // and its sum of e^(v - max), each term an f32 exponential (as the CPU backend's) added in
    // f64, the sum rescaled (in f64) when the lane's maximum grows. The warp then keeps the
    // largest value and, among equals, the smallest index, and sums the lanes' sums against
    // it (a lane with no column holds -inf and 0, and its factor is 1, never exp(-inf + inf)).
    float best = neg_infinity();
    u64 arg = 0;
    double s = 0.0;
    for (u64 j = lane(); j < cols; j += 32) {
        float v = lr[j];
        if (v > best) {
            s *= exp((double)best - (double)v);
            best = v;
            arg = j;
        }
        // A logit of -inf adds nothing (and at a maximum still -inf, no NaN either).
        if (best != neg_infinity()) s += (double)expf(v - best);
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
        float ob = __shfl_xor_sync(FULL_MASK, best, offset);
        u64 oa = __shfl_xor_sync(FULL_MASK, arg, offset);
        double os = __shfl_xor_sync(FULL_MASK, s, offset);
        float top = fmaxf(best, ob);
        double mine = best == top ? s : s * exp((double)best - (double)top);
        double theirs = ob == top ? os : os * exp((double)ob - (double)top);
        s = mine + theirs;
        if (ob > best || (ob == best && oa < arg)) arg = oa;
        best = top;
    }
    double lse = log(s);
    if (lane() == 0) {
        row_loss[row] = lse - (double)(lr[label] - best);
        row_hit[row] = arg == (u64)label ? 1 : 0;
    }
    if (dlogits) {
        // The softmax as the CPU backend forms it: e^(v - max) in f32 times 1 / sum.
        float inverse = (float)(1.0 / s);
        for (u64 j = lane(); j < cols; j += 32) {
            float p = expf(lr[j] - best) * inverse;
            dlogits[row * stride + j] = (j == (u64)label ? p - 1.0f : p) * grad_scale;
        }
        for (u64 j = cols + lane(); j < stride; j += 32) dlogits[row * stride + j] = 0.0f;
    }
}

// ---- embedding ------------------------------------------------------------------------------

extern "C" __global__ void embedding_f32(const float* ids, const float* table, float* out, u64 n, u64 width,
                                         u64 vocab) {
    u64 total = n * width;
    for (u64 i = global_index(); i < total; i += global_stride()) {
        u64 row = i / width, col = i % width;
        u64 id = token_row(ids[row], vocab);
        out[i] = id < vocab ? table[id * width + col] : 0.0f;
    }
}

// The embedding's gradient: each table element adds the gradient rows of the positions holding
// its row's id, in position order (as the CPU backend does, so the same bits). Small tables: a
// block of EMBED_THREADS threads takes one row and EMBED_THREADS of its columns, reads the ids
// through shared memory in order and adds the gradient rows whose id is its row.
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

// The same sums for large tables, grouped by id first (three small passes, integers only, so
// the grouping is the same on every run), then a block per table row and EMBED_THREADS
// columns that adds its row's gradient rows in position order: the same terms in the same
// order as the kernels above, so the same bits, with work proportional to the ids rather than
// to vocab x ids.
//
// Pass 1: per position i, its rank among the earlier positions with the same id (ids read
// through shared memory), and the count of each id (integer atomics: the final counts do not
// depend on the order).
extern "C" __global__ void embedding_rank_ids_f32(const float* ids, u64 n, u32* rank, u32* count, u64 rows) {
    __shared__ float tile[EMBED_ID_TILE];
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    float mine = i < n ? ids[i] : -1.0f;
    u32 r = 0;
    u64 last = (u64)blockIdx.x * blockDim.x + blockDim.x;
    if (last > n) last = n;
    for (u64 t0 = 0; t0 < last; t0 += EMBED_ID_TILE) {
        __syncthreads();
        for (u64 j = threadIdx.x; j < EMBED_ID_TILE; j += blockDim.x)
            tile[j] = t0 + j < n ? ids[t0 + j] : -1.0f;
        __syncthreads();
        if (i < n) {
            u64 end = i - t0 < EMBED_ID_TILE ? i - t0 : EMBED_ID_TILE;
            if (i < t0) end = 0;
            for (u64 j = 0; j < end; ++j) r += tile[j] == mine ? 1u : 0u;
        }
    }
    if (i < n) {
        rank[i] = r;
        u64 id = token_row(mine, rows);
        if (id < rows) atomicAdd(&count[id], 1u);
    }
}

// Pass 2: the exclusive prefix sums of `count` (rows values) into `offset` (rows + 1 values),
// by one block: each thread sums a contiguous chunk, the chunk sums are scanned in order, then
// each thread writes its chunk's prefixes.
#define SCAN_THREADS 1024
extern "C" __global__ void exclusive_scan_u32(const u32* count, u32* offset, u64 rows) {
    __shared__ u32 chunk_total[SCAN_THREADS];
    u64 per = (rows + SCAN_THREADS - 1) / SCAN_THREADS;
    u64 start = threadIdx.x * per, end = start + per < rows ? start + per : rows;
    u32 s = 0;
    for (u64 r = start; r < end; ++r) s += count[r];
    chunk_total[threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        u32 running = 0;
        for (int t = 0; t < SCAN_THREADS; ++t) {
            u32 v = chunk_total[t];
            chunk_total[t] = running;
            running += v;
        }
        offset[rows] = running;
    }
    __syncthreads();
    u32 running = chunk_total[threadIdx.x];
    for (u64 r = start; r < end; ++r) {
        offset[r] = running;
        running += count[r];
    }
}

// Pass 3: the positions grouped by id, each group in position order.
extern "C" __global__ void embedding_group_ids_f32(const float* ids, const u32* rank, const u32* offset, u64 n,
                                                   u32* positions, u64 rows) {
    for (u64 i = global_index(); i < n; i += global_stride()) {
        u64 id = token_row(ids[i], rows);
        if (id < rows) positions[offset[id] + rank[i]] = (u32)i;
    }
}

// Pass 4: per table row and EMBED_THREADS columns, the row's gradient rows added in position
// order to what the table holds.
extern "C" __global__ void embedding_backward_grouped_f32(const u32* offset, const u32* positions, const float* dy,
                                                          float* dtable, u64 width, u64 rows) {
    u64 col = (u64)blockIdx.x * EMBED_THREADS + threadIdx.x;
    for (u64 row = blockIdx.y; row < rows; row += gridDim.y) {
        u32 start = offset[row], end = offset[row + 1];
        if (start == end || col >= width) continue;
        float acc = dtable[row * width + col];
        for (u32 k = start; k < end; ++k) acc += dy[(u64)positions[k] * width + col];
        dtable[row * width + col] = acc;
    }
}

// ---- packed documents ------------------------------------------------------------------------
//
// Every attention kernel takes `starts`: null for one document per sequence, or per token of
// [batch * seq] the index in its sequence where its document starts (whole numbers in f32,
// checked by check_document_starts_f32 before any attention kernel is launched). Token t then
// attends over keys starts[t]..=t only: the forward and the query pass begin at a row's start,
// the key pass skips the queries of later documents. Documents are contiguous, so starts never
// decrease along a sequence: once a query's start is past a key, every later query's is too,
// and the key pass ends there.

__device__ __forceinline__ u64 document_start(const float* starts, u64 token) {
    return starts ? (u64)starts[token] : 0;
}

// The earliest document start among rows [r0, r0 + rows) of sequence b (those below seq): no
// row of the block attends to a key before it. Called once per kernel by every thread of the
// block (it synchronises them).
__device__ u64 block_first_key(const float* starts, u64 b, u64 seq, u64 r0, int rows) {
    __shared__ unsigned int first;
    if (!starts) return 0;
    if (threadIdx.x == 0) first = 0xffffffffu;
    __syncthreads();
    for (int r = threadIdx.x; r < rows; r += blockDim.x)
        if (r0 + r < seq) atomicMin(&first, (unsigned int)starts[b * seq + r0 + r]);
    __syncthreads();
    return first == 0xffffffffu ? 0 : (u64)first;
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

extern "C" __global__ void attention_f32(const float* qkv, const float* starts, float* out, float* lse,
                                         u64 batch, u64 seq, u64 heads, u64 width, float scale) {
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
    for (u64 s = document_start(starts, b * seq + t); s <= t; ++s) {
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
extern "C" __global__ void attention_backward_queries_f32(const float* qkv, const float* starts, const float* out,
                                                          const float* lse, const float* dout, float* dqkv,
                                                          float* delta, u64 batch, u64 seq, u64 heads,
                                                          u64 width, float scale) {
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
    for (u64 s = document_start(starts, b * seq + t); s <= t; ++s) {
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
extern "C" __global__ void attention_backward_keys_f32(const float* qkv, const float* starts, const float* lse,
                                                       const float* dout, const float* delta, float* dqkv,
                                                       u64 batch, u64 seq, u64 heads, u64 width,
                                                       float scale) {
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
        // A query of a later document does not see this key, nor does any query after it.
        if (document_start(starts, b * seq + t) > s) break;
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
__device__ void attention_tiled(const float* qkv, const float* starts, float* out, float* lse, u64 seq, u64 heads,
                                u64 width, float scale) {
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
    u64 start = live ? document_start(starts, b * seq + t) : 0;
    u64 first = block_first_key(starts, b, seq, (u64)blockIdx.x * ATT_TILE, ATT_TILE);
    u64 last = (u64)blockIdx.x * ATT_TILE + ATT_TILE - 1;
    if (last >= seq) last = seq - 1;
    for (u64 s0 = first / ATT_TILE * ATT_TILE; s0 <= last; s0 += ATT_TILE) {
        __syncthreads();
        load_tile<D>(ks, base, s0, seq, stride, width + h * D);
        load_tile<D>(vs, base, s0, seq, stride, 2 * width + h * D);
        __syncthreads();
        if (!live || s0 > t) continue;
        u64 n = t - s0 + 1 < ATT_TILE ? t - s0 + 1 : ATT_TILE;
        for (u64 j = start > s0 ? start - s0 : 0; j < n; ++j) {
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
__device__ void attention_backward_queries_tiled(const float* qkv, const float* starts, const float* out,
                                                 const float* lse, const float* dout, float* dqkv, float* delta,
                                                 u64 seq, u64 heads, u64 width, float scale) {
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
    u64 start = live ? document_start(starts, b * seq + t) : 0;
    u64 first = block_first_key(starts, b, seq, (u64)blockIdx.x * ATT_TILE, ATT_TILE);
    u64 last = (u64)blockIdx.x * ATT_TILE + ATT_TILE - 1;
    if (last >= seq) last = seq - 1;
    for (u64 s0 = first / ATT_TILE * ATT_TILE; s0 <= last; s0 += ATT_TILE) {
        __syncthreads();
        load_tile<D>(ks, base, s0, seq, stride, width + h * D);
        load_tile<D>(vs, base, s0, seq, stride, 2 * width + h * D);
        __syncthreads();
        if (!live || s0 > t) continue;
        u64 n = t - s0 + 1 < ATT_TILE ? t - s0 + 1 : ATT_TILE;
        for (u64 j = start > s0 ? start - s0 : 0; j < n; ++j) {
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
__device__ void attention_backward_keys_tiled(const float* qkv, const float* starts, const float* lse,
                                              const float* dout, const float* delta, float* dqkv, u64 seq,
                                              u64 heads, u64 width, float scale) {
    __shared__ float qs[ATT_TILE][D];
    __shared__ float gos[ATT_TILE][D];
    __shared__ float lses[ATT_TILE];
    __shared__ float deltas[ATT_TILE];
    __shared__ u32 query_starts[ATT_TILE];
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
    // The block's last key: a query tile whose first query starts its document past it (and so
    // every later one) sees none of the block's keys.
    u64 last_key = (u64)blockIdx.x * ATT_TILE + ATT_TILE - 1;
    if (last_key >= seq) last_key = seq - 1;
    for (u64 t0 = (u64)blockIdx.x * ATT_TILE; t0 < seq; t0 += ATT_TILE) {
        if (document_start(starts, b * seq + t0) > last_key) break;
        __syncthreads();
        load_tile<D>(qs, base, t0, seq, stride, h * D);
        load_tile<D>(gos, dbase, t0, seq, width, h * D);
        u64 tt = t0 + threadIdx.x;
        lses[threadIdx.x] = tt < seq ? lse[bh * seq + tt] : 0.0f;
        deltas[threadIdx.x] = tt < seq ? delta[bh * seq + tt] : 0.0f;
        query_starts[threadIdx.x] = tt < seq ? (u32)document_start(starts, b * seq + tt) : 0u;
        __syncthreads();
        if (!live) continue;
        u64 first = s > t0 ? s - t0 : 0;
        u64 n = seq - t0 < ATT_TILE ? seq - t0 : ATT_TILE;
        for (u64 j = first; j < n; ++j) {
            // A query of a later document does not see this key.
            if (query_starts[j] > s) continue;
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
    extern "C" __global__ void attention_tiled_##D(const float* qkv, const float* starts, float* out,      \
                                                   float* lse, u64 seq, u64 heads, u64 width, float scale) { \
        attention_tiled<D>(qkv, starts, out, lse, seq, heads, width, scale);                               \
    }                                                                                                      \
    extern "C" __global__ void attention_backward_queries_tiled_##D(                                       \
        const float* qkv, const float* starts, const float* out, const float* lse, const float* dout,      \
        float* dqkv, float* delta, u64 seq, u64 heads, u64 width, float scale) {                           \
        attention_backward_queries_tiled<D>(qkv, starts, out, lse, dout, dqkv, delta, seq, heads, width,   \
                                            scale);                                                        \
    }                                                                                                      \
    extern "C" __global__ void attention_backward_keys_tiled_##D(                                          \
        const float* qkv, const float* starts, const float* lse, const float* dout, const float* delta,    \
        float* dqkv, u64 seq, u64 heads, u64 width, float scale) {                                         \
        attention_backward_keys_tiled<D>(qkv, starts, lse, dout, delta, dqkv, seq, heads, width, scale);   \
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

// Four values a thread (16-byte loads, 8-byte stores; both buffers come from the pool, whose
// blocks are aligned far beyond that), the last n mod 4 one by one.
extern "C" __global__ void to_bf16(const float* x, unsigned short* out, u64 n) {
    u64 quads = n / 4;
    const float4* x4 = (const float4*)x;
    uint2* out4 = (uint2*)out;
    for (u64 i = global_index(); i < quads; i += global_stride()) {
        float4 v = x4[i];
        u32 lo = (u32)f32_to_bf16(v.x) | ((u32)f32_to_bf16(v.y) << 16);
        u32 hi = (u32)f32_to_bf16(v.z) | ((u32)f32_to_bf16(v.w) << 16);
        out4[i] = make_uint2(lo, hi);
    }
    for (u64 i = 4 * quads + global_index(); i < n; i += global_stride()) out[i] = f32_to_bf16(x[i]);
}

// ---- causal attention on tensor cores: head width 64, bf16 products, f32 softmax -----------
//
// Flash attention (`--precision bf16`): Q K^T, P V and the backward's products run as bf16
// `mma.sync.m16n8k16` on tensor cores with f32 accumulation; the softmax statistics, the
// running maximum and sum, delta and every output stay f32, and no T x T matrix is written.
// The kernels read bf16 copies of qkv and dout (rounded to nearest even by `to_bf16` before the
// launch), staged in shared memory 16 bytes a thread, FA_TILE rows at a time. Each warp owns 16
// rows of its block (queries in the forward and the dq pass, keys in the dk/dv pass); the other
// side streams through shared memory. Shared rows are FA_PAD bf16 wide (144 bytes), so the
// eight rows that a fragment load or an `ldmatrix` touches fall in distinct banks; operands
// needed transposed are read with `ldmatrix.trans`, never stored twice. The backward is two
// passes, as the SIMT kernels': dq and delta per query block, then dk and dv per key block, so
// no value is summed with atomics and the result depends only on the shape. Needs sm_80 or
// newer (the host picks these kernels only there); older targets compile empty bodies.
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

// Four 8 x 8 bf16 matrices from shared memory, transposed: lane l gives the address of row
// l % 8 of matrix l / 8; r[m] receives matrix m in the B-fragment layout.
__device__ __forceinline__ void ldmatrix_x4_trans(u32* r, const bf16_bits* row) {
    u32 address = (u32)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
}

// Rows [r0, r0 + rows) of the FA_D-wide slice at `column` of a row-major bf16 [.., stride]
// tensor, rows at or past `seq` as zeros, into `tile`: 16 bytes a load.
__device__ __forceinline__ void fa_stage(bf16_bits (*tile)[FA_PAD], int rows, const bf16_bits* base, u64 r0, u64 seq,
                                         u64 stride, u64 column) {
    for (int e = threadIdx.x; e < rows * (FA_D / 8); e += blockDim.x) {
        int r = e / (FA_D / 8), f = (e % (FA_D / 8)) * 8;
        u64 row = r0 + r;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (row < seq) v = *(const uint4*)(base + row * stride + column + f);
        *(uint4*)&tile[r][f] = v;
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

// acc[n] (16 x 8 f32, n < NB) = a (16 x FA_D) times the transpose of tile rows
// [row0, row0 + 8 NB): column n * 8 + j of the result is tile row row0 + n * 8 + j.
template <int NB>
__device__ __forceinline__ void fa_times_rows(float (*acc)[4], const u32 (*a)[4], const bf16_bits (*tile)[FA_PAD],
                                              int row0) {
    int g = (threadIdx.x % 32) >> 2, c = threadIdx.x & 3;
#pragma unroll
    for (int n = 0; n < NB; ++n) {
        acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
        const bf16_bits* row = tile[row0 + n * 8 + g];
#pragma unroll
        for (int kk = 0; kk < FA_D / 16; ++kk)
            mma_bf16(acc[n], a[kk], shared_pair(row + kk * 16 + 2 * c), shared_pair(row + kk * 16 + 8 + 2 * c));
    }
}

// acc[n] (16 x 8, n < FA_D / 8 feature blocks) += p (16 x 16 KB, f32 accumulator layout of
// 2 KB column blocks, rounded to bf16 here) times tile rows [row0, row0 + 16 KB) (row-major,
// read transposed by ldmatrix).
template <int KB>
__device__ __forceinline__ void fa_accumulate(float (*acc)[4], const float (*p)[4], const bf16_bits (*tile)[FA_PAD],
                                              int row0) {
    int lane = threadIdx.x % 32;
#pragma unroll
    for (int kk = 0; kk < KB; ++kk) {
        u32 a[4] = {pack_bf16(p[2 * kk][0], p[2 * kk][1]), pack_bf16(p[2 * kk][2], p[2 * kk][3]),
                    pack_bf16(p[2 * kk + 1][0], p[2 * kk + 1][1]), pack_bf16(p[2 * kk + 1][2], p[2 * kk + 1][3])};
        // Lanes 0-15 address rows row0 + 16 kk + 0..15 at feature block n, lanes 16-31 the
        // same rows at block n + 1: b0, b1 of block n, then of block n + 1.
        const bf16_bits* row = tile[row0 + kk * 16 + (lane & 15)] + (lane >> 4) * 8;
#pragma unroll
        for (int n = 0; n < FA_D / 8; n += 2) {
            u32 b[4];
            ldmatrix_x4_trans(b, row + n * 8);
            mma_bf16(acc[n], a, b[0], b[1]);
            mma_bf16(acc[n + 1], a, b[2], b[3]);
        }
    }
}
#endif

extern "C" __global__ void __launch_bounds__(FA_FORWARD_WARPS * 32)
    attention_mma_64(const bf16_bits* qkv, const float* starts, float* out, float* lse, u64 seq, u64 heads, u64 width,
                     float scale) {
#if __CUDA_ARCH__ >= 800
    __shared__ __align__(16) bf16_bits qs[FA_FORWARD_WARPS * 16][FA_PAD];
    __shared__ __align__(16) bf16_bits ks[FA_TILE][FA_PAD];
    __shared__ __align__(16) bf16_bits vs[FA_TILE][FA_PAD];
    const int rows = FA_FORWARD_WARPS * 16;
    u64 bh = blockIdx.y, b = bh / heads, h = bh % heads;
    // The longest rows (most keys) start first.
    u64 q0 = (u64)(gridDim.x - 1 - blockIdx.x) * rows;
    u64 stride = 3 * width;
    const bf16_bits* base = qkv + b * seq * stride;
    int warp = threadIdx.x / 32, g = (threadIdx.x % 32) >> 2, c = threadIdx.x & 3;
    int first = warp * 16;
    u64 first_key = block_first_key(starts, b, seq, q0, rows);
    fa_stage(qs, rows, base, q0, seq, stride, h * FA_D);
    __syncthreads();
    u32 qf[FA_D / 16][4];
    fa_row_fragments(qf, qs, first);
    float o[FA_D / 8][4];
#pragma unroll
    for (int n = 0; n < FA_D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m[2] = {neg_infinity(), neg_infinity()}, l[2] = {0.0f, 0.0f};
    u64 row[2] = {q0 + first + g, q0 + first + g + 8};
    u64 start[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) start[r] = row[r] < seq ? document_start(starts, b * seq + row[r]) : 0;
    float to_log2 = scale * LOG2_E;
    u64 last = q0 + rows - 1 < seq - 1 ? q0 + rows - 1 : seq - 1;
    for (u64 k0 = first_key / FA_TILE * FA_TILE; k0 <= last; k0 += FA_TILE) {
        __syncthreads();
        fa_stage(ks, FA_TILE, base, k0, seq, stride, width + h * FA_D);
        fa_stage(vs, FA_TILE, base, k0, seq, stride, 2 * width + h * FA_D);
        __syncthreads();
        // Every key of this tile comes after every row of this warp.
        if (k0 > q0 + first + 15) continue;
        float s[FA_TILE / 8][4];
        fa_times_rows<FA_TILE / 8>(s, qf, ks, 0);
        float top[2] = {m[0], m[1]};
#pragma unroll
        for (int n = 0; n < FA_TILE / 8; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                u64 key = k0 + n * 8 + 2 * c + (i & 1);
                int r = i >> 1;
                float v = key > row[r] || key < start[r] ? neg_infinity() : s[n][i] * to_log2;
                s[n][i] = v;
                top[r] = fmaxf(top[r], v);
            }
        // With packed documents a row may have seen no key yet (every key so far before its
        // document's start): its maximum is still -inf, and exponents are taken against 0
        // instead, so that its weights are 0, not exp2(-inf + inf).
        float correction[2], partial[2] = {0.0f, 0.0f}, pivot[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            top[r] = fmaxf(top[r], __shfl_xor_sync(FULL_MASK, top[r], 1));
            top[r] = fmaxf(top[r], __shfl_xor_sync(FULL_MASK, top[r], 2));
            pivot[r] = top[r] == neg_infinity() ? 0.0f : top[r];
            correction[r] = exp2f(m[r] - pivot[r]);
            m[r] = top[r];
        }
#pragma unroll
        for (int n = 0; n < FA_TILE / 8; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                float p = exp2f(s[n][i] - pivot[i >> 1]);
                s[n][i] = p;
                partial[i >> 1] += p;
            }
#pragma unroll
        for (int r = 0; r < 2; ++r) l[r] = l[r] * correction[r] + partial[r];
#pragma unroll
        for (int n = 0; n < FA_D / 8; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) o[n][i] *= correction[i >> 1];
        fa_accumulate<FA_TILE / 16>(o, s, vs, 0);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(FULL_MASK, l[r], 1);
        l[r] += __shfl_xor_sync(FULL_MASK, l[r], 2);
    }
#pragma unroll
    for (int n = 0; n < FA_D / 8; ++n)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            u64 t = row[r];
            if (t < seq)
                *(float2*)&out[(b * seq + t) * width + h * FA_D + n * 8 + 2 * c] =
                    make_float2(o[n][2 * r] / l[r], o[n][2 * r + 1] / l[r]);
        }
    if (c == 0)
#pragma unroll
        for (int r = 0; r < 2; ++r)
            if (row[r] < seq) lse[bh * seq + row[r]] = (m[r] + log2f(l[r])) * LN_2;
#endif
}

// Per query row t: delta_t = dout_t . out_t (f32) and dq_t = scale * sum_{s<=t} P_ts (dP_ts - delta_t) k_s.
extern "C" __global__ void __launch_bounds__(FA_BACKWARD_WARPS * 32)
    attention_backward_queries_mma_64(const bf16_bits* qkv, const float* starts, const float* out, const float* lse,
                                      const float* dout, const bf16_bits* dout16, float* dqkv, float* delta,
                                      u64 seq, u64 heads, u64 width, float scale) {
#if __CUDA_ARCH__ >= 800
    __shared__ __align__(16) bf16_bits ks[FA_TILE][FA_PAD];
    __shared__ __align__(16) bf16_bits vs[FA_TILE][FA_PAD];
    const int rows = FA_BACKWARD_WARPS * 16;
    u64 bh = blockIdx.y, b = bh / heads, h = bh % heads;
    u64 q0 = (u64)(gridDim.x - 1 - blockIdx.x) * rows;
    u64 stride = 3 * width;
    const bf16_bits* base = qkv + b * seq * stride;
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane >> 2, c = lane & 3;
    int first = warp * 16;
    u64 first_key = block_first_key(starts, b, seq, q0, rows);
    // Q and dO fragments, staged through the key tiles' memory.
    fa_stage(ks, rows, base, q0, seq, stride, h * FA_D);
    fa_stage(vs, rows, dout16 + b * seq * width, q0, seq, width, h * FA_D);
    __syncthreads();
    u32 qf[FA_D / 16][4], gf[FA_D / 16][4];
    fa_row_fragments(qf, ks, first);
    fa_row_fragments(gf, vs, first);
    // delta of the warp's 16 rows in f32 from the f32 tensors: a row's 64 products, two a
    // lane, summed by the warp's butterfly; then each lane keeps its two rows' values.
    float dt[2] = {0.0f, 0.0f}, lse2[2] = {0.0f, 0.0f};
    u64 row[2] = {q0 + first + g, q0 + first + g + 8};
    for (int r = 0; r < 16; ++r) {
        u64 t = q0 + first + r;
        float d = 0.0f;
        if (t < seq) {
            u64 at = (b * seq + t) * width + h * FA_D + 2 * lane;
            d = dout[at] * out[at] + dout[at + 1] * out[at + 1];
        }
        d = warp_sum(d);
        if (t < seq && lane == 0) delta[bh * seq + t] = d;
        if (r == g) dt[0] = d;
        if (r == g + 8) dt[1] = d;
    }
    u64 start[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        lse2[r] = row[r] < seq ? lse[bh * seq + row[r]] * LOG2_E : 0.0f;
        start[r] = row[r] < seq ? document_start(starts, b * seq + row[r]) : 0;
    }
    float dq[FA_D / 8][4];
#pragma unroll
    for (int n = 0; n < FA_D / 8; ++n) dq[n][0] = dq[n][1] = dq[n][2] = dq[n][3] = 0.0f;
    float to_log2 = scale * LOG2_E;
    u64 last = q0 + rows - 1 < seq - 1 ? q0 + rows - 1 : seq - 1;
    for (u64 k0 = first_key / FA_TILE * FA_TILE; k0 <= last; k0 += FA_TILE) {
        __syncthreads();
        fa_stage(ks, FA_TILE, base, k0, seq, stride, width + h * FA_D);
        fa_stage(vs, FA_TILE, base, k0, seq, stride, 2 * width + h * FA_D);
        __syncthreads();
        if (k0 > q0 + first + 15) continue;
        float s[FA_TILE / 8][4], dp[FA_TILE / 8][4];
        fa_times_rows<FA_TILE / 8>(s, qf, ks, 0);
        fa_times_rows<FA_TILE / 8>(dp, gf, vs, 0);
#pragma unroll
        for (int n = 0; n < FA_TILE / 8; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                u64 key = k0 + n * 8 + 2 * c + (i & 1);
                int r = i >> 1;
                float p = key > row[r] || key < start[r] ? 0.0f : exp2f(s[n][i] * to_log2 - lse2[r]);
                s[n][i] = p * (dp[n][i] - dt[r]) * scale;
            }
        fa_accumulate<FA_TILE / 16>(dq, s, ks, 0);
    }
#pragma unroll
    for (int n = 0; n < FA_D / 8; ++n)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            u64 t = row[r];
            if (t < seq)
                *(float2*)&dqkv[(b * seq + t) * stride + h * FA_D + n * 8 + 2 * c] =
                    make_float2(dq[n][2 * r], dq[n][2 * r + 1]);
        }
#endif
}

// Per key row s: dk_s = scale * sum_{t>=s} P_ts (dP_ts - delta_t) q_t and dv_s = sum_{t>=s} P_ts dout_t,
// each query tile taken in two halves of FA_TILE / 2 queries (fewer live registers).
extern "C" __global__ void __launch_bounds__(FA_BACKWARD_WARPS * 32, 3)
    attention_backward_keys_mma_64(const bf16_bits* qkv, const float* starts, const float* lse, const bf16_bits* dout16,
                                   const float* delta, float* dqkv, u64 seq, u64 heads, u64 width, float scale) {
#if __CUDA_ARCH__ >= 800
    __shared__ __align__(16) bf16_bits qs[FA_TILE][FA_PAD];
    __shared__ __align__(16) bf16_bits gs[FA_TILE][FA_PAD];
    __shared__ float col_lse[FA_TILE];
    __shared__ float col_delta[FA_TILE];
    __shared__ u32 col_start[FA_TILE];
    const int rows = FA_BACKWARD_WARPS * 16;
    const int half = FA_TILE / 2;
    u64 bh = blockIdx.y, b = bh / heads, h = bh % heads;
    // The first keys see the most queries and start first.
    u64 k0 = (u64)blockIdx.x * rows;
    u64 stride = 3 * width;
    const bf16_bits* base = qkv + b * seq * stride;
    const bf16_bits* dbase = dout16 + b * seq * width;
    int warp = threadIdx.x / 32, g = (threadIdx.x % 32) >> 2, c = threadIdx.x & 3;
    int first = warp * 16;
    fa_stage(qs, rows, base, k0, seq, stride, width + h * FA_D);
    fa_stage(gs, rows, base, k0, seq, stride, 2 * width + h * FA_D);
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
    // The block's last key: a query tile whose first query starts its document past it (and so
    // every later one) sees none of the block's keys.
    u64 last_key = k0 + rows - 1;
    if (last_key >= seq) last_key = seq - 1;
    for (u64 t0 = k0; t0 < seq; t0 += FA_TILE) {
        if (document_start(starts, b * seq + t0) > last_key) break;
        __syncthreads();
        fa_stage(qs, FA_TILE, base, t0, seq, stride, h * FA_D);
        fa_stage(gs, FA_TILE, dbase, t0, seq, width, h * FA_D);
        for (int j = threadIdx.x; j < FA_TILE; j += blockDim.x) {
            u64 t = t0 + j;
            // A query past the end contributes nothing: its probability is exp2(-inf) = 0.
            col_lse[j] = t < seq ? lse[bh * seq + t] * LOG2_E : __int_as_float(0x7f800000);
            col_delta[j] = t < seq ? delta[bh * seq + t] : 0.0f;
            col_start[j] = t < seq ? (u32)document_start(starts, b * seq + t) : 0u;
        }
        __syncthreads();
#pragma unroll 1
        for (int part = 0; part < FA_TILE; part += half) {
            float p[half / 8][4], ds[half / 8][4];
            fa_times_rows<half / 8>(p, kf, qs, part);
            fa_times_rows<half / 8>(ds, vf, gs, part);
#pragma unroll
            for (int n = 0; n < half / 8; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    int j = part + n * 8 + 2 * c + (i & 1);
                    u64 t = t0 + j;
                    // Before the key, or a query of a later document: no weight.
                    u64 k = key[i >> 1];
                    float pv = t < k || col_start[j] > k ? 0.0f : exp2f(p[n][i] * to_log2 - col_lse[j]);
                    p[n][i] = pv;
                    ds[n][i] = pv * (ds[n][i] - col_delta[j]) * scale;
                }
            fa_accumulate<half / 16>(dv, p, gs, part);
            fa_accumulate<half / 16>(dk, ds, qs, part);
        }
    }
#pragma unroll
    for (int n = 0; n < FA_D / 8; ++n)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            u64 s = key[r];
            if (s < seq) {
                u64 at = (b * seq + s) * stride + h * FA_D + n * 8 + 2 * c;
                *(float2*)&dqkv[at + width] = make_float2(dk[n][2 * r], dk[n][2 * r + 1]);
                *(float2*)&dqkv[at + 2 * width] = make_float2(dv[n][2 * r], dv[n][2 * r + 1]);
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

// One element's Adam/AdamW update: the per-tensor kernel and the multi-tensor one share it, so
// both give the same bits.
__device__ __forceinline__ void adam_element(float* w, const float* g, float* m, float* v, u64 i, float lr,
                                             float beta1, float beta2, float eps, float weight_decay,
                                             int decoupled, float bias_correction1, float bias_correction2) {
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

extern "C" __global__ void adam_f32(float* w, const float* g, float* m, float* v, u64 n, float lr, float beta1,
                                    float beta2, float eps, float weight_decay, int decoupled,
                                    float bias_correction1, float bias_correction2) {
    for (u64 i = global_index(); i < n; i += global_stride()) {
        adam_element(w, g, m, v, i, lr, beta1, beta2, eps, weight_decay, decoupled, bias_correction1,
                     bias_correction2);
    }
}

// Multi-tensor Adam/AdamW: one launch updates up to ADAM_GROUP tensors that share every
// hyperparameter but their weight decay. The group travels by value as the kernel's argument (under
// the 4 KiB every driver takes), so nothing is uploaded and nothing waits. Tensor k owns blocks
// first_block[k] .. first_block[k + 1] (ascending), each of ADAM_CHUNK elements; a block finds its
// tensor by a scan of the group. The layout matches `AdamGroupArg` in device.rs.
#define ADAM_GROUP 64
#define ADAM_CHUNK 4096
struct AdamTensor {
    float* w;
    const float* g;
    float* m;
    float* v;
    u64 n;
    float weight_decay;
    u32 first_block;
};
struct AdamGroup {
    AdamTensor t[ADAM_GROUP];
    u32 count;
    float lr, beta1, beta2, eps, bias_correction1, bias_correction2;
    int decoupled;
};
static_assert(sizeof(AdamTensor) == 48, "AdamTensor's layout is device.rs's AdamTensorArg");
static_assert(sizeof(AdamGroup) == 3104, "AdamGroup's layout is device.rs's AdamGroupArg");

extern "C" __global__ void adam_group_f32(const AdamGroup group) {
    u32 block = blockIdx.x, k = 0;
    while (k + 1 < group.count && group.t[k + 1].first_block <= block) k++;
    float* w = group.t[k].w;
    const float* g = group.t[k].g;
    float* m = group.t[k].m;
    float* v = group.t[k].v;
    u64 start = (u64)(block - group.t[k].first_block) * ADAM_CHUNK;
    u64 end = start + ADAM_CHUNK < group.t[k].n ? start + ADAM_CHUNK : group.t[k].n;
    float weight_decay = group.t[k].weight_decay;
    for (u64 i = start + threadIdx.x; i < end; i += blockDim.x) {
        adam_element(w, g, m, v, i, group.lr, group.beta1, group.beta2, group.eps, weight_decay, group.decoupled,
                     group.bias_correction1, group.bias_correction2);
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
