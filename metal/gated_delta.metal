// Gated DeltaNet under speculative verification, as mx.fast.metal_kernel sources.
//
// This file holds three strings, each starting at a "//// [section]" marker line:
//   header                  (empty: nothing shared)
//   kernel gdn_tree_verify  the gated delta rule over a tree of draft tokens
//   kernel gdn_tape_replay  the state after an accepted path, rebuilt from the tape
// mlx_dflash/gdn_kernels.py reads them, and the CPU harness (metal/harness) compiles the very
// same strings. MLX generates the function signature around each body.
//
// Semantics (mlx_dflash/hybrid.py, tree_recurrence_reference): node i of the tree starts
// from its parent's state S_p (state0 for the root), and with S = g_i * S_p
//   delta_i = (v_i - S k_i) * beta_i,   S_i = S + k_i (x) delta_i,   y_i = S_i q_i.
// Each (value head hv, value row dv) is an independent recurrence over a Dk-vector: one
// simdgroup owns one row, lane l holding key elements l, l + 32, ... in registers, and each
// node costs two simd_sums. q/k may have fewer heads than v (GQA): hk = hv / (Hv / Hk).

//// [header]

//// [kernel gdn_tree_verify]
  // Template parameters: InT (q/k/v type), DK (key head dim, <= 256), NSG (value rows per
  // threadgroup: its height; one simdgroup each), TMAX (power of two >= tree size).
  //
  // Inputs: q, k (T, Hk, DK), v (T, Hv, Dv), g, beta (T, Hv) float32, state0 (Hv, Dv, DK)
  // float32, plan int32 (built by gdn_kernels.tree_plan from the parents):
  //   plan[0 .. T)        node order: depth-first preorder, so a node's first child comes
  //                       right after it and its state is still in registers;
  //   plan[T .. 2T]       offsets into plan: positions [plan[T + j], plan[T + j + 1]) list the
  //                       path root .. parent of the j-th node when that parent is not the
  //                       node processed just before (a sibling branch starts), else empty;
  //   plan[2T + 1 ..]     those paths (plus one pad element).
  // Outputs: y, delta (T, Hv, Dv) float32.
  //
  // A node whose parent state is gone from registers rebuilds it by replaying the parent's
  // path from state0 with the deltas this simdgroup already produced (kept per row in
  // threadgroup memory: TMAX floats). A replay step is Dk/32 fmas per lane and no reduction.
  // Keeping every node's row state instead would need T * DK floats per row (64 KiB at
  // T = 128, DK = 128: over the 32 KiB of threadgroup memory), and a stack of path states is
  // capped by depth x DK x rows in the same 32 KiB; replaying has no such limit and costs
  // sum over branching nodes p of (children(p) - 1) * (depth(p) + 1) steps.
  constexpr int DC = (DK + 31) / 32;
  threadgroup float tg_delta[NSG * TMAX];

  const int n_tree = v_shape[0];
  const int n_hv = v_shape[1];
  const int n_dv = v_shape[2];
  const int n_hk = k_shape[1];
  const int lane = int(thread_index_in_simdgroup);
  const int row = int(thread_position_in_threadgroup.y);
  const int dv = int(thread_position_in_grid.y);
  const int hv = int(thread_position_in_grid.z);
  const int hk = hv / (n_hv / n_hk);
  const int log0 = row * TMAX;  // this row's delta log in tg_delta

  float s0[DC];  // this row of state0, kept for replays
  float s[DC];   // the row state of the node processed last
  const int64_t srow = (int64_t(hv) * n_dv + dv) * DK;
  for (int c = 0; c < DC; ++c) {
    const int d = lane + 32 * c;
    s0[c] = d < DK ? state0[srow + d] : 0.0f;
    s[c] = s0[c];
  }

  for (int j = 0; j < n_tree; ++j) {
    const int n = plan[j];
    const int r0 = plan[n_tree + j];
    const int r1 = plan[n_tree + j + 1];
    if (r1 > r0) {  // uniform: the plan is the same for every lane and row
      simdgroup_barrier(mem_flags::mem_threadgroup);  // lane 0's deltas visible to all lanes
      for (int c = 0; c < DC; ++c) {
        s[c] = s0[c];
      }
      for (int e = r0; e < r1; ++e) {
        const int a = plan[e];
        const float ga = g[int64_t(a) * n_hv + hv];
        const float da = tg_delta[log0 + a];
        const int64_t ka = (int64_t(a) * n_hk + hk) * DK;
        for (int c = 0; c < DC; ++c) {
          const int d = lane + 32 * c;
          const float kd = d < DK ? float(k[ka + d]) : 0.0f;
          s[c] = s[c] * ga;  // the forward's own two roundings, so replays reproduce it
          s[c] = s[c] + kd * da;
        }
      }
    }
    const float gn = g[int64_t(n) * n_hv + hv];
    const float bn = beta[int64_t(n) * n_hv + hv];
    const int64_t kn = (int64_t(n) * n_hk + hk) * DK;
    float kk[DC];
    float qq[DC];
    float kv = 0.0f;
    for (int c = 0; c < DC; ++c) {
      const int d = lane + 32 * c;
      kk[c] = d < DK ? float(k[kn + d]) : 0.0f;
      qq[c] = d < DK ? float(q[kn + d]) : 0.0f;
      s[c] = s[c] * gn;
      kv += s[c] * kk[c];
    }
    kv = simd_sum(kv);
    const int64_t on = (int64_t(n) * n_hv + hv) * n_dv + dv;
    const float dl = (float(v[on]) - kv) * bn;
    float out = 0.0f;
    for (int c = 0; c < DC; ++c) {
      s[c] = s[c] + kk[c] * dl;
      out += s[c] * qq[c];
    }
    out = simd_sum(out);
    if (lane == 0) {
      y[on] = out;
      delta[on] = dl;
      tg_delta[log0 + n] = dl;
    }
  }

//// [kernel gdn_tape_replay]
  // Template parameter: InT (k type). One thread per state element (hv, dv, d):
  // state = g_a * state + k_a[d] * delta_a[dv] for each node a of `path`, in order.
  // Inputs: state0 (Hv, Dv, Dk) float32, k (T, Hk, Dk), g (T, Hv) float32,
  // delta (T, Hv, Dv) float32, path (n,) int32. Output: state (Hv, Dv, Dk) float32.
  const int d = int(thread_position_in_grid.x);
  const int dv = int(thread_position_in_grid.y);
  const int hv = int(thread_position_in_grid.z);
  const int n_dk = k_shape[2];
  const int n_hk = k_shape[1];
  const int n_hv = delta_shape[1];
  const int n_dv = delta_shape[2];
  const int n_path = path_shape[0];
  const int hk = hv / (n_hv / n_hk);
  const int64_t si = (int64_t(hv) * n_dv + dv) * n_dk + d;
  float st = state0[si];
  for (int i = 0; i < n_path; ++i) {
    const int a = path[i];
    st = st * g[int64_t(a) * n_hv + hv];
    st = st + float(k[(int64_t(a) * n_hk + hk) * n_dk + d]) *
                  delta[(int64_t(a) * n_hv + hv) * n_dv + dv];
  }
  state[si] = st;
