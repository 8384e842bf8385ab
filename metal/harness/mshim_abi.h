// Plain C++ interface between a kernel translation unit (metal_shim.h + generated wrapper)
// and the fiber runtime (runtime.cpp). Nothing Metal-specific lives here, so the runtime can
// include it without the address-space macros of metal_shim.h.
#pragma once

#include <stddef.h>
#include <stdint.h>

#define MSHIM_ABI_VERSION 4

struct mshim_uint3 {
  unsigned x, y, z;
};

// Values of every attribute mx.fast.metal_kernel can bind, for one thread.
struct mshim_attrs {
  mshim_uint3 thread_position_in_grid;
  mshim_uint3 thread_position_in_threadgroup;
  mshim_uint3 threadgroup_position_in_grid;
  mshim_uint3 threadgroups_per_grid;
  mshim_uint3 threads_per_grid;
  mshim_uint3 threads_per_threadgroup;
  mshim_uint3 dispatch_threads_per_threadgroup;
  mshim_uint3 grid_origin;
  mshim_uint3 grid_size;
  unsigned thread_index_in_threadgroup;
  unsigned thread_index_in_simdgroup;
  unsigned simdgroup_index_in_threadgroup;
  unsigned simdgroups_per_threadgroup;
  unsigned dispatch_simdgroups_per_threadgroup;
  unsigned threads_per_simdgroup;
  unsigned thread_execution_width;
  unsigned thread_index_in_quadgroup;
  unsigned quadgroup_index_in_threadgroup;
  unsigned quadgroups_per_threadgroup;
  unsigned dispatch_quadgroups_per_threadgroup;
};

// Collective-operation kinds, so lanes that meet at one rendezvous from different
// functions are reported instead of silently combined.
enum mshim_op_kind {
  MSHIM_OP_THREADGROUP_BARRIER = 1,
  MSHIM_OP_SIMDGROUP_BARRIER,
  MSHIM_OP_SIMD_SUM,
  MSHIM_OP_SIMD_PRODUCT,
  MSHIM_OP_SIMD_MAX,
  MSHIM_OP_SIMD_MIN,
  MSHIM_OP_SIMD_SHUFFLE,
  MSHIM_OP_SIMD_SHUFFLE_XOR,
  MSHIM_OP_SIMD_SHUFFLE_UP,
  MSHIM_OP_SIMD_SHUFFLE_DOWN,
  MSHIM_OP_SIMD_BROADCAST,
  MSHIM_OP_SIMD_BROADCAST_FIRST,
  MSHIM_OP_SIMD_PREFIX_INCLUSIVE_SUM,
  MSHIM_OP_SIMD_PREFIX_EXCLUSIVE_SUM,
  MSHIM_OP_SIMD_ALL,
  MSHIM_OP_SIMD_ANY,
  MSHIM_OP_SIMDGROUP_LOAD,
  MSHIM_OP_SIMDGROUP_STORE,
  MSHIM_OP_SIMDGROUP_MULTIPLY_ACCUMULATE,
};

#define MSHIM_SIMD_WIDTH 32
#define MSHIM_SLOT_BYTES 16

extern "C" {
// Implemented by the runtime; called from kernel code running in a fiber.
void mshim_threadgroup_barrier(int kind, unsigned line, unsigned column);
// Every lane of the calling simdgroup deposits `size` bytes; after all lanes arrived, `all`
// receives MSHIM_SIMD_WIDTH slots of MSHIM_SLOT_BYTES (slot i = lane i's value).
void mshim_simd_exchange(int kind, unsigned line, unsigned column, const void* mine,
                         unsigned size, void* all, unsigned* lane, unsigned* width);
[[noreturn]] void mshim_fail(const char* message);

// Implemented by the generated kernel wrapper: runs the kernel body for one thread.
void mshim_kernel_entry(void* const* buffers, const mshim_attrs* attrs);
}
