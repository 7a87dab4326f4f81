// One side of the A/B (see build.sh): compiled as run_new against the working tree and as run_old,
// with the namespace renamed, against the base revision. Times one run_attention call.
#include <chrono>
#include <cmath>
#include <cstdint>
#include "cpu/cpu_attention.h"
#include "cpu/thread_pool.h"
using namespace kvattn;
extern "C" double SIDE(const void* q, const void* k, const void* v, void* out, const int32_t* qo, const int64_t* kvp, const int32_t* idx,
                       int batch, int64_t slots, int H, int KH, int D, int causal, int threads) {
  static cpu::ThreadPool* pool = new cpu::ThreadPool(threads);
  static cpu::AttentionWorkspace* ws = new cpu::AttentionWorkspace();
  core::AttentionParams p;
  p.q = q; p.q_stride_token = H * D; p.q_stride_head = D; p.out = out; p.out_stride_token = H * D; p.out_stride_head = D;
  p.io_dtype = DType::kBFloat16; p.k = k; p.v = v; p.k_stride_token = KH * D; p.k_stride_head = D; p.v_stride_token = KH * D; p.v_stride_head = D;
  p.kv_dtype = DType::kBFloat16; p.batch_size = batch; p.qo_indptr = qo; p.kv_indptr = kvp; p.kv_indices = idx; p.num_slots = slots;
  p.mask = causal ? core::MaskMode::kCausal : core::MaskMode::kNone; p.sm_scale = 1.f / std::sqrt(float(D));
  p.num_q_heads = H; p.num_kv_heads = KH; p.head_dim = D; p.v_head_dim = D;
  const auto t0 = std::chrono::steady_clock::now();
  cpu::run_attention(p, DType::kBFloat16, *pool, *ws);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
