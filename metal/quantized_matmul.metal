//// [header]
// Small-M quantized matmul for verify forwards: y = x @ dequantize(w)^T for the 2..32 token rows
// a verify carries, over MLX's affine quantization (nn.QuantizedLinear's w, scales, biases).
//
// Each threadgroup (4 simdgroups, 128 threads) owns BN = 32 output columns and walks K (or its
// split of K) in BK = 32 steps: it dequantizes the 32 x 32 weight tile once into threadgroup
// memory, stages the rows' 32 x BK activations beside it (both as float), and each simdgroup
// multiplies its 8 columns for every block of 8 rows with 8x8 simdgroup matrices, accumulating
// in float. So every weight is read and dequantized once per call, whatever M is. With a K
// split (grid z > 1) each split writes float partial sums that the host adds.
//
// Weights: `bits` (2..8) per value, packed as MLX packs them: a little-endian bit stream of
// uint32 words per output row, value k at bits [k * bits, (k + 1) * bits); value =
// scale * q + bias, with one (scale, bias) per `group` consecutive k. K is a multiple of the
// group (MLX requires it), so of BK too; N may be anything.

constant constexpr int QMM_BN = 32;
constant constexpr int QMM_BK = 32;
constant constexpr int QMM_THREADS = 128;

template <int BITS>
inline uint qmm_value(const device uint32_t* row, int k) {
  const uint bit = uint(k) * uint(BITS);
  const uint word = bit / 32u;
  const uint shift = bit % 32u;
  uint v = row[word] >> shift;
  if (shift + uint(BITS) > 32u) {
    v |= row[word + 1u] << (32u - shift);
  }
  return v & ((1u << uint(BITS)) - 1u);
}

//// [kernel qmm_small_m]
// params: M, N, K, k_per_split (a multiple of QMM_BK)
const int M = params[0];
const int N = params[1];
const int K = params[2];
const int k_split = params[3];
const int n0 = int(threadgroup_position_in_grid.x) * QMM_BN;
const int split = int(threadgroup_position_in_grid.z);
const int k_begin = split * k_split;
const int k_end = min(K, k_begin + k_split);
const int tid = int(thread_index_in_threadgroup);
const int sg = int(simdgroup_index_in_threadgroup);
const int words_per_row = K * BITS / 32;
const int groups_per_row = K / GROUP;

threadgroup float xs[QMM_BN * QMM_BK];  // rows x BK activations (32 rows at most)
threadgroup float ws[QMM_BN * QMM_BK];  // BN output columns x BK, dequantized

// RB (template): blocks of 8 rows, M <= 8 * RB, so the accumulators stay in registers.
simdgroup_matrix<float, 8, 8> acc[RB];
for (int rb = 0; rb < RB; ++rb) {
  acc[rb] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
}

// Each thread dequantizes 8 consecutive k of one column: 32 columns x 4 chunks = 128.
const int wn = tid / 4;
const int wk = (tid % 4) * 8;
const bool w_live = n0 + wn < N;
const device uint32_t* w_row = w + (w_live ? (n0 + wn) : 0) * words_per_row;
const device S* s_row = scales + (w_live ? (n0 + wn) : 0) * groups_per_row;
const device S* b_row = biases + (w_live ? (n0 + wn) : 0) * groups_per_row;

for (int k0 = k_begin; k0 < k_end; k0 += QMM_BK) {
  for (int i = tid; i < RB * 8 * QMM_BK; i += QMM_THREADS) {
    const int r = i / QMM_BK;
    const int c = i % QMM_BK;
    xs[i] = r < M ? float(x[r * K + k0 + c]) : 0.0f;
  }
  if (w_live) {
    const int g = (k0 + wk) / GROUP;  // 8 values never straddle a group (GROUP >= 32)
    const float scale = float(s_row[g]);
    const float bias = float(b_row[g]);
    for (int j = 0; j < 8; ++j) {
      ws[wn * QMM_BK + wk + j] = scale * float(qmm_value<BITS>(w_row, k0 + wk + j)) + bias;
    }
  } else {
    for (int j = 0; j < 8; ++j) {
      ws[wn * QMM_BK + wk + j] = 0.0f;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int kk = 0; kk < QMM_BK; kk += 8) {
    simdgroup_matrix<float, 8, 8> b;
    // b[i][j] = ws[column sg * 8 + j][kk + i]: this simdgroup's 8 columns, transposed.
    simdgroup_load(b, ws + sg * 8 * QMM_BK + kk, QMM_BK, ulong2(0, 0), true);
    for (int rb = 0; rb < RB; ++rb) {
      simdgroup_matrix<float, 8, 8> a;
      simdgroup_load(a, xs + rb * 8 * QMM_BK + kk, QMM_BK);
      simdgroup_multiply_accumulate(acc[rb], a, b, acc[rb]);
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

// Out through threadgroup memory (xs, free now): rows x BN, then each thread writes columns.
for (int rb = 0; rb < RB; ++rb) {
  simdgroup_store(acc[rb], xs + rb * 8 * QMM_BN + sg * 8, QMM_BN);
}
threadgroup_barrier(mem_flags::mem_threadgroup);
device O* out = y + split * M * N;
for (int i = tid; i < M * QMM_BN; i += QMM_THREADS) {
  const int r = i / QMM_BN;
  const int c = i % QMM_BN;
  if (n0 + c < N) {
    out[r * N + n0 + c] = static_cast<O>(xs[r * QMM_BN + c]);
  }
}
