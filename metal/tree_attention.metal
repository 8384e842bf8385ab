// Tree attention for DDTree verification, as mx.fast.metal_kernel sources.
//
// This file holds three strings, each starting at a "//// [section]" marker line:
//   header                    helpers shared by both kernels (mx.fast.metal_kernel `header`)
//   kernel tree_attention_fwd    body of the attention kernel (`source`)
//   kernel tree_attention_merge  body of the split-KV merge kernel (`source`)
// mlx_dflash/tree_attention.py reads them, and the CPU harness (metal/harness) compiles the
// very same strings. MLX generates the function signature around each body.
//
// Semantics: query i (a tree token) attends to all S prefix keys and to the tree keys of
// itself and its ancestors, found by walking `parents` (parents[0] = -1, parents[i] < i).
// Softmax runs in base 2 on log2(e)-prescaled scores with float32 accumulation.
//
// tree_attention_fwd layout: one threadgroup per (head block, token block, KV split) with NSG
// simdgroups of 32 lanes. A head block is HPS query heads sharing one KV head (GQA ratio G);
// a token block is QB consecutive tree tokens; their HPS * QB (head, token) pairs are the
// threadgroup's rows, so each K/V row loaded serves all of them. Lane l owns head-dim
// elements l, l + 32, ... of every row. Simdgroup s takes the prefix keys lo + s,
// lo + s + NSG, ... of the split's range and every NSG-th node of each token's ancestor chain
// (the chains go to the last split). Each (key, row) costs one simd_sum; online softmax keeps
// (max, sum, accumulator) per row in registers, and the simdgroups are merged through
// threadgroup memory at the end. With SPLIT = 0 the kernel writes the normalised
// output; with SPLIT = 1 it writes the unnormalised accumulator and (max, sum) per split for
// tree_attention_merge.

//// [header]
// Largest finite float magnitude we use as "minus infinity": exp2 of (this - finite) is 0 in
// every math mode, and it never produces inf - inf.
constant constexpr float DFLASH_NEG_BIG = -3.0e38f;

//// [kernel tree_attention_fwd]
  // Template parameters: T (q/k/v type), O (type of o), D (head dim), G (query heads per KV
  // head), HPS (query heads per threadgroup), QB (tree tokens per threadgroup), NSG
  // (simdgroups per threadgroup), SPLIT (0/1). Row r of a threadgroup is tree token
  // tq0 + r / HPS under query head h0 + r % HPS.
  constexpr int DC = (D + 31) / 32;
  constexpr int HB = G / HPS;
  constexpr int R = HPS * QB;
  threadgroup float tg_max[NSG * R];  // per simdgroup and row: running max
  threadgroup float tg_sum[NSG * R];  // per simdgroup and row: running sum
  threadgroup float tg_acc[NSG * D];  // per simdgroup: one row's accumulator

  const int n_q = q_shape[1];
  const int n_tree = q_shape[2];
  const int prefix = k_shape[2] - n_tree;
  const int hb = int(threadgroup_position_in_grid.x);
  const int tq0 = int(threadgroup_position_in_grid.y) * QB;
  const int split = int(threadgroup_position_in_grid.z);
  const int n_split = int(threadgroups_per_grid.z);
  const int sg = int(simdgroup_index_in_threadgroup);
  const int lane = int(thread_index_in_simdgroup);
  const int kvh = hb / HB;
  const int h0 = kvh * G + (hb % HB) * HPS;

  // This split's share of the prefix; the last split also takes the ancestor chains.
  const int chunk = (prefix + n_split - 1) / n_split;
  const int lo = min(prefix, split * chunk);
  const int hi = min(prefix, lo + chunk);
  const bool take_tree = split == n_split - 1;

  const float qscale = scale[0] * 1.44269504088896340736f;
  float qv[R][DC];
  float acc[R][DC];
  float run_max[R];
  float run_sum[R];
  for (int r = 0; r < R; ++r) {
    const int qi = min(tq0 + r / HPS, n_tree - 1);  // rows past the tree stay idle
    const int64_t qoff = int64_t(h0 + r % HPS) * q_strides[1] + int64_t(qi) * q_strides[2];
    for (int c = 0; c < DC; ++c) {
      const int d = lane + 32 * c;
      qv[r][c] = d < D ? float(q[qoff + int64_t(d) * q_strides[3]]) * qscale : 0.0f;
      acc[r][c] = 0.0f;
    }
    run_max[r] = DFLASH_NEG_BIG;
    run_sum[r] = 0.0f;
  }

  const int64_t kbase = int64_t(kvh) * k_strides[1];
  const int64_t vbase = int64_t(kvh) * v_strides[1];
  const int64_t pstride = parents_strides[0];
  // Keys of this simdgroup: prefix rows lo + sg, lo + sg + NSG, ... (for every row), then
  // each token's ancestor chain (for that token's rows only), every NSG-th node of it.
  const int r_valid = min(R, (n_tree - tq0) * HPS);  // rows of tokens that exist
  int j = lo + sg;
  int b = 0;                         // token of the chain being walked
  int node = take_tree ? tq0 : -1;   // next node on that chain (the token itself first)
  int depth = 0;                     // position of `node` on the chain
  while (true) {
    int row;
    int r_lo = 0;
    int r_hi = r_valid;
    if (j < hi) {
      row = j;
      j += NSG;
    } else {
      while (true) {
        if (node < 0) {
          ++b;
          if (!take_tree || b >= QB || tq0 + b >= n_tree) {
            break;
          }
          node = tq0 + b;
          depth = 0;
        }
        if (depth % NSG == sg) {
          break;
        }
        // Parents must decrease, which also bounds the walk on malformed input.
        const int p = parents[int64_t(node) * pstride];
        node = p < node ? p : -1;
        ++depth;
      }
      if (node < 0) {
        break;
      }
      row = prefix + node;
      r_lo = b * HPS;
      r_hi = r_lo + HPS;
      const int p = parents[int64_t(node) * pstride];
      node = p < node ? p : -1;
      ++depth;
    }
    const int64_t koff = kbase + int64_t(row) * k_strides[2];
    const int64_t voff = vbase + int64_t(row) * v_strides[2];
    float kk[DC];
    float vv[DC];
    for (int c = 0; c < DC; ++c) {
      const int d = lane + 32 * c;
      kk[c] = d < D ? float(k[koff + int64_t(d) * k_strides[3]]) : 0.0f;
      vv[c] = d < D ? float(v[voff + int64_t(d) * v_strides[3]]) : 0.0f;
    }
    for (int r = 0; r < R; ++r) {
      if (r < r_lo || r >= r_hi) {
        continue;  // uniform over the simdgroup; a fixed trip count keeps arrays in registers
      }
      float part = 0.0f;
      for (int c = 0; c < DC; ++c) {
        part = fma(qv[r][c], kk[c], part);
      }
      const float s = simd_sum(part);
      const float new_max = max(run_max[r], s);
      const float corr = exp2(run_max[r] - new_max);
      const float p = exp2(s - new_max);
      run_sum[r] = run_sum[r] * corr + p;
      for (int c = 0; c < DC; ++c) {
        acc[r][c] = fma(p, vv[c], acc[r][c] * corr);
      }
      run_max[r] = new_max;
    }
  }

  // Merge the NSG simdgroups' partial softmax states through threadgroup memory.
  if (lane == 0) {
    for (int r = 0; r < R; ++r) {
      tg_max[sg * R + r] = run_max[r];
      tg_sum[sg * R + r] = run_sum[r];
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const int tid = sg * 32 + lane;
  for (int r = 0; r < R; ++r) {
    const int qi = tq0 + r / HPS;
    if (qi >= n_tree) {
      break;  // uniform over the threadgroup
    }
    float m = DFLASH_NEG_BIG;
    for (int s = 0; s < NSG; ++s) {
      m = max(m, tg_max[s * R + r]);
    }
    float l = 0.0f;
    for (int s = 0; s < NSG; ++s) {
      l += tg_sum[s * R + r] * exp2(tg_max[s * R + r] - m);
    }
    const float f = exp2(run_max[r] - m);
    for (int c = 0; c < DC; ++c) {
      const int d = lane + 32 * c;
      if (d < D) {
        tg_acc[sg * D + d] = acc[r][c] * f;
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const int64_t row_out = (int64_t(split) * n_q + h0 + r % HPS) * n_tree + qi;
    for (int d = tid; d < D; d += NSG * 32) {
      float total = 0.0f;
      for (int s = 0; s < NSG; ++s) {
        total += tg_acc[s * D + d];
      }
      o[row_out * D + d] = static_cast<O>(SPLIT ? total : total / l);
    }
    if (tid == 0) {
      ml[row_out * 2] = m;
      ml[row_out * 2 + 1] = l;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

//// [kernel tree_attention_merge]
  // Template parameters: T (output type), D (head dim). part_o: (n_split, Hq, T, D) float32
  // unnormalised accumulators; part_ml: (n_split, Hq, T, 2) float32 (max, sum) per split.
  const int n_split = part_ml_shape[0];
  const int n_rows = part_ml_shape[1] * part_ml_shape[2];
  const int d = int(thread_position_in_grid.x);
  const int row = int(thread_position_in_grid.y);
  if (d >= D || row >= n_rows) {
    return;
  }
  float m = DFLASH_NEG_BIG;
  for (int s = 0; s < n_split; ++s) {
    m = max(m, part_ml[(int64_t(s) * n_rows + row) * 2]);
  }
  float l = 0.0f;
  float total = 0.0f;
  for (int s = 0; s < n_split; ++s) {
    const int64_t r = int64_t(s) * n_rows + row;
    const float f = exp2(part_ml[r * 2] - m);
    l += part_ml[r * 2 + 1] * f;
    total += part_o[r * D + d] * f;
  }
  out[int64_t(row) * D + d] = static_cast<T>(total / l);
