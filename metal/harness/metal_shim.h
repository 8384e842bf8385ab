// metal_shim.h: just enough of the Metal Shading Language to compile MLX custom-kernel
// sources (header + generated signature + body) as C++17 and run them on the CPU.
//
// Honesty rule: everything here models a Metal feature faithfully, or it is absent so that
// a kernel using it fails to compile. There are no catch-all macros. In particular:
//   * modelled: scalar types (half = _Float16, bfloat with round-to-nearest-even, uint,
//     ushort, uchar), 2/3/4-vectors with .x/.y/.z/.w and elementwise arithmetic, the
//     address-space keywords device / constant / threadgroup, threadgroup_barrier,
//     simdgroup_barrier, simd_sum / product / max / min / shuffle / shuffle_xor /
//     shuffle_up / shuffle_down / broadcast / broadcast_first / prefix sums / all / any,
//     as_type, select, and the common metal:: (plus metal::fast::, metal::precise::) math.
//   * modelled too: 8x8 simdgroup matrices (simdgroup_load / store with a row stride, an
//     origin and transposition, simdgroup_multiply_accumulate, make_filled_simdgroup_matrix,
//     thread_elements), each lane holding the two elements Apple GPUs give it; a load, store
//     or multiply is a collective of the simdgroup, as on the GPU.
//   * refused (compile error): double, the `thread` address-space keyword, atomics,
//     simdgroup matrices of other shapes, quad_* functions, vector swizzles, vector
//     comparisons, simd_* on vectors or bfloat, printf and the C++ library, MLX utils.h helpers such as Limits<>,
//     and unknown [[attributes]] (compiled with -Werror=attributes).
//   * not detected: address-space mismatches (device/constant/threadgroup are erased, so
//     passing a constant pointer where a device pointer is expected compiles here),
//     threadgroup memory beyond the 32 KiB limit, data races between threadgroups, reads of
//     threadgroup memory nobody wrote (it starts zeroed per worker thread).
//   * approximate: chains of half arithmetic may keep float precision between operations
//     (the compiler's excess precision for _Float16); simd_sum adds lanes in a fixed pairwise
//     order, which need not be the GPU's.
#pragma once

#include "mshim_abi.h"

// ---------------------------------------------------------------------------------------
// Address spaces. Buffers are plain pointers; threadgroup variables live once per OS worker
// thread, and all threads (fibers) of one threadgroup run on the same worker, so
// `static thread_local` gives exactly one shared copy per running threadgroup.
#define device
#define constant
#define threadgroup static thread_local

// Metal has no double; unsuffixed literals are float there (-fsingle-precision-constant).
#define double mshim_double_is_not_available_in_metal

// ---------------------------------------------------------------------------------------
// Scalar types.
typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef uint64_t ulong;
typedef _Float16 half;

namespace mshim {

inline uint32_t f32_bits(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  return u;
}

inline float bits_f32(uint32_t u) {
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}

}  // namespace mshim

// Metal's bfloat: converts to float exactly, from float with round-to-nearest-even.
struct bfloat {
  uint16_t bits;
  bfloat() = default;
  bfloat(float f) {  // NOLINT: implicit, as in Metal
    uint32_t u = mshim::f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      bits = static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN, sign kept
    } else {
      u += 0x7fffu + ((u >> 16) & 1u);
      bits = static_cast<uint16_t>(u >> 16);
    }
  }
  bfloat(half h) : bfloat(static_cast<float>(h)) {}
  bfloat(int i) : bfloat(static_cast<float>(i)) {}
  bfloat(uint i) : bfloat(static_cast<float>(i)) {}
  operator float() const { return mshim::bits_f32(static_cast<uint32_t>(bits) << 16); }
};

// bfloat arithmetic: computed in float and rounded once (RNE), which is what a correctly
// rounded bfloat ALU returns; mixing with float promotes to float, as in Metal.
#define MSHIM_BF16_OP(OP)                                                                  \
  inline bfloat operator OP(bfloat a, bfloat b) { return bfloat(float(a) OP float(b)); }   \
  inline bfloat operator OP(bfloat a, int b) { return bfloat(float(a) OP float(b)); }      \
  inline bfloat operator OP(int a, bfloat b) { return bfloat(float(a) OP float(b)); }      \
  inline float operator OP(bfloat a, float b) { return float(a) OP b; }                   \
  inline float operator OP(float a, bfloat b) { return a OP float(b); }                   \
  inline bfloat& operator OP##=(bfloat& a, bfloat b) { return a = a OP b; }                \
  inline bfloat& operator OP##=(bfloat& a, float b) { return a = bfloat(float(a) OP b); }
MSHIM_BF16_OP(+)
MSHIM_BF16_OP(-)
MSHIM_BF16_OP(*)
MSHIM_BF16_OP(/)
#undef MSHIM_BF16_OP
inline bfloat operator-(bfloat a) {
  bfloat r;
  r.bits = static_cast<uint16_t>(a.bits ^ 0x8000u);
  return r;
}

// Names MLX's utils.h puts in scope for every custom kernel.
typedef half float16_t;
typedef bfloat bfloat16_t;

// ---------------------------------------------------------------------------------------
// Vector types: components, elementwise arithmetic, broadcast from a scalar.
namespace mshim {

template <typename T, int N>
struct vec_storage;

template <typename T>
struct vec_storage<T, 2> {
  T x, y;
};

template <typename T>
struct vec_storage<T, 3> {
  T x, y, z;
};

template <typename T>
struct vec_storage<T, 4> {
  T x, y, z, w;
};

template <typename T, int N>
struct vec : vec_storage<T, N> {
  vec() = default;
  vec(T s) {  // NOLINT: Metal broadcasts a scalar implicitly
    for (int i = 0; i < N; ++i) (*this)[i] = s;
  }
  vec(T a, T b) : vec_storage<T, N>{a, b} { static_assert(N == 2, "wrong vector arity"); }
  vec(T a, T b, T c) : vec_storage<T, N>{a, b, c} { static_assert(N == 3, "wrong vector arity"); }
  vec(T a, T b, T c, T d) : vec_storage<T, N>{a, b, c, d} {
    static_assert(N == 4, "wrong vector arity");
  }
  template <typename U>
  explicit vec(const vec<U, N>& o) {
    for (int i = 0; i < N; ++i) (*this)[i] = static_cast<T>(o[i]);
  }
  T& operator[](int i) { return (&this->x)[i]; }
  const T& operator[](int i) const { return (&this->x)[i]; }
};

#define MSHIM_VEC_OP(OP)                                                  \
  template <typename T, int N>                                            \
  vec<T, N> operator OP(const vec<T, N>& a, const vec<T, N>& b) {         \
    vec<T, N> r;                                                          \
    for (int i = 0; i < N; ++i) r[i] = a[i] OP b[i];                      \
    return r;                                                             \
  }                                                                       \
  template <typename T, int N>                                            \
  vec<T, N> operator OP(const vec<T, N>& a, T b) {                        \
    vec<T, N> r;                                                          \
    for (int i = 0; i < N; ++i) r[i] = a[i] OP b;                         \
    return r;                                                             \
  }                                                                       \
  template <typename T, int N>                                            \
  vec<T, N> operator OP(T a, const vec<T, N>& b) {                        \
    vec<T, N> r;                                                          \
    for (int i = 0; i < N; ++i) r[i] = a OP b[i];                         \
    return r;                                                             \
  }                                                                       \
  template <typename T, int N>                                            \
  vec<T, N>& operator OP##=(vec<T, N>& a, const vec<T, N>& b) {           \
    for (int i = 0; i < N; ++i) a[i] = a[i] OP b[i];                      \
    return a;                                                             \
  }
MSHIM_VEC_OP(+)
MSHIM_VEC_OP(-)
MSHIM_VEC_OP(*)
MSHIM_VEC_OP(/)
#undef MSHIM_VEC_OP

}  // namespace mshim

#define MSHIM_VEC_TYPES(T, NAME)        \
  typedef mshim::vec<T, 2> NAME##2;     \
  typedef mshim::vec<T, 3> NAME##3;     \
  typedef mshim::vec<T, 4> NAME##4;
MSHIM_VEC_TYPES(float, float)
MSHIM_VEC_TYPES(half, half)
MSHIM_VEC_TYPES(int, int)
MSHIM_VEC_TYPES(uint, uint)
MSHIM_VEC_TYPES(short, short)
MSHIM_VEC_TYPES(ushort, ushort)
MSHIM_VEC_TYPES(ulong, ulong)
#undef MSHIM_VEC_TYPES

// ---------------------------------------------------------------------------------------
// Constants from <metal_math>.
#define INFINITY __builtin_inff()
#define NAN __builtin_nanf("")
#define HUGE_VALF __builtin_huge_valf()
#define MAXFLOAT __FLT_MAX__
#define FLT_MAX __FLT_MAX__
#define FLT_MIN __FLT_MIN__
#define FLT_EPSILON __FLT_EPSILON__
#define M_LOG2E_F 1.44269504088896340736f
#define M_LN2_F 0.693147180559945309417f

// Call sites of collectives are compared across threads (line, and column where the compiler
// provides it) to report diverging barriers and simd_* calls.
#if defined(__has_builtin)
#if __has_builtin(__builtin_COLUMN)
#define MSHIM_COLUMN __builtin_COLUMN()
#endif
#endif
#ifndef MSHIM_COLUMN
#define MSHIM_COLUMN 0u
#endif

namespace metal {

// ---------------------------------------------------------------------------------------
// Math. Float versions are IEEE libm (Metal's "safe" math mode); half versions compute in
// float and round once.
#define MSHIM_UNARY(NAME, BUILTIN)                                          \
  inline float NAME(float x) { return BUILTIN(x); }                         \
  inline half NAME(half x) { return static_cast<half>(BUILTIN(static_cast<float>(x))); }
MSHIM_UNARY(exp, __builtin_expf)
MSHIM_UNARY(exp2, __builtin_exp2f)
MSHIM_UNARY(log, __builtin_logf)
MSHIM_UNARY(log2, __builtin_log2f)
MSHIM_UNARY(sqrt, __builtin_sqrtf)
MSHIM_UNARY(fabs, __builtin_fabsf)
MSHIM_UNARY(abs, __builtin_fabsf)
MSHIM_UNARY(floor, __builtin_floorf)
MSHIM_UNARY(ceil, __builtin_ceilf)
MSHIM_UNARY(trunc, __builtin_truncf)
MSHIM_UNARY(rint, __builtin_rintf)
MSHIM_UNARY(tanh, __builtin_tanhf)
MSHIM_UNARY(sin, __builtin_sinf)
MSHIM_UNARY(cos, __builtin_cosf)
#undef MSHIM_UNARY

inline float rsqrt(float x) { return 1.0f / __builtin_sqrtf(x); }
inline half rsqrt(half x) { return static_cast<half>(1.0f / __builtin_sqrtf(float(x))); }
inline float pow(float x, float y) { return __builtin_powf(x, y); }
inline half pow(half x, half y) { return static_cast<half>(__builtin_powf(float(x), float(y))); }
inline float fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
inline half fma(half a, half b, half c) {
  return static_cast<half>(__builtin_fmaf(float(a), float(b), float(c)));
}
// Metal's max/min on floats return the other operand when one is NaN (fmax semantics).
inline float fmax(float a, float b) { return __builtin_fmaxf(a, b); }
inline float fmin(float a, float b) { return __builtin_fminf(a, b); }
inline float max(float a, float b) { return __builtin_fmaxf(a, b); }
inline float min(float a, float b) { return __builtin_fminf(a, b); }
inline half max(half a, half b) { return static_cast<half>(__builtin_fmaxf(float(a), float(b))); }
inline half min(half a, half b) { return static_cast<half>(__builtin_fminf(float(a), float(b))); }
inline half fmax(half a, half b) { return max(a, b); }
inline half fmin(half a, half b) { return min(a, b); }
inline float clamp(float x, float lo, float hi) { return fmin(fmax(x, lo), hi); }
inline half clamp(half x, half lo, half hi) { return min(max(x, lo), hi); }

#define MSHIM_INT_MINMAX(T)                                              \
  inline T max(T a, T b) { return a > b ? a : b; }                       \
  inline T min(T a, T b) { return a < b ? a : b; }                       \
  inline T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }
MSHIM_INT_MINMAX(int)
MSHIM_INT_MINMAX(uint)
MSHIM_INT_MINMAX(short)
MSHIM_INT_MINMAX(ushort)
MSHIM_INT_MINMAX(int64_t)
MSHIM_INT_MINMAX(uint64_t)
#undef MSHIM_INT_MINMAX
inline int abs(int x) { return x < 0 ? -x : x; }

inline bool isnan(float x) { return __builtin_isnan(x); }
inline bool isinf(float x) { return __builtin_isinf(x); }
inline bool isfinite(float x) { return __builtin_isfinite(x); }
inline bool isnan(half x) { return __builtin_isnan(float(x)); }
inline bool isinf(half x) { return __builtin_isinf(float(x)); }
inline bool isfinite(half x) { return __builtin_isfinite(float(x)); }

template <typename T>
inline T select(T a, T b, bool c) {
  return c ? b : a;
}

namespace fast {
inline float exp(float x) { return __builtin_expf(x); }
inline float exp2(float x) { return __builtin_exp2f(x); }
inline float log(float x) { return __builtin_logf(x); }
inline float log2(float x) { return __builtin_log2f(x); }
inline float rsqrt(float x) { return 1.0f / __builtin_sqrtf(x); }
inline float sqrt(float x) { return __builtin_sqrtf(x); }
inline float tanh(float x) { return __builtin_tanhf(x); }
inline float max(float a, float b) { return __builtin_fmaxf(a, b); }
inline float min(float a, float b) { return __builtin_fminf(a, b); }
}  // namespace fast

namespace precise {
inline float exp(float x) { return __builtin_expf(x); }
inline float exp2(float x) { return __builtin_exp2f(x); }
inline float log(float x) { return __builtin_logf(x); }
inline float log2(float x) { return __builtin_log2f(x); }
inline float rsqrt(float x) { return 1.0f / __builtin_sqrtf(x); }
inline float sqrt(float x) { return __builtin_sqrtf(x); }
inline float tanh(float x) { return __builtin_tanhf(x); }
}  // namespace precise

// Reinterpret the bits of a value as another type of the same size.
template <typename To, typename From>
inline To as_type(From x) {
  static_assert(sizeof(To) == sizeof(From), "as_type needs types of the same size");
  To r;
  __builtin_memcpy(&r, &x, sizeof(To));
  return r;
}

// ---------------------------------------------------------------------------------------
// Barriers.
enum class mem_flags : unsigned {
  mem_none = 0,
  mem_device = 1,
  mem_threadgroup = 2,
  mem_texture = 4,
};

inline mem_flags operator|(mem_flags a, mem_flags b) {
  return static_cast<mem_flags>(static_cast<unsigned>(a) | static_cast<unsigned>(b));
}

// Every thread of the threadgroup must reach the same call; the runtime reports a deadlock
// or a mismatch otherwise.
inline void threadgroup_barrier(mem_flags, unsigned line = __builtin_LINE(),
                                unsigned column = MSHIM_COLUMN) {
  mshim_threadgroup_barrier(MSHIM_OP_THREADGROUP_BARRIER, line, column);
}

inline void simdgroup_barrier(mem_flags, unsigned line = __builtin_LINE(),
                              unsigned column = MSHIM_COLUMN) {
  unsigned lane, width;
  char slot[1] = {0};
  char all[MSHIM_SIMD_WIDTH * MSHIM_SLOT_BYTES];
  mshim_simd_exchange(MSHIM_OP_SIMDGROUP_BARRIER, line, column, slot, 1, all, &lane, &width);
}

// ---------------------------------------------------------------------------------------
// SIMD-group functions. Every lane of the simdgroup must call the same function from the
// same place; lanes that returned early or took another branch are reported, not modelled
// as inactive.
template <typename T>
struct simd_type_ok {
  static constexpr bool value = false;
};
template <>
struct simd_type_ok<float> {
  static constexpr bool value = true;
};
template <>
struct simd_type_ok<half> {
  static constexpr bool value = true;
};
template <>
struct simd_type_ok<int> {
  static constexpr bool value = true;
};
template <>
struct simd_type_ok<uint> {
  static constexpr bool value = true;
};
template <>
struct simd_type_ok<short> {
  static constexpr bool value = true;
};
template <>
struct simd_type_ok<ushort> {
  static constexpr bool value = true;
};

template <typename T>
struct simd_values {
  static_assert(simd_type_ok<T>::value,
                "metal_shim.h models simd_* functions only for float, half, int, uint, short "
                "and ushort scalars");
  T v[MSHIM_SIMD_WIDTH];
  unsigned lane;
  unsigned width;
  simd_values(int kind, unsigned line, unsigned column, T mine) {
    unsigned char all[MSHIM_SIMD_WIDTH * MSHIM_SLOT_BYTES];
    mshim_simd_exchange(kind, line, column, &mine, sizeof(T), all, &lane, &width);
    for (unsigned i = 0; i < width; ++i) __builtin_memcpy(&v[i], all + i * MSHIM_SLOT_BYTES, sizeof(T));
  }
};

template <typename T>
inline T mshim_add(T a, T b) {
  return static_cast<T>(a + b);
}

// Pairwise tree over the lanes, the same order on every lane, so all lanes agree exactly.
template <typename T>
inline T mshim_tree_sum(const T* v, unsigned n) {
  if (n == 1) return v[0];
  const unsigned h = n / 2;
  return mshim_add(mshim_tree_sum(v, h), mshim_tree_sum(v + h, n - h));
}

#define MSHIM_SIMD_ARGS unsigned line = __builtin_LINE(), unsigned column = MSHIM_COLUMN

template <typename T>
inline T simd_sum(T x, MSHIM_SIMD_ARGS) {
  simd_values<T> s(MSHIM_OP_SIMD_SUM, line, column, x);
  return mshim_tree_sum(s.v, s.width);
}

template <typename T>
inline T simd_product(T x, MSHIM_SIMD_ARGS) {
  simd_values<T> s(MSHIM_OP_SIMD_PRODUCT, line, column, x);
  T r = s.v[0];
  for (unsigned i = 1; i < s.width; ++i) r = static_cast<T>(r * s.v[i]);
  return r;
}

template <typename T>
inline T simd_max(T x, MSHIM_SIMD_ARGS) {
  simd_values<T> s(MSHIM_OP_SIMD_MAX, line, column, x);
  T r = s.v[0];
  for (unsigned i = 1; i < s.width; ++i) r = max(r, s.v[i]);
  return r;
}

template <typename T>
inline T simd_min(T x, MSHIM_SIMD_ARGS) {
  simd_values<T> s(MSHIM_OP_SIMD_MIN, line, column, x);
  T r = s.v[0];
  for (unsigned i = 1; i < s.width; ++i) r = min(r, s.v[i]);
  return r;
}

template <typename T>
inline T simd_shuffle(T x, ushort src, MSHIM_SIMD_ARGS) {
  simd_values<T> s(MSHIM_OP_SIMD_SHUFFLE, line, column, x);
  if (src >= s.width) mshim_fail("simd_shuffle: source lane outside the simdgroup (undefined)");
  return s.v[src];
}

template <typename T>
inline T simd_broadcast(T x, ushort src, MSHIM_SIMD_ARGS) {
  simd_values<T> s(MSHIM_OP_SIMD_BROADCAST, line, column, x);
  if (src >= s.width) mshim_fail("simd_broadcast: source lane outside the simdgroup (undefined)");
  return s.v[src];
}

template <typename T>
inline T simd_broadcast_first(T x, MSHIM_SIMD_ARGS) {
  simd_values<T> s(MSHIM_OP_SIMD_BROADCAST_FIRST, line, column, x);
  return s.v[0];
}

template <typename T>
inline T simd_shuffle_xor(T x, ushort mask, MSHIM_SIMD_ARGS) {
  simd_values<T> s(MSHIM_OP_SIMD_SHUFFLE_XOR, line, column, x);
  const unsigned src = s.lane ^ mask;
  if (src >= s.width) mshim_fail("simd_shuffle_xor: source lane outside the simdgroup (undefined)");
  return s.v[src];
}

// Lanes whose source falls outside the simdgroup keep their own value, as in Metal.
template <typename T>
inline T simd_shuffle_down(T x, ushort delta, MSHIM_SIMD_ARGS) {
  simd_values<T> s(MSHIM_OP_SIMD_SHUFFLE_DOWN, line, column, x);
  const unsigned src = s.lane + delta;
  return src < s.width ? s.v[src] : x;
}

template <typename T>
inline T simd_shuffle_up(T x, ushort delta, MSHIM_SIMD_ARGS) {
  simd_values<T> s(MSHIM_OP_SIMD_SHUFFLE_UP, line, column, x);
  return s.lane >= delta ? s.v[s.lane - delta] : x;
}

template <typename T>
inline T simd_prefix_inclusive_sum(T x, MSHIM_SIMD_ARGS) {
  simd_values<T> s(MSHIM_OP_SIMD_PREFIX_INCLUSIVE_SUM, line, column, x);
  T r = s.v[0];
  for (unsigned i = 1; i <= s.lane; ++i) r = static_cast<T>(r + s.v[i]);
  return r;
}

template <typename T>
inline T simd_prefix_exclusive_sum(T x, MSHIM_SIMD_ARGS) {
  simd_values<T> s(MSHIM_OP_SIMD_PREFIX_EXCLUSIVE_SUM, line, column, x);
  T r = static_cast<T>(0);
  for (unsigned i = 0; i < s.lane; ++i) r = static_cast<T>(r + s.v[i]);
  return r;
}

inline bool simd_all(bool x, MSHIM_SIMD_ARGS) {
  simd_values<int> s(MSHIM_OP_SIMD_ALL, line, column, x ? 1 : 0);
  for (unsigned i = 0; i < s.width; ++i)
    if (!s.v[i]) return false;
  return true;
}

inline bool simd_any(bool x, MSHIM_SIMD_ARGS) {
  simd_values<int> s(MSHIM_OP_SIMD_ANY, line, column, x ? 1 : 0);
  for (unsigned i = 0; i < s.width; ++i)
    if (s.v[i]) return true;
  return false;
}

// ---------------------------------------------------------------------------------------
// 8x8 simdgroup matrices. A matrix is spread over the 32 lanes of a simdgroup, two elements
// each: lane l holds row (q & 4) + (l / 2) % 4, columns c and c + 1 with c = (q & 2) * 2 +
// (l % 2) * 2, q = l / 4 (the layout MLX's steel kernels read through thread_elements()).
// Loads, stores and multiplies are collectives: every lane must reach the same call.
template <typename T, int COLS, int ROWS>
struct simdgroup_matrix {
  static_assert(COLS == 8 && ROWS == 8, "metal_shim.h models 8x8 simdgroup matrices only");
  static_assert(__is_same(T, float) || __is_same(T, half) || __is_same(T, bfloat),
                "simdgroup matrices hold float, half or bfloat");
  mshim::vec<T, 2> e;
  simdgroup_matrix() = default;
  // Metal: a diagonal matrix with `value` on the diagonal.
  explicit simdgroup_matrix(T value, unsigned line = __builtin_LINE(),
                            unsigned column = MSHIM_COLUMN);
  mshim::vec<T, 2>& thread_elements() { return e; }
  const mshim::vec<T, 2>& thread_elements() const { return e; }
};

typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;

namespace mshim_matrix {
// The calling lane's place in the simdgroup, through a rendezvous of all its lanes.
inline unsigned lane(int kind, unsigned line, unsigned column) {
  unsigned char all[MSHIM_SIMD_WIDTH * MSHIM_SLOT_BYTES];
  unsigned char none = 0;
  unsigned lane_id, width;
  mshim_simd_exchange(kind, line, column, &none, 1, all, &lane_id, &width);
  if (width != MSHIM_SIMD_WIDTH) mshim_fail("simdgroup matrices need a full simdgroup of 32");
  return lane_id;
}
inline unsigned row(unsigned l) { return ((l / 4) & 4u) + (l / 2) % 4; }
inline unsigned col(unsigned l) { return ((l / 4) & 2u) * 2 + (l % 2) * 2; }

// Every lane's two elements of `m`, gathered: full[r][c].
template <typename T>
inline void gather(const mshim::vec<T, 2>& mine, float full[8][8], unsigned line,
                   unsigned column) {
  float pair[2] = {float(mine[0]), float(mine[1])};
  unsigned char all[MSHIM_SIMD_WIDTH * MSHIM_SLOT_BYTES];
  unsigned lane_id, width;
  mshim_simd_exchange(MSHIM_OP_SIMDGROUP_MULTIPLY_ACCUMULATE, line, column, pair, sizeof pair,
                      all, &lane_id, &width);
  for (unsigned l = 0; l < width; ++l) {
    float v[2];
    __builtin_memcpy(v, all + l * MSHIM_SLOT_BYTES, sizeof v);
    full[row(l)][col(l)] = v[0];
    full[row(l)][col(l) + 1] = v[1];
  }
}
}  // namespace mshim_matrix

template <typename T, int C, int R>
simdgroup_matrix<T, C, R>::simdgroup_matrix(T value, unsigned line, unsigned column) {
  const unsigned l = mshim_matrix::lane(MSHIM_OP_SIMDGROUP_LOAD, line, column);
  const unsigned r = mshim_matrix::row(l), c = mshim_matrix::col(l);
  e[0] = r == c ? value : T(0);
  e[1] = r == c + 1 ? value : T(0);
}

template <typename T, int C, int R>
inline simdgroup_matrix<T, C, R> make_filled_simdgroup_matrix(T value) {
  simdgroup_matrix<T, C, R> m;
  m.e = mshim::vec<T, 2>(value);
  return m;
}

// m[i][j] = src[(origin.y + i) * elements_per_row + origin.x + j], or with `transpose`
// src[(origin.y + j) * elements_per_row + origin.x + i] (origin is (column, row), as in Metal).
template <typename T, typename S, int C, int R>
inline void simdgroup_load(simdgroup_matrix<T, C, R>& m, const S* src, ulong elements_per_row = 8,
                           ulong2 origin = ulong2(0, 0), bool transpose = false,
                           unsigned line = __builtin_LINE(), unsigned column = MSHIM_COLUMN) {
  static_assert(__is_same(T, S), "simdgroup_load: the matrix and the memory hold one type");
  const unsigned l = mshim_matrix::lane(MSHIM_OP_SIMDGROUP_LOAD, line, column);
  const unsigned r = mshim_matrix::row(l), c = mshim_matrix::col(l);
  for (unsigned k = 0; k < 2; ++k) {
    const ulong i = r, j = c + k;
    const ulong at = transpose ? (origin.y + j) * elements_per_row + origin.x + i
                               : (origin.y + i) * elements_per_row + origin.x + j;
    m.e[k] = src[at];
  }
}

template <typename T, typename S, int C, int R>
inline void simdgroup_store(const simdgroup_matrix<T, C, R>& m, S* dst,
                            ulong elements_per_row = 8, ulong2 origin = ulong2(0, 0),
                            bool transpose = false, unsigned line = __builtin_LINE(),
                            unsigned column = MSHIM_COLUMN) {
  static_assert(__is_same(T, S), "simdgroup_store: the matrix and the memory hold one type");
  const unsigned l = mshim_matrix::lane(MSHIM_OP_SIMDGROUP_STORE, line, column);
  const unsigned r = mshim_matrix::row(l), c = mshim_matrix::col(l);
  for (unsigned k = 0; k < 2; ++k) {
    const ulong i = r, j = c + k;
    const ulong at = transpose ? (origin.y + j) * elements_per_row + origin.x + i
                               : (origin.y + i) * elements_per_row + origin.x + j;
    dst[at] = m.e[k];
  }
}

// d = a * b + c. Each output is a float sum of its eight products in k order, rounded once
// to d's type (the GPU's order within the eight is not documented: tests allow for it).
template <typename T, int C, int R>
inline void simdgroup_multiply_accumulate(simdgroup_matrix<T, C, R>& d,
                                          const simdgroup_matrix<T, C, R>& a,
                                          const simdgroup_matrix<T, C, R>& b,
                                          const simdgroup_matrix<T, C, R>& c,
                                          unsigned line = __builtin_LINE(),
                                          unsigned column = MSHIM_COLUMN) {
  float fa[8][8], fb[8][8], fc[8][8];
  mshim_matrix::gather(a.e, fa, line, column);
  mshim_matrix::gather(b.e, fb, line, column);
  mshim_matrix::gather(c.e, fc, line, column);
  const unsigned l = mshim_matrix::lane(MSHIM_OP_SIMDGROUP_MULTIPLY_ACCUMULATE, line, column);
  const unsigned r = mshim_matrix::row(l), col0 = mshim_matrix::col(l);
  for (unsigned k = 0; k < 2; ++k) {
    float acc = fc[r][col0 + k];
    for (unsigned i = 0; i < 8; ++i) acc = __builtin_fmaf(fa[r][i], fb[i][col0 + k], acc);
    d.e[k] = T(acc);
  }
}

#undef MSHIM_SIMD_ARGS

}  // namespace metal

// MLX's bf16.h does this for every custom kernel.
using namespace metal;

namespace mshim {
inline uint3 to_uint3(mshim_uint3 v) { return uint3(v.x, v.y, v.z); }
}  // namespace mshim
