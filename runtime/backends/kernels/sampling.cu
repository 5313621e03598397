// On-device logit processing, sampling and speculative verification.
//
// The host reference is the specification: runtime/sampling.py (process_logits, sample) and
// runtime/speculative.py (verify_greedy, verify_sampled); docs/design.md#the-speculative-step.
// Compiled at run time by NVRTC (runtime/device_sampling.py), so this file uses nothing but
// NVRTC's built-ins: no headers, no CUB. Block reductions and scans are written out below.
//
// Layout: row-major float32 rows of `vocab` entries, int32 token ids. Every kernel runs
// blocks of SPECEDGE_THREADS threads (a multiple of 32: the warp shuffles use full masks).
// Sums of probabilities are accumulated in double, so that a threshold test such as
// "mass above < top_p" sees float32 rounding of the terms only, not of a 128k-term sum.

#define SPECEDGE_THREADS 1024
#define FULL_MASK 0xffffffffu

typedef unsigned int u32;
typedef unsigned long long u64;

// Order-preserving images of float bit patterns (see ord_key).
#define KEY_NEG_INF 0x007fffffu  // ord_key(-inf)
#define KEY_POS_INF 0xff800000u  // ord_key(+inf)
#define KEY_NAN 0xffffffffu      // what argmax-style reductions map every NaN to

__device__ __forceinline__ float neg_inf() { return __uint_as_float(0xff800000u); }

// Monotone map float -> u32: a < b (as floats, no NaN) iff ord_key(a) < ord_key(b), and
// a == b iff the keys are equal (-0 and +0 share a key). Positive floats order like their
// bit patterns, negative ones in reverse; flipping the sign bit of positives and every bit
// of negatives puts both on one unsigned scale. A bisection over keys therefore finds an
// exact float threshold in at most 32 halvings, with no sort.
__device__ __forceinline__ u32 ord_key(float f) {
    u32 b = __float_as_uint(f);
    if (f == 0.0f) b = 0u;
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

struct SumOp {
    template <class T> __device__ T operator()(T a, T b) const { return a + b; }
};
struct MaxOp {
    template <class T> __device__ T operator()(T a, T b) const { return a > b ? a : b; }
};
struct MinOp {
    template <class T> __device__ T operator()(T a, T b) const { return a < b ? a : b; }
};

// Reduce one value per thread over the block; every thread gets the result. `scratch`
// is __shared__ storage of at least 32 elements of T. The leading barrier keeps a call
// from overwriting scratch[0] while threads still read the previous call's result.
template <class T, class Op>
__device__ T block_reduce(T v, Op op, T identity, T* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    for (int off = 16; off > 0; off >>= 1) v = op(v, __shfl_down_sync(FULL_MASK, v, off));
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < nwarps ? scratch[lane] : identity;
        for (int off = 16; off > 0; off >>= 1) v = op(v, __shfl_down_sync(FULL_MASK, v, off));
        if (lane == 0) scratch[0] = v;
    }
    __syncthreads();
    return scratch[0];
}

// Inclusive prefix sum over the block (thread order); also returns the exclusive sum.
// `scratch` holds at least 32 doubles. Warp scans by shuffles, then a scan of warp totals.
__device__ double block_scan(double v, double* excl, double* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    for (int d = 1; d < 32; d <<= 1) {
        const double n = __shfl_up_sync(FULL_MASK, v, d);
        if (lane >= d) v += n;
    }
    double before = __shfl_up_sync(FULL_MASK, v, 1);
    if (lane == 0) before = 0.0;
    __syncthreads();
    if (lane == 31) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        double w = lane < nwarps ? scratch[lane] : 0.0;
        for (int d = 1; d < 32; d <<= 1) {
            const double n = __shfl_up_sync(FULL_MASK, w, d);
            if (lane >= d) w += n;
        }
        scratch[lane] = w;  // every lane read its slot before the shuffles above
    }
    __syncthreads();
    const double offset = warp > 0 ? scratch[warp - 1] : 0.0;
    *excl = offset + before;
    return offset + v;
}

// Weight functions for the inverse CDF: the (unnormalised) distribution to draw from.
struct RowWeight {  // p itself (sample_rows, the bonus token)
    const float* p;
    __device__ double operator()(int j) const { return (double)p[j]; }
};
// max(0, p - q): speculative.residual, docs/design.md#the-speculative-step step 3
struct ResidualWeight {
    const float* p;
    const float* q;
    __device__ double operator()(int j) const {
        const double d = (double)p[j] - (double)q[j];
        return d > 0.0 ? d : 0.0;
    }
};
// max(0, p - onehot(x)) = p with x removed: docs/design.md#the-speculative-step step 6
struct OneHotResidualWeight {
    const float* p;
    int x;
    __device__ double operator()(int j) const { return j == x ? 0.0 : (double)p[j]; }
};

// Inverse-CDF draw from the weights w_0..w_{V-1} with one uniform u in [0, 1), as
// sampling.sample: with c_j = sum_{i <= j} w_i and t = u * c_{V-1}, return the first j with
// c_j > t. Token j owns [c_{j-1}, c_j), of length w_j, so a zero-weight token is never
// drawn. Returns -1 when the total is not positive and finite (the caller reports it).
//
// Each thread owns one contiguous chunk. The chunk sums are scanned; the owner of t is the
// first thread with a positive chunk whose inclusive prefix exceeds t (a block min, so it
// is unique even where rounding makes neighbouring prefixes disagree), and it walks its
// chunk. If rounding lets t slip past the chunk's running sum, the owner takes its last
// positive token: never a zero-weight one.
template <class W>
__device__ int block_inverse_cdf(const W& weight, int vocab, double u, u64* scratch) {
    __shared__ int picked;
    const int chunk = (vocab + (int)blockDim.x - 1) / (int)blockDim.x;
    const int begin = min(vocab, (int)threadIdx.x * chunk);
    const int end = min(vocab, begin + chunk);
    double own = 0.0;
    for (int j = begin; j < end; ++j) own += weight(j);
    double excl;
    const double incl = block_scan(own, &excl, (double*)scratch);
    const double total = block_reduce(incl, MaxOp(), 0.0, (double*)scratch);
    if (!(total > 0.0 && total <= 1.7976931348623157e308)) return -1;  // also catches NaN
    const double t = u * total;
    int owner = block_reduce(own > 0.0 && incl > t ? (int)threadIdx.x : 0x7fffffff, MinOp(),
                             0x7fffffff, (int*)scratch);
    if (owner == 0x7fffffff)  // t >= every prefix (rounding at the top): last positive chunk
        owner = block_reduce(own > 0.0 ? (int)threadIdx.x : -1, MaxOp(), -1, (int*)scratch);
    if ((int)threadIdx.x == owner) {
        int pick = -1, last = -1;
        double c = excl;
        for (int j = begin; j < end; ++j) {
            const double w = weight(j);
            if (w > 0.0) {
                last = j;
                c += w;
                if (c > t) {
                    pick = j;
                    break;
                }
            }
        }
        picked = pick >= 0 ? pick : last;
    }
    __syncthreads();
    return picked;
}

// process_rows: sampling.process_logits on device, one block per row.
//
// HF warper order (docs/design.md#notation): with m = max l,
//   1. temperature:  z = (l - m) / T      (shift first: z <= 0 never overflows)
//   2. top-k:        drop l < kth_largest(l), ties at the k-th value kept
//   3. top-p:        rank tokens by l, ties: higher token id first (a reversed stable
//                    ascending sort); e(j) = mass of the tokens ranked strictly above j;
//                    keep j iff e(j) < top_p, and always keep the top-ranked token
//   4. softmax over the survivors; everything else is exactly 0.
// The rankings in 2 and 3 use the raw logits l: z is a monotone function of l, and the
// float32 division could merge distinct logits into new ties that the float64 host does
// not see. -inf logits stay masked. A row with a NaN, a +inf or no finite logit (the host
// raises ValueError) is written as all NaN; sample_rows then reports it as unusable.
//
// top_p is a double because it is compared with double sums (a float32 0.9 is 2.4e-8 off).
extern "C" __global__ void __launch_bounds__(SPECEDGE_THREADS)
process_rows(const float* logits, int rows, int vocab, float temperature, int top_k,
             double top_p, float* probs) {
    __shared__ u64 scratch[64];
    __shared__ int tie_cut;
    const int row = blockIdx.x;
    if (row >= rows) return;
    const float* l = logits + (size_t)row * vocab;
    float* w = probs + (size_t)row * vocab;  // holds the weights exp(z) until the last pass

    // Rank-0 token: the largest key, ties to the highest id (the head of the reversed
    // stable order). NaN maps above +inf so that one reduction also finds bad rows.
    u64 best = 0;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
        const float x = l[j];
        const u64 key = x != x ? KEY_NAN : ord_key(x);
        const u64 packed = (key << 32) | (u32)j;
        best = best > packed ? best : packed;
    }
    best = block_reduce(best, MaxOp(), (u64)0, scratch);
    const u32 key_max = (u32)(best >> 32);
    const int top = (int)(u32)best;
    if (key_max >= KEY_POS_INF || key_max <= KEY_NEG_INF) {  // NaN, +inf, or all -inf
        const float nan = __uint_as_float(0x7fc00000u);
        for (int j = threadIdx.x; j < vocab; j += blockDim.x) w[j] = nan;
        return;
    }
    const float m = l[top];

    // Top-k: the exact k-th largest logit is the largest key t with #{key >= t} >= k.
    // Invariant: count(key >= lo) >= k > count(key >= hi); every key is >= 0 and < 2^32.
    u32 kth = 0;
    if (top_k > 0 && top_k < vocab) {
        long long lo = 0, hi = 1LL << 32;
        while (hi - lo > 1) {
            const long long mid = (lo + hi) >> 1;
            int count = 0;
            for (int j = threadIdx.x; j < vocab; j += blockDim.x)
                count += ord_key(l[j]) >= (u32)mid ? 1 : 0;
            count = block_reduce(count, SumOp(), 0, (int*)scratch);
            if (count >= top_k) lo = mid; else hi = mid;
        }
        kth = (u32)lo;
    }

    // Weights of the top-k survivors, w_j = exp(z_j), and their total S (softmax numerator
    // and denominator; the rank-0 token has z = 0, w = 1, so S >= 1).
    double total = 0.0;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
        const float x = l[j];
        float wj = 0.0f;
        if (x > neg_inf() && ord_key(x) >= kth) wj = expf((x - m) / temperature);
        w[j] = wj;
        total += wj;
    }
    total = block_reduce(total, SumOp(), 0.0, (double*)scratch);

    // Top-p without a sort. In weights, keep j iff e(j) < P with P = top_p * S. e is
    // non-decreasing along the ranking, so the survivors are a prefix of it: find the
    // smallest key v with W(key > v) < P. Every token with key > v has e <= W(key > v) < P
    // (kept); a token with key < v has e >= W(key > its key) >= P (dropped), since W(key > t)
    // only changes at present keys. Among the tokens tied at v, walk in descending id order
    // and keep while W(key > v) + (mass of the higher-id ties) < P.
    // Invariant: W(key > lo) >= P > W(key > hi); lo = -1 and hi = 2^32 are virtual ends.
    // Kept: key > cut_key, or key == cut_key and id >= cut_id (the default keeps all).
    u32 cut_key = 0;
    int cut_id = 0;
    if (top_p < 1.0) {
        const double target = top_p * total;
        long long lo = -1, hi = 1LL << 32;
        double above_hi = 0.0;
        while (hi - lo > 1) {
            const long long mid = (lo + hi) >> 1;
            double above = 0.0;
            for (int j = threadIdx.x; j < vocab; j += blockDim.x)
                if (ord_key(l[j]) > (u32)mid) above += w[j];
            above = block_reduce(above, SumOp(), 0.0, (double*)scratch);
            if (above < target) {
                hi = mid;
                above_hi = above;
            } else {
                lo = mid;
            }
        }
        if (hi == (1LL << 32)) {  // P == 0 (top_p == 0): nothing passes, the argmax below
            cut_key = 0xffffffffu;
            cut_id = vocab;
        } else {
            cut_key = (u32)hi;
            int ties = 0;
            for (int j = threadIdx.x; j < vocab; j += blockDim.x)
                ties += ord_key(l[j]) == cut_key && w[j] > 0.0f ? 1 : 0;
            ties = block_reduce(ties, SumOp(), 0, (int*)scratch);
            // One tie: its e is W(key > v) < P, kept. Several (rare): a serial walk.
            if (ties > 1) {
                if (threadIdx.x == 0) {
                    double mass = above_hi;
                    int cut = vocab;
                    for (int j = vocab - 1; j >= 0; --j) {
                        if (ord_key(l[j]) != cut_key || !(w[j] > 0.0f)) continue;
                        if (!(mass < target)) break;
                        cut = j;
                        mass += w[j];
                    }
                    tie_cut = cut;
                }
                __syncthreads();
                cut_id = tie_cut;
            }
        }
    }

    // Softmax over the survivors (the rank-0 token always among them).
    double kept_total = 0.0;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
        const u32 key = ord_key(l[j]);
        if (key > cut_key || (key == cut_key && j >= cut_id) || j == top) kept_total += w[j];
    }
    kept_total = block_reduce(kept_total, SumOp(), 0.0, (double*)scratch);
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
        const u32 key = ord_key(l[j]);
        const bool kept = key > cut_key || (key == cut_key && j >= cut_id) || j == top;
        w[j] = kept ? (float)((double)w[j] / kept_total) : 0.0f;
    }
}

// argmax_verify: speculative.verify_greedy (docs/design.md#the-speculative-step step 5) in one
// block over K + 1 rows.
// Accept x_i while x_i == argmax l_i; the next token is the argmax of the first
// mismatching row, or of row K (the bonus). Argmax ties go to the lowest id and a NaN wins
// over everything (np.argmax). out = {n_accepted, next_token}; a row whose argmax is NaN
// or -inf (the host raises ValueError) gives out = {-1, first such row}.
extern "C" __global__ void __launch_bounds__(SPECEDGE_THREADS)
argmax_verify(const float* logits, int k, int vocab, const int* draft_ids, int* out) {
    __shared__ u64 scratch[64];
    int n = k, token = -1, bad = -1;
    for (int i = 0; i <= k; ++i) {  // every row, so bad rows are reported as the host does
        const float* row = logits + (size_t)i * vocab;
        u64 best = 0;
        for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
            const float x = row[j];
            const u64 key = x != x ? KEY_NAN : ord_key(x);
            const u64 packed = (key << 32) | (u32)(0xffffffffu - (u32)j);  // ties: low id
            best = best > packed ? best : packed;
        }
        best = block_reduce(best, MaxOp(), (u64)0, scratch);
        const u32 key = (u32)(best >> 32);
        const int arg = (int)(0xffffffffu - (u32)best);
        if ((key == KEY_NAN || key <= KEY_NEG_INF) && bad < 0) bad = i;
        if (n == k && i < k && arg != draft_ids[i]) {
            n = i;
            token = arg;
        } else if (n == k && i == k) {
            token = arg;
        }
    }
    if (threadIdx.x == 0) {
        out[0] = bad >= 0 ? -1 : n;
        out[1] = bad >= 0 ? bad : token;
    }
}

// sample_rows: sampling.sample for each row, one block per row, one uniform per row.
// out[r] = the drawn token, or -1 if row r has no positive finite total (a NaN row from
// process_rows included).
extern "C" __global__ void __launch_bounds__(SPECEDGE_THREADS)
sample_rows(const float* probs, int rows, int vocab, const double* uniforms, int* out) {
    __shared__ u64 scratch[64];
    const int row = blockIdx.x;
    if (row >= rows) return;
    const RowWeight weight = {probs + (size_t)row * vocab};
    const int token = block_inverse_cdf(weight, vocab, uniforms[row], scratch);
    if (threadIdx.x == 0) out[row] = token;
}

// sampled_verify: speculative.verify_sampled (docs/design.md#the-speculative-step steps 3, 4, 6)
// in one block.
//
// p: [K + 1, V] processed target probabilities; q: [K, V] draft probabilities, or null for
// a model-free draft (q_i = onehot(x_i)). Uniform layout, K + 1 doubles in [0, 1):
//   uniforms[i], i < K : acceptance test of x_i:  accept iff u_i * q_i(x_i) < p_i(x_i)
//   uniforms[K]        : the one emitted sample (residual after a rejection, or bonus)
// Only one sample is ever drawn per step, so one uniform serves whichever row it comes
// from; the draws are independent of the acceptance uniforms, which is all the proof in
// speculative.py needs. On the first rejection at i: y ~ norm(max(0, p_i - q_i)) (p_i with
// x_i removed when q is null); if that residual has no mass (p_i == q_i, where a rejection
// cannot happen in exact arithmetic) y ~ p_i, as speculative.residual. All accepted: the
// bonus y ~ p_K. out = {n_accepted, y}; {-1, -1} for a draft id outside [0, V) or a row
// with no positive finite mass.
extern "C" __global__ void __launch_bounds__(SPECEDGE_THREADS)
sampled_verify(const float* p, const float* q, int k, int vocab, const int* draft_ids,
               const double* uniforms, int* out) {
    __shared__ u64 scratch[64];
    __shared__ int accepted;
    if (threadIdx.x == 0) {  // at most K scalar tests: not worth a block
        int n = k;
        for (int i = 0; i < k; ++i) {
            const int x = draft_ids[i];
            if (x < 0 || x >= vocab) {
                n = -1;
                break;
            }
            const double p_x = p[(size_t)i * vocab + x];
            const double q_x = q ? (double)q[(size_t)i * vocab + x] : 1.0;
            if (!(uniforms[i] * q_x < p_x)) {
                n = i;
                break;
            }
        }
        accepted = n;
    }
    __syncthreads();
    const int n = accepted;
    int token = -1;
    if (n >= 0) {
        const double u = uniforms[k];
        const float* p_row = p + (size_t)n * vocab;
        if (n < k) {
            if (q) {
                const ResidualWeight weight = {p_row, q + (size_t)n * vocab};
                token = block_inverse_cdf(weight, vocab, u, scratch);
            } else {
                const OneHotResidualWeight weight = {p_row, draft_ids[n]};
                token = block_inverse_cdf(weight, vocab, u, scratch);
            }
        }
        if (token < 0) {
            const RowWeight weight = {p_row};
            token = block_inverse_cdf(weight, vocab, u, scratch);
        }
    }
    if (threadIdx.x == 0) {
        out[0] = token < 0 ? -1 : n;
        out[1] = token;
    }
}
