#include "cpu/kv_write.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu/row_convert.h"
#include "kvattn/error.h"

namespace kvattn::cpu {
namespace {

// Below this many tokens the write runs on the calling thread: waking the pool costs more.
// (A decode step writes batch_size rows; a 4096-token prefill is worth splitting.)
constexpr int64_t kParallelWriteTokens = 1024;

// Where head h of token t starts, for a [n, heads, dim] or [n, heads * dim] view.
struct RowLayout {
  const char* base;
  int64_t token_stride_bytes;
  int64_t head_stride_bytes;
};

RowLayout row_layout(const TensorView& t, int dim) {
  const int64_t element = dtype_size(t.dtype());
  const int64_t head_stride = t.ndim() == 3 ? t.stride(1) : dim;
  return {static_cast<const char*>(t.data()), t.stride(0) * element, head_stride * element};
}

// Writes one tensor's rows (K or V) for tokens [begin, end).
void write_rows(const TensorView& src, const RowLayout& layout, const std::vector<int64_t>& slots,
                int64_t begin, int64_t end, const TensorView& buffer, int dim, float scale,
                std::vector<float>& scratch) {
  const DType src_dtype = src.dtype();
  const DType dst_dtype = buffer.dtype();
  const int num_heads = int(buffer.size(1));
  const int64_t dst_element = dtype_size(dst_dtype);
  const int64_t dst_slot_bytes = int64_t(num_heads) * dim * dst_element;
  char* dst_base = static_cast<char*>(buffer.data());
  const bool fp8 = is_fp8_dtype(dst_dtype);
  scratch.resize(size_t(dim));
  for (int64_t t = begin; t < end; ++t) {
    char* dst_slot = dst_base + slots[size_t(t)] * dst_slot_bytes;
    for (int h = 0; h < num_heads; ++h) {
      const char* src_row = layout.base + t * layout.token_stride_bytes + h * layout.head_stride_bytes;
      char* dst_row = dst_slot + int64_t(h) * dim * dst_element;
      if (src_dtype == dst_dtype) {
        std::memcpy(dst_row, src_row, size_t(dim) * size_t(dst_element));
        continue;
      }
      load_row(src_row, src_dtype, dim, 1.f, scratch.data());
      if (fp8) {
        // Divide (not multiply by 1/scale) so the stored code is exactly round(x / scale).
        for (int i = 0; i < dim; ++i) scratch[size_t(i)] /= scale;
      }
      store_row(scratch.data(), dim, dst_dtype, dst_row);
    }
  }
}

}  // namespace

void write_kv(const TensorView& k, const TensorView& v, const TensorView& loc,
              const std::string& loc_name, const TensorView& k_buffer, const TensorView& v_buffer,
              float k_scale, float v_scale, ThreadPool& pool) {
  const int64_t num_new = loc.numel();
  const int64_t num_slots = k_buffer.size(0);
  const int num_kv_heads = int(k_buffer.size(1));
  const int head_dim = int(k_buffer.size(2));
  const int v_head_dim = int(v_buffer.size(2));
  check_arg(k.ndim() >= 2 && k.size(0) == num_new, "k", "shape ", k, ", expected ",
            num_new, " rows (one per ", loc_name, " entry)");
  check_arg(v.ndim() >= 2 && v.size(0) == num_new, "v", "shape ", v, ", expected ",
            num_new, " rows (one per ", loc_name, " entry)");
  check_arg(k.dtype() == v.dtype(), "v", "dtype ", dtype_name(v.dtype()), ", expected k's ",
            dtype_name(k.dtype()));
  check_arg(is_float_dtype(k.dtype()) && !is_fp8_dtype(k.dtype()), "k", "dtype ",
            dtype_name(k.dtype()), ", expected fp32, bf16 or fp16");
  check_arg(k.numel() == num_new * num_kv_heads * head_dim, "k", "shape ", k,
            ", expected [", num_new, ", ", num_kv_heads, ", ", head_dim, "]");
  check_arg(v.numel() == num_new * num_kv_heads * v_head_dim, "v", "shape ", v,
            ", expected [", num_new, ", ", num_kv_heads, ", ", v_head_dim, "]");
  if (is_fp8_dtype(k_buffer.dtype())) {
    check_arg(k_scale > 0.f, "k_scale", "got ", k_scale, ", expected > 0 for fp8 storage");
    check_arg(v_scale > 0.f, "v_scale", "got ", v_scale, ", expected > 0 for fp8 storage");
  }
  // Every slot first: nothing is written unless all of them are inside the pool.
  std::vector<int64_t> slots(static_cast<size_t>(num_new));
  for (int64_t t = 0; t < num_new; ++t) {
    const int64_t slot = read_index(loc, t);
    check_arg(slot >= 0 && slot < num_slots, loc_name + "[" + std::to_string(t) + "]", "slot ",
              slot, " outside the pool [0, ", num_slots, ")");
    slots[size_t(t)] = slot;
  }
  const RowLayout k_layout = row_layout(k, head_dim);
  const RowLayout v_layout = row_layout(v, v_head_dim);
  auto write_range = [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    write_rows(k, k_layout, slots, begin, end, k_buffer, head_dim, k_scale, scratch);
    write_rows(v, v_layout, slots, begin, end, v_buffer, v_head_dim, v_scale, scratch);
  };
  if (num_new < kParallelWriteTokens || pool.size() == 1) {
    write_range(0, num_new);
    return;
  }
  // Contiguous token ranges per index. Two tokens may share a slot only when both are padding
  // (slot 0), whose contents nobody reads.
  const int64_t num_chunks = int64_t(pool.size()) * 4;
  const int64_t chunk = (num_new + num_chunks - 1) / num_chunks;
  pool.parallel_for(num_chunks, [&](int64_t index, int) {
    const int64_t begin = index * chunk;
    const int64_t end = std::min(num_new, begin + chunk);
    if (begin < end) write_range(begin, end);
  });
}

}  // namespace kvattn::cpu
