// CUDA graphs on the device (issue 6). A world of fixed engine buffers (q/k/v/out per layer,
// req_pool_indices, seq_lens, out_cache_loc, tree mask, positions) is captured once per
// batch-size bucket (init_forward_metadata_out_graph with in_capture, then in_graph and the
// layers inside the capture) and replayed for random batches of that bucket: other lengths
// (kv_len 1, split-KV lengths, padded entries), other tree masks and positions. Every replay is
// compared bit for bit with an eager run of a fresh backend on the same inputs, and some with the
// CPU backend within the bf16 error bar. Covered: DECODE on the CUDA-core and the tensor-core
// kernels (page 1 and 16, fp16, fp8, GQA group 8, fp32 io, a window model's two index sets),
// TARGET_VERIFY (window layers fold the tree mask on the device, fp32 io, fp8), the multi-step
// draft, nothing allocating during replay, and the refusals. Skips without a CUDA device.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda/bench_support.h"
#include "cuda/cuda_backend.h"
#include "cuda/cuda_test_support.h"
#include "kvattn/kvattn.h"
#include "reference/float_format.h"
#include "reference/scenario.h"

namespace kvattn::testing {
namespace {

void cuda_check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
  }
}

// ---- the world ---------------------------------------------------------------------------------

struct WorldSpec {
  std::string label;
  int max_bs = 8;
  int max_context = 4096;  ///< req_to_token columns (every position of every row holds a slot)
  int num_q_heads = 32;
  int num_kv_heads = 8;
  int head_dim = 128;
  DType io = DType::kBFloat16;
  DType kv = DType::kBFloat16;
  int page_size = 1;
  int window = -1;          ///< the model's window: layer 0 is a window layer, layer 1 full
  int draft_token_num = 0;  ///< TARGET_VERIFY worlds
  int topk = 0;             ///< multi-step draft worlds
  int num_steps = 0;
  const char* tensor_cores = nullptr;  ///< KVATTN_DECODE_TENSOR_CORES for this world's backends
  uint64_t seed = 1;
};

constexpr int kLayers = 2;

// One step of a bucket: `real` requests with their lengths, then padded entries (seq_len = the
// fill value, the padding row whose slots are all 0, out_cache_loc 0).
struct Step {
  ForwardMode mode = ForwardMode::kDecode;
  int batch_size = 0;
  int real = 0;
  std::vector<int32_t> rows;       ///< [batch_size] req_to_token rows
  std::vector<int32_t> seq;        ///< [batch_size] seq_lens
  std::vector<uint8_t> mask;       ///< TARGET_VERIFY tree mask (SpecInfo layout)
  std::vector<int64_t> positions;  ///< TARGET_VERIFY [batch_size * draft] tree positions
  int64_t num_tokens = 0;          ///< query rows of one layer (draft: of one draft step)
  int64_t real_tokens = 0;         ///< the first real_tokens rows belong to real requests
};

/// Fixed engine buffers over a shuffled paged pool (the addresses a captured graph holds).
class GraphWorld {
 public:
  explicit GraphWorld(const WorldSpec& spec) : spec_(spec), rng_(spec.seed * 7919 + 17) {
    const Device gpu = Device::cuda(0);
    const int page = spec.page_size;
    const int64_t pages_per_row = (spec.max_context + page - 1) / page;
    KvCacheConfig kc;
    kc.num_layers = kLayers;
    kc.num_slots = (1 + int64_t(spec.max_bs) * pages_per_row) * page;
    kc.num_kv_heads = spec.num_kv_heads;
    kc.head_dim = spec.head_dim;
    kc.page_size = page;
    kc.dtype = spec.kv;
    kc.device = gpu;
    cache_.emplace(KvCache::allocate(kc));
    const bool fp8 = spec.kv == DType::kFloat8E4M3 || spec.kv == DType::kFloat8E5M2;
    if (fp8) {
      cache_->set_scales(0, 0.5f, 2.0f);
      cache_->set_scales(1, 1.5f, 0.75f);
    }
    cuda_check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "stream");
    uint64_t fill_seed = spec.seed * 1000003;
    for (int l = 0; l < kLayers; ++l) {
      cuda::bench::fill_random(cache_->k_buffer(l), fill_seed++, 1.f, stream_);
      cuda::bench::fill_random(cache_->v_buffer(l), fill_seed++, 1.f, stream_);
    }

    // Rows 0..max_bs-1 own shuffled pages; row max_bs is the padding row (slot 0 throughout).
    pad_row_ = spec.max_bs;
    SlotAllocator allocator(kc.num_slots, page);
    std::vector<int32_t> pages = allocator.allocate_pages(int64_t(spec.max_bs) * pages_per_row);
    std::shuffle(pages.begin(), pages.end(), rng_);
    table_.assign(size_t(spec.max_bs + 1) * spec.max_context, 0);
    for (int r = 0; r < spec.max_bs; ++r) {
      for (int i = 0; i < spec.max_context; ++i) {
        table_[size_t(r) * spec.max_context + i] =
            pages[size_t(r * pages_per_row + i / page)] * page + i % page;
      }
    }
    pool_.emplace(ReqToTokenPool::allocate(spec.max_bs + 1, spec.max_context, gpu));
    for (int r = 0; r <= spec.max_bs; ++r) {
      pool_->write(r, 0,
                   std::span<const int32_t>(table_.data() + size_t(r) * spec.max_context,
                                            size_t(spec.max_context)));
    }

    // The largest step: verify has draft tokens a request, the draft topk a request and step.
    const int per_request = std::max({1, spec.draft_token_num, spec.topk});
    max_tokens_ = int64_t(spec.max_bs) * per_request;
    const int v_dim = spec.head_dim;
    const int calls = spec.topk > 0 ? spec.num_steps : kLayers;
    for (int c = 0; c < calls; ++c) {
      q_.push_back(allocate(max_tokens_ * spec.num_q_heads * spec.head_dim * dtype_size(spec.io)));
      k_.push_back(allocate(max_tokens_ * spec.num_kv_heads * spec.head_dim * dtype_size(spec.io)));
      v_.push_back(allocate(max_tokens_ * spec.num_kv_heads * v_dim * dtype_size(spec.io)));
      out_.push_back(allocate(max_tokens_ * spec.num_q_heads * v_dim * dtype_size(spec.io)));
      out_eager_.push_back(allocate(max_tokens_ * spec.num_q_heads * v_dim * dtype_size(spec.io)));
      loc_.push_back(allocate(max_tokens_ * sizeof(int32_t)));
    }
    rpi_ = allocate(spec.max_bs * sizeof(int32_t));
    seq_ = allocate(spec.max_bs * sizeof(int32_t));
    seq_host_.assign(size_t(spec.max_bs), 0);
    mask_ = allocate(std::max<int64_t>(1, max_tokens_ * spec.max_context));
    positions_ = allocate(std::max<int64_t>(1, max_tokens_) * sizeof(int64_t));

    cuda_check(cudaDeviceSynchronize(), "world");
    config_.kv_cache = &*cache_;
    config_.req_to_token_pool = &*pool_;
    config_.num_q_heads = spec.num_q_heads;
    config_.num_kv_heads = spec.num_kv_heads;
    config_.head_dim = spec.head_dim;
    config_.q_dtype = spec.io;
    config_.sliding_window_size = spec.window;
    config_.cuda_stream = stream_;
  }

  ~GraphWorld() {
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }

  const WorldSpec& spec() const { return spec_; }
  cudaStream_t stream() const { return stream_; }
  const BackendConfig& config() const { return config_; }

  std::unique_ptr<AttentionBackend> make_cuda_backend() const {
    TensorCoreChoice choice(spec_.tensor_cores);
    return make_backend(BackendKind::kCuda, config_);
  }
  std::unique_ptr<MultiStepDraftBackend> make_cuda_draft() const {
    TensorCoreChoice choice(spec_.tensor_cores);
    return std::make_unique<MultiStepDraftBackend>(BackendKind::kCuda, config_, spec_.topk,
                                                   spec_.num_steps);
  }

  AttentionLayer layer(int l) const {
    AttentionLayer layer;
    layer.layer_id = l;
    layer.num_q_heads = spec_.num_q_heads;
    layer.num_kv_heads = spec_.num_kv_heads;
    layer.head_dim = spec_.head_dim;
    layer.scaling = float(1.0 / std::sqrt(double(spec_.head_dim)));
    layer.sliding_window_size = (spec_.window >= 0 && l == 0) ? spec_.window : -1;
    return layer;
  }

  /// A random step of a bucket: `real` requests (kv_len 1, a long split-KV one, random ones) and
  /// batch_size - real padded entries.
  Step random_step(ForwardMode mode, int batch_size, int real) {
    Step s;
    s.mode = mode;
    s.batch_size = batch_size;
    s.real = real;
    const int extra = mode == ForwardMode::kTargetVerify ? spec_.draft_token_num
                      : spec_.topk > 0                   ? spec_.num_steps * spec_.topk
                                                         : 0;
    const int longest = spec_.max_context - extra;
    const int fill = 0;  // the backend's cuda_graph_seq_len_fill_value (checked by the tests)
    std::vector<int32_t> rows(size_t(spec_.max_bs));
    for (int r = 0; r < spec_.max_bs; ++r) rows[size_t(r)] = r;
    std::shuffle(rows.begin(), rows.end(), rng_);
    const int min_len = mode == ForwardMode::kDecode && spec_.topk == 0 ? 1 : 0;
    for (int r = 0; r < batch_size; ++r) {
      if (r < real) {
        s.rows.push_back(rows[size_t(r)]);
        int len = uniform(min_len, longest);
        if (r == 0) len = std::max(min_len, 1);     // kv_len 1 (verify/draft: a one-token prefix)
        if (r == 1) len = longest - uniform(0, 7);  // long: split-KV at small batches
        if (r == 2) len = uniform(min_len, 40);     // short
        s.seq.push_back(len);
      } else {
        s.rows.push_back(pad_row_);
        s.seq.push_back(fill);
      }
    }
    const int per_request = mode == ForwardMode::kTargetVerify ? spec_.draft_token_num
                            : spec_.topk > 0                   ? spec_.topk
                                                               : 1;
    s.num_tokens = int64_t(batch_size) * per_request;
    s.real_tokens = int64_t(real) * per_request;
    if (mode == ForwardMode::kTargetVerify) {
      const int n = spec_.draft_token_num;
      for (int r = 0; r < batch_size; ++r) {
        // A random tree (parent of token i among 0..i-1), its rows see the prefix and ancestors.
        std::vector<int> parent(size_t(n), -1), depth(size_t(n), 0);
        for (int i = 1; i < n; ++i) {
          parent[size_t(i)] = uniform(0, i - 1);
          depth[size_t(i)] = depth[size_t(parent[size_t(i)])] + 1;
        }
        const int64_t kv_len = int64_t(s.seq[size_t(r)]) + n;
        for (int i = 0; i < n; ++i) {
          std::vector<uint8_t> row(size_t(kv_len), 0);
          std::fill(row.begin(), row.begin() + s.seq[size_t(r)], 1);
          for (int a = i; a >= 0; a = parent[size_t(a)]) row[size_t(s.seq[size_t(r)] + a)] = 1;
          s.mask.insert(s.mask.end(), row.begin(), row.end());
          s.positions.push_back(int64_t(s.seq[size_t(r)]) + depth[size_t(i)]);
        }
      }
    }
    return s;
  }

  /// Writes a step into the fixed buffers and draws fresh q/k/v.
  void upload(const Step& s) {
    copy_bytes(rpi_.data(), Device::cuda(0), s.rows.data(), Device::cpu(),
               s.rows.size() * sizeof(int32_t));
    copy_bytes(seq_.data(), Device::cuda(0), s.seq.data(), Device::cpu(),
               s.seq.size() * sizeof(int32_t));
    std::copy(s.seq.begin(), s.seq.end(), seq_host_.begin());
    if (!s.mask.empty()) {
      copy_bytes(mask_.data(), Device::cuda(0), s.mask.data(), Device::cpu(), s.mask.size());
      copy_bytes(positions_.data(), Device::cuda(0), s.positions.data(), Device::cpu(),
                 s.positions.size() * sizeof(int64_t));
    }
    const int calls = int(q_.size());
    for (int c = 0; c < calls; ++c) {
      const std::vector<int32_t> loc = cache_locations(s, c);
      copy_bytes(loc_[size_t(c)].data(), Device::cuda(0), loc.data(), Device::cpu(),
                 loc.size() * sizeof(int32_t));
      const uint64_t seed = rng_();
      cuda::bench::fill_random(q(c, s.num_tokens), seed, 1.f, stream_);
      cuda::bench::fill_random(k(c, s.num_tokens), seed + 1, 1.f, stream_);
      cuda::bench::fill_random(v(c, s.num_tokens), seed + 2, 1.f, stream_);
    }
    // copy_bytes queues on the legacy default stream, which does not order the non-blocking
    // stream the backends run on: wait for every copy before the step runs.
    cuda_check(cudaDeviceSynchronize(), "upload");
  }

  /// The step's batch: views of the fixed buffers (the same addresses at every step).
  ForwardBatch batch(const Step& s) const {
    ForwardBatch b;
    b.mode = s.mode;
    b.batch_size = s.batch_size;
    b.req_pool_indices = TensorView(rpi_.data(), DType::kInt32, Device::cuda(0), {s.batch_size});
    b.seq_lens = TensorView(seq_.data(), DType::kInt32, Device::cuda(0), {s.batch_size});
    b.seq_lens_cpu = TensorView(const_cast<int32_t*>(seq_host_.data()), DType::kInt32,
                                Device::cpu(), {s.batch_size});
    if (spec_.topk == 0) {
      b.out_cache_loc = TensorView(loc_[0].data(), DType::kInt32, Device::cuda(0), {s.num_tokens});
    }
    if (s.mode == ForwardMode::kTargetVerify) {
      b.spec.draft_token_num = spec_.draft_token_num;
      b.spec.custom_mask =
          TensorView(mask_.data(), DType::kUInt8, Device::cuda(0), {int64_t(s.mask.size())});
      b.positions = TensorView(positions_.data(), DType::kInt64, Device::cuda(0), {s.num_tokens});
    }
    b.kv_cache = const_cast<KvCache*>(&*cache_);
    b.req_to_token_pool = &*pool_;
    return b;
  }

  TensorView q(int c, int64_t n) const {
    return TensorView(q_[size_t(c)].data(), spec_.io, Device::cuda(0),
                      {n, spec_.num_q_heads, spec_.head_dim});
  }
  TensorView k(int c, int64_t n) const {
    return TensorView(k_[size_t(c)].data(), spec_.io, Device::cuda(0),
                      {n, spec_.num_kv_heads, spec_.head_dim});
  }
  TensorView v(int c, int64_t n) const {
    return TensorView(v_[size_t(c)].data(), spec_.io, Device::cuda(0),
                      {n, spec_.num_kv_heads, spec_.head_dim});
  }
  TensorView out(int c, int64_t n, bool eager) const {
    return TensorView((eager ? out_eager_ : out_)[size_t(c)].data(), spec_.io, Device::cuda(0),
                      {n, spec_.num_q_heads, spec_.head_dim});
  }
  TensorView loc(int c, int64_t n) const {
    return TensorView(loc_[size_t(c)].data(), DType::kInt32, Device::cuda(0), {n});
  }

  /// Every layer's forward (one layer a call) on `backend`, into the graph or the eager outputs.
  void run_layers(AttentionBackend& backend, const ForwardBatch& b, const Step& s,
                  bool eager) const {
    for (int l = 0; l < kLayers; ++l) {
      backend.forward(q(l, s.num_tokens), k(l, s.num_tokens), v(l, s.num_tokens),
                      out(l, s.num_tokens, eager), layer(l), b, /*save_kv_cache=*/true);
    }
  }
  /// Every draft step (layer 1) on `draft`.
  void run_draft_steps(MultiStepDraftBackend& draft, const Step& s, bool eager) const {
    for (int step = 0; step < spec_.num_steps; ++step) {
      draft.forward_step(step, q(step, s.num_tokens), k(step, s.num_tokens), v(step, s.num_tokens),
                         out(step, s.num_tokens, eager), layer(1), loc(step, s.num_tokens));
    }
  }

  /// The bytes of the first `rows` query rows of call c's graph or eager output.
  std::vector<uint8_t> output_bytes(int c, int64_t rows, bool eager) const {
    const size_t row_bytes = size_t(spec_.num_q_heads) * spec_.head_dim * dtype_size(spec_.io);
    std::vector<uint8_t> bytes(size_t(rows) * row_bytes);
    cuda_check(cudaStreamSynchronize(stream_), "sync");
    copy_bytes(bytes.data(), Device::cpu(), (eager ? out_eager_ : out_)[size_t(c)].data(),
               Device::cuda(0), bytes.size());
    return bytes;
  }

  /// Max relative error (per (token, head) row, against the row's max |cpu|) of call c's graph
  /// output over the real rows, against the CPU backend run on a host copy of the pool as it is
  /// now (the step's K/V already saved).
  double cpu_error(const Step& s, int c) const {
    KvCacheConfig kc = cache_->config();
    kc.device = Device::cpu();
    KvCache host_cache = KvCache::allocate(kc);
    for (int l = 0; l < kLayers; ++l) {
      const TensorView& kd = cache_->k_buffer(l);
      const TensorView& vd = cache_->v_buffer(l);
      copy_bytes(host_cache.k_buffer(l).data(), Device::cpu(), kd.data(), kd.device(),
                 size_t(kd.nbytes()));
      copy_bytes(host_cache.v_buffer(l).data(), Device::cpu(), vd.data(), vd.device(),
                 size_t(vd.nbytes()));
      host_cache.set_scales(l, cache_->k_scale(l), cache_->v_scale(l));
    }
    ReqToTokenPool host_pool =
        ReqToTokenPool::allocate(spec_.max_bs + 1, spec_.max_context, Device::cpu());
    for (int r = 0; r <= spec_.max_bs; ++r) {
      host_pool.write(r, 0,
                      std::span<const int32_t>(table_.data() + size_t(r) * spec_.max_context,
                                               size_t(spec_.max_context)));
    }
    BackendConfig hc = config_;
    hc.kv_cache = &host_cache;
    hc.req_to_token_pool = &host_pool;
    hc.cuda_stream = nullptr;

    std::vector<int32_t> rows = s.rows, seq = s.seq;
    std::vector<uint8_t> mask = s.mask;
    std::vector<int64_t> positions = s.positions;
    ForwardBatch hb;
    hb.mode = s.mode;
    hb.batch_size = s.batch_size;
    hb.req_pool_indices = TensorView(rows.data(), DType::kInt32, Device::cpu(), {s.batch_size});
    hb.seq_lens = TensorView(seq.data(), DType::kInt32, Device::cpu(), {s.batch_size});
    hb.seq_lens_cpu = hb.seq_lens;
    if (s.mode == ForwardMode::kTargetVerify) {
      hb.spec.draft_token_num = spec_.draft_token_num;
      hb.spec.custom_mask =
          TensorView(mask.data(), DType::kUInt8, Device::cpu(), {int64_t(mask.size())});
      hb.positions = TensorView(positions.data(), DType::kInt64, Device::cpu(), {s.num_tokens});
    }
    hb.kv_cache = &host_cache;
    hb.req_to_token_pool = &host_pool;

    const size_t elems = size_t(s.num_tokens) * spec_.num_q_heads * spec_.head_dim;
    std::vector<uint8_t> q_host(elems * dtype_size(spec_.io));
    cuda_check(cudaStreamSynchronize(stream_), "sync");
    copy_bytes(q_host.data(), Device::cpu(), q_[size_t(c)].data(), Device::cuda(0), q_host.size());
    std::vector<uint8_t> out_host(elems * dtype_size(spec_.io), 0);
    const TensorView qh(q_host.data(), spec_.io, Device::cpu(),
                        {s.num_tokens, spec_.num_q_heads, spec_.head_dim});
    const TensorView oh(out_host.data(), spec_.io, Device::cpu(),
                        {s.num_tokens, spec_.num_q_heads, spec_.head_dim});
    if (spec_.topk > 0) {
      MultiStepDraftBackend cpu_draft(BackendKind::kCpu, hc, spec_.topk, spec_.num_steps);
      cpu_draft.init_forward_metadata(hb);
      cpu_draft.forward_step(c, qh, {}, {}, oh, layer(1), {});
    } else {
      auto cpu = make_backend(BackendKind::kCpu, hc);
      cpu->init_forward_metadata(hb);
      cpu->forward(qh, {}, {}, oh, layer(c), hb, /*save_kv_cache=*/false);
    }
    const std::vector<uint8_t> gpu = output_bytes(c, s.num_tokens, false);
    double worst = 0;
    const int dim = spec_.head_dim;
    for (int64_t row = 0; row < s.real_tokens * spec_.num_q_heads; ++row) {
      double ref_max = 0, diff_max = 0;
      for (int d = 0; d < dim; ++d) {
        const int64_t i = row * dim + d;
        const double want = decode_element(out_host.data(), spec_.io, i);
        const double got = decode_element(gpu.data(), spec_.io, i);
        ref_max = std::max(ref_max, std::fabs(want));
        diff_max = std::isfinite(got) ? std::max(diff_max, std::fabs(got - want)) : INFINITY;
      }
      worst = std::max(worst, diff_max / std::max(ref_max, 1e-6));
    }
    return worst;
  }

  int pad_row() const { return pad_row_; }
  const KvCache& cache() const { return *cache_; }
  ReqToTokenPool& pool() { return *pool_; }
  /// Slot the step's (host) req_to_token names at row, position.
  int32_t table_slot(int row, int64_t position) const {
    return table_[size_t(row) * spec_.max_context + size_t(position)];
  }
  /// Overwrites entry i of call c's out_cache_loc / of req_pool_indices (fixed buffers).
  void set_loc(int c, int64_t i, int32_t value) {
    copy_bytes(static_cast<int32_t*>(loc_[size_t(c)].data()) + i, Device::cuda(0), &value,
               Device::cpu(), sizeof(value));
  }
  void set_row(int64_t i, int32_t value) {
    copy_bytes(static_cast<int32_t*>(rpi_.data()) + i, Device::cuda(0), &value, Device::cpu(),
               sizeof(value));
  }
  /// Every layer's K and V, on the host.
  std::vector<std::vector<uint8_t>> pool_bytes() const {
    std::vector<std::vector<uint8_t>> out;
    cuda_check(cudaDeviceSynchronize(), "sync");
    for (int l = 0; l < kLayers; ++l) {
      for (const TensorView* t : {&cache_->k_buffer(l), &cache_->v_buffer(l)}) {
        std::vector<uint8_t> bytes(size_t(t->nbytes()));
        copy_bytes(bytes.data(), Device::cpu(), t->data(), t->device(), bytes.size());
        out.push_back(std::move(bytes));
      }
    }
    return out;
  }
  std::vector<int32_t> table_now() const {
    std::vector<int32_t> out(table_.size());
    copy_bytes(out.data(), Device::cpu(), pool_->table().data(), Device::cuda(0),
               out.size() * sizeof(int32_t));
    return out;
  }

 private:
  Buffer allocate(int64_t bytes) { return Buffer::allocate(Device::cuda(0), size_t(bytes)); }
  int uniform(int lo, int hi) {
    if (hi <= lo) return lo;
    return std::uniform_int_distribution<int>(lo, hi)(rng_);
  }

  // Where call c saves its K/V: decode the last token's slot, verify the tree tokens', draft
  // step c the branches' tokens of step c; padded entries slot 0.
  std::vector<int32_t> cache_locations(const Step& s, int c) const {
    std::vector<int32_t> loc;
    const int64_t width = spec_.max_context;
    auto slot = [&](int r, int64_t position) -> int32_t {
      if (s.rows[size_t(r)] == pad_row_) return 0;
      return table_[size_t(s.rows[size_t(r)] * width + position)];
    };
    for (int r = 0; r < s.batch_size; ++r) {
      const int64_t seq = s.seq[size_t(r)];
      if (s.mode == ForwardMode::kTargetVerify) {
        for (int i = 0; i < spec_.draft_token_num; ++i) loc.push_back(slot(r, seq + i));
      } else if (spec_.topk > 0) {
        for (int b = 0; b < spec_.topk; ++b)
          loc.push_back(slot(r, seq + int64_t(c) * spec_.topk + b));
      } else {
        loc.push_back(seq > 0 ? slot(r, seq - 1) : 0);
      }
    }
    return loc;
  }

  WorldSpec spec_;
  std::mt19937_64 rng_;
  cudaStream_t stream_ = nullptr;
  std::optional<KvCache> cache_;
  std::optional<ReqToTokenPool> pool_;
  std::vector<int32_t> table_;  ///< host copy of req_to_token
  int pad_row_ = 0;
  int64_t max_tokens_ = 0;
  BackendConfig config_;
  std::vector<Buffer> q_, k_, v_, out_, out_eager_, loc_;
  Buffer rpi_, seq_, mask_, positions_;
  std::vector<int32_t> seq_host_;
};

// A captured graph that destroys itself.
class Graph {
 public:
  Graph() = default;
  ~Graph() { reset(); }
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
  void reset() {
    if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
    exec_ = nullptr;
  }
  void set(cudaGraph_t graph) {
    reset();
    const cudaError_t status = cudaGraphInstantiate(&exec_, graph, 0);
    cudaGraphDestroy(graph);
    cuda_check(status, "cudaGraphInstantiate");
  }
  void launch(cudaStream_t stream) const { cuda_check(cudaGraphLaunch(exec_, stream), "launch"); }

 private:
  cudaGraphExec_t exec_ = nullptr;
};

// Records `body` on the world's stream (thread-local mode: a synchronizing or allocating CUDA
// call from this thread inside the capture fails it).
template <typename Body>
void capture(const GraphWorld& w, Graph& graph, Body body) {
  cuda_check(cudaStreamBeginCapture(w.stream(), cudaStreamCaptureModeThreadLocal), "capture");
  try {
    body();
  } catch (...) {
    cudaGraph_t partial = nullptr;
    cudaStreamEndCapture(w.stream(), &partial);
    if (partial != nullptr) cudaGraphDestroy(partial);
    cudaGetLastError();
    throw;
  }
  cudaGraph_t recorded = nullptr;
  cuda_check(cudaStreamEndCapture(w.stream(), &recorded), "cudaStreamEndCapture");
  graph.set(recorded);
}

// Captures one bucket of an AttentionBackend (DECODE or TARGET_VERIFY): out_graph with
// in_capture outside, in_graph and the layers inside.
void capture_bucket(GraphWorld& w, AttentionBackend& backend, const Step& s, Graph& graph) {
  w.upload(s);
  const ForwardBatch b = w.batch(s);
  backend.init_forward_metadata_out_graph(b, /*in_capture=*/true);
  capture(w, graph, [&] {
    backend.init_forward_metadata_in_graph(b);
    w.run_layers(backend, b, s, /*eager=*/false);
  });
}

// One replay and its eager twin on a fresh backend; returns whether every real row of every
// layer matched bit for bit.
bool replay_and_compare(GraphWorld& w, AttentionBackend& graph_backend, const Graph& graph,
                        const Step& s, const char* what) {
  w.upload(s);
  const ForwardBatch b = w.batch(s);
  graph_backend.init_forward_metadata_out_graph(b, /*in_capture=*/false);
  graph.launch(w.stream());
  cuda_check(cudaStreamSynchronize(w.stream()), "replay");
  auto eager = w.make_cuda_backend();
  eager->init_forward_metadata(b);
  w.run_layers(*eager, b, s, /*eager=*/true);
  cuda_check(cudaStreamSynchronize(w.stream()), "eager");
  bool same = true;
  for (int l = 0; l < kLayers; ++l) {
    const std::vector<uint8_t> g = w.output_bytes(l, s.real_tokens, false);
    const std::vector<uint8_t> e = w.output_bytes(l, s.real_tokens, true);
    if (g != e) {
      size_t first = 0;
      while (first < g.size() && g[first] == e[first]) ++first;
      ADD_FAILURE() << w.spec().label << " " << what << ": bucket " << s.batch_size << " ("
                    << s.real << " real), layer " << l << ": replay differs from eager at byte "
                    << first << " of " << g.size();
      same = false;
    }
  }
  return same;
}

// The whole protocol for one world and mode: per bucket, capture once, replay `steps` random
// batches (other lengths, masks, padding); every replay bit-equal to eager; the first and last
// replay of each bucket also against the CPU backend.
void check_buckets(const WorldSpec& spec, ForwardMode mode, const std::vector<int>& buckets,
                   int steps) {
  GraphWorld w(spec);
  auto backend = w.make_cuda_backend();
  EXPECT_EQ(backend->cuda_graph_seq_len_fill_value(), 0);
  const int per_request = mode == ForwardMode::kTargetVerify ? spec.draft_token_num : 1;
  backend->init_cuda_graph_state(spec.max_bs, int64_t(spec.max_bs) * per_request);
  const double tolerance = tolerance_for(spec.io, spec.kv);
  for (int bs : buckets) {
    Graph graph;
    capture_bucket(w, *backend, w.random_step(mode, bs, bs), graph);
    for (int t = 0; t < steps; ++t) {
      // Full buckets and partly padded ones (an engine pads a batch up to its bucket).
      const int real = t % 2 == 0 ? bs : std::max(1, bs - 1 - t % std::max(1, bs - 1));
      const Step s = w.random_step(mode, bs, real);
      replay_and_compare(w, *backend, graph, s, forward_mode_name(mode));
      if (t == 0 || t == steps - 1) {
        // The eager twin saved the same K/V again: the pool is the replay's.
        for (int l = 0; l < kLayers; ++l) {
          const double err = w.cpu_error(s, l);
          EXPECT_LE(err, tolerance) << spec.label << " " << forward_mode_name(mode) << " bucket "
                                    << bs << " layer " << l << " vs the CPU backend";
          std::printf("  %-28s %-13s bucket %3d real %3d layer %d: cpu err %.2e\n",
                      spec.label.c_str(), forward_mode_name(mode), bs, s.real, l, err);
        }
      }
    }
  }
}

WorldSpec decode_world(const char* label, const char* kernel, uint64_t seed) {
  WorldSpec w;
  w.label = label;
  w.tensor_cores = kernel;
  w.seed = seed;
  return w;
}

// ---- DECODE ------------------------------------------------------------------------------------

TEST(CudaGraphsDecode, ReplayEqualsEagerCudaCoreKernel) {
  REQUIRE_GPU();
  check_buckets(decode_world("bf16 page1 cuda-core", "0", 11), ForwardMode::kDecode, {1, 2, 8}, 4);
}

TEST(CudaGraphsDecode, ReplayEqualsEagerTensorCoreKernel) {
  REQUIRE_GPU();
  check_buckets(decode_world("bf16 page1 tensor", "1", 12), ForwardMode::kDecode, {1, 2, 8}, 4);
}

TEST(CudaGraphsDecode, VariantsOnBothKernels) {
  REQUIRE_GPU();
  std::vector<WorldSpec> worlds;
  for (const char* kernel : {"0", "1"}) {
    const bool tensor = kernel[0] == '1';
    WorldSpec page16 =
        decode_world(tensor ? "page16 fp16 tensor" : "page16 fp16 cuda-core", kernel, 21);
    page16.page_size = 16;
    page16.io = DType::kFloat16;
    page16.kv = DType::kFloat16;
    page16.max_context = 2048;
    worlds.push_back(page16);
    WorldSpec window =
        decode_world(tensor ? "window 300 tensor" : "window 300 cuda-core", kernel, 22);
    window.window = 300;
    window.max_context = 2048;
    worlds.push_back(window);
  }
  WorldSpec fp8 = decode_world("fp8 e4m3 (auto: cuda-core)", nullptr, 23);
  fp8.kv = DType::kFloat8E4M3;
  fp8.max_context = 2048;
  worlds.push_back(fp8);
  WorldSpec fp8_tensor = decode_world("fp8 e4m3 tensor", "1", 27);
  fp8_tensor.kv = DType::kFloat8E4M3;
  fp8_tensor.max_context = 2048;
  worlds.push_back(fp8_tensor);
  WorldSpec group8 = decode_world("group 8 (auto: tensor)", nullptr, 24);
  group8.num_q_heads = 64;
  group8.max_context = 2048;
  worlds.push_back(group8);
  WorldSpec fp32 = decode_world("fp32 io cuda-core", "0", 25);
  fp32.io = DType::kFloat32;
  fp32.max_context = 2048;
  worlds.push_back(fp32);
  WorldSpec hd64 = decode_world("head_dim 64 tensor", "1", 26);
  hd64.head_dim = 64;
  hd64.max_context = 2048;
  worlds.push_back(hd64);
  for (const WorldSpec& spec : worlds) {
    SCOPED_TRACE(spec.label);
    check_buckets(spec, ForwardMode::kDecode, {3, 8}, 2);
  }
}

// ---- TARGET_VERIFY -----------------------------------------------------------------------------

WorldSpec verify_world(const char* label, uint64_t seed) {
  WorldSpec w;
  w.label = label;
  w.draft_token_num = 6;
  w.max_context = 2048;
  w.seed = seed;
  return w;
}

TEST(CudaGraphsVerify, ReplayWithOtherLengthsAndMasks) {
  REQUIRE_GPU();
  check_buckets(verify_world("verify bf16", 31), ForwardMode::kTargetVerify, {1, 4, 8}, 4);
}

TEST(CudaGraphsVerify, Variants) {
  REQUIRE_GPU();
  std::vector<WorldSpec> worlds;
  WorldSpec window = verify_world("verify window 200 (device fold)", 32);
  window.window = 200;
  worlds.push_back(window);
  WorldSpec fp32 = verify_world("verify fp32 io (16-bit copies)", 33);
  fp32.io = DType::kFloat32;
  worlds.push_back(fp32);
  WorldSpec fp8 = verify_world("verify fp8 e5m2", 34);
  fp8.kv = DType::kFloat8E5M2;
  worlds.push_back(fp8);
  WorldSpec big_tree = verify_world("verify 40-token trees (2 tiles)", 35);
  big_tree.draft_token_num = 40;
  worlds.push_back(big_tree);
  for (const WorldSpec& spec : worlds) {
    SCOPED_TRACE(spec.label);
    check_buckets(spec, ForwardMode::kTargetVerify, {2, 8}, 2);
  }
}

// ---- bad input under replay ---------------------------------------------------------------------

// A replay whose indices are bad (a slot past the pool in out_cache_loc, a row past req_to_token,
// a req_to_token entry the step reads) writes nothing, neither the pool nor the outputs, and is
// reported once by check_errors with the replayed step's own number; the replay after it is
// bit-equal to eager again. The same contract as the eager path (test_bad_index_cuda.cpp).
void check_bad_replays(const WorldSpec& spec, ForwardMode mode) {
  GraphWorld w(spec);
  auto backend = w.make_cuda_backend();
  const int per_request = mode == ForwardMode::kTargetVerify ? spec.draft_token_num : 1;
  backend->init_cuda_graph_state(spec.max_bs, int64_t(spec.max_bs) * per_request);
  const int bs = 4;
  Graph graph;
  capture_bucket(w, *backend, w.random_step(mode, bs, bs), graph);
  EXPECT_NO_THROW(backend->check_errors(true));
  const int64_t num_slots = w.cache().num_slots();
  for (int kind = 0; kind < 3; ++kind) {
    const Step s = w.random_step(mode, bs, bs);
    w.upload(s);
    std::string argument;
    std::function<void()> undo = [] {};
    if (kind == 0) {
      w.set_loc(0, 1, int32_t(num_slots));
      argument = "out_cache_loc[1]";
    } else if (kind == 1) {
      w.set_row(2, int32_t(w.pool().max_reqs() + 3));
      argument = "req_pool_indices[2]";
      undo = [&] { w.set_row(2, s.rows[2]); };
    } else {
      const int row = s.rows[1];
      const std::vector<int32_t> bad = {-1};
      w.pool().write(row, 0, bad);
      argument = "req_to_token[" + std::to_string(row) + "][0]";
      undo = [&w, row] {
        const std::vector<int32_t> good = {w.table_slot(row, 0)};
        w.pool().write(row, 0, good);
      };
    }
    const auto pool_before = w.pool_bytes();
    const auto table_before = w.table_now();
    std::vector<std::vector<uint8_t>> outs_before;
    for (int l = 0; l < kLayers; ++l) outs_before.push_back(w.output_bytes(l, s.num_tokens, false));

    const ForwardBatch b = w.batch(s);
    backend->init_forward_metadata_out_graph(b, /*in_capture=*/false);
    const uint64_t step = backend->step_id();
    graph.launch(w.stream());
    try {
      backend->check_errors(/*synchronize=*/true);
      ADD_FAILURE() << spec.label << ": the bad replay (" << argument << ") was not reported";
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), argument) << e.what();
      EXPECT_EQ(e.step(), int64_t(step)) << e.what();
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
      std::printf("  %-24s %-13s refused replay: %s\n", spec.label.c_str(),
                  forward_mode_name(mode), e.what());
    }
    EXPECT_TRUE(w.pool_bytes() == pool_before) << spec.label << " " << argument
                                               << ": the KV pool changed";
    EXPECT_TRUE(w.table_now() == table_before) << "req_to_token changed";
    for (int l = 0; l < kLayers; ++l) {
      EXPECT_TRUE(w.output_bytes(l, s.num_tokens, false) == outs_before[size_t(l)])
          << spec.label << " " << argument << ": layer " << l << "'s output was written";
    }
    EXPECT_NO_THROW(backend->check_errors(true)) << "reported twice";
    undo();
    EXPECT_TRUE(replay_and_compare(w, *backend, graph, w.random_step(mode, bs, bs),
                                   "the replay after a refused one"));
    EXPECT_NO_THROW(backend->check_errors(true));
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  }
}

TEST(CudaGraphsBadInput, RefusedDecodeReplayWritesNothing) {
  REQUIRE_GPU();
  for (const char* kernel : {"0", "1"}) {
    WorldSpec spec = decode_world(kernel[0] == '0' ? "bad decode cuda-core" : "bad decode tensor",
                                  kernel, 61);
    spec.max_context = 1024;
    check_bad_replays(spec, ForwardMode::kDecode);
  }
}

TEST(CudaGraphsBadInput, RefusedVerifyReplayWritesNothing) {
  REQUIRE_GPU();
  WorldSpec spec = verify_world("bad verify", 62);
  spec.max_context = 1024;
  check_bad_replays(spec, ForwardMode::kTargetVerify);
}

// ---- multi-step draft --------------------------------------------------------------------------

TEST(CudaGraphsDraft, MultiStepReplayEqualsEager) {
  REQUIRE_GPU();
  WorldSpec spec;
  spec.label = "draft topk 2 x 3 steps";
  spec.topk = 2;
  spec.num_steps = 3;
  spec.max_context = 2048;
  spec.seed = 41;
  GraphWorld w(spec);
  auto draft = w.make_cuda_draft();
  draft->init_cuda_graph_state(spec.max_bs);
  const double tolerance = tolerance_for(spec.io, spec.kv);
  for (int bs : {1, 5, 8}) {
    Graph graph;
    const Step first = w.random_step(ForwardMode::kDecode, bs, bs);
    w.upload(first);
    ForwardBatch b = w.batch(first);
    draft->init_forward_metadata_out_graph(b, /*in_capture=*/true);
    capture(w, graph, [&] {
      draft->init_forward_metadata_in_graph(b);
      w.run_draft_steps(*draft, first, /*eager=*/false);
    });
    for (int t = 0; t < 3; ++t) {
      const int real = t == 1 ? std::max(1, bs - 2) : bs;
      const Step s = w.random_step(ForwardMode::kDecode, bs, real);
      w.upload(s);
      b = w.batch(s);
      draft->init_forward_metadata_out_graph(b, false);
      graph.launch(w.stream());
      CUDA_OK(cudaStreamSynchronize(w.stream()));
      auto eager = w.make_cuda_draft();
      eager->init_forward_metadata(b);
      w.run_draft_steps(*eager, s, /*eager=*/true);
      CUDA_OK(cudaStreamSynchronize(w.stream()));
      for (int step = 0; step < spec.num_steps; ++step) {
        EXPECT_TRUE(w.output_bytes(step, s.real_tokens, false) ==
                    w.output_bytes(step, s.real_tokens, true))
            << "bucket " << bs << " (" << real << " real), draft step " << step
            << ": replay differs from eager";
        if (t == 0) {
          const double err = w.cpu_error(s, step);
          EXPECT_LE(err, tolerance) << "bucket " << bs << " draft step " << step;
          std::printf("  draft bucket %d step %d: cpu err %.2e\n", bs, step, err);
        }
      }
    }
  }
}

// ---- nothing allocates during replay
// -------------------------------------------------------------

size_t free_device_bytes() {
  size_t free_bytes = 0, total = 0;
  cuda_check(cudaMemGetInfo(&free_bytes, &total), "cudaMemGetInfo");
  return free_bytes;
}

TEST(CudaGraphsMemory, NothingAllocatesDuringReplay) {
  REQUIRE_GPU();
  struct Case {
    WorldSpec spec;
    ForwardMode mode;
  };
  std::vector<Case> cases;
  cases.push_back({decode_world("decode cuda-core", "0", 51), ForwardMode::kDecode});
  cases.push_back({decode_world("decode tensor", "1", 52), ForwardMode::kDecode});
  WorldSpec window_verify = verify_world("verify window", 53);
  window_verify.window = 100;
  cases.push_back({window_verify, ForwardMode::kTargetVerify});
  WorldSpec fp32_verify = verify_world("verify fp32 io", 54);
  fp32_verify.io = DType::kFloat32;
  cases.push_back({fp32_verify, ForwardMode::kTargetVerify});
  for (Case& c : cases) {
    c.spec.max_context = 2048;
    SCOPED_TRACE(c.spec.label);
    GraphWorld w(c.spec);
    auto backend = w.make_cuda_backend();
    const int per_request = c.mode == ForwardMode::kTargetVerify ? c.spec.draft_token_num : 1;
    backend->init_cuda_graph_state(c.spec.max_bs, int64_t(c.spec.max_bs) * per_request);
    const uint64_t after_init = cuda::debug::allocation_count();
    std::vector<std::unique_ptr<Graph>> graphs;
    for (int bs : {1, 8}) {
      graphs.push_back(std::make_unique<Graph>());
      const Step s = w.random_step(c.mode, bs, bs);
      capture_bucket(w, *backend, s, *graphs.back());
      // A first replay (the driver may set a graph up at its first launch), after its own
      // out_graph: the buckets share the graph buffers, so a graph only replays the plan of its
      // batch size.
      backend->init_forward_metadata_out_graph(w.batch(s), false);
      graphs.back()->launch(w.stream());
      CUDA_OK(cudaStreamSynchronize(w.stream()));
    }
    EXPECT_EQ(cuda::debug::allocation_count(), after_init) << "capture allocated";
    // Steps are drawn (and their inputs uploaded) before the measured window.
    std::vector<Step> steps;
    for (int t = 0; t < 12; ++t) {
      const int bs = t % 2 == 0 ? 1 : 8;
      steps.push_back(w.random_step(c.mode, bs, t % 3 == 0 ? std::max(1, bs - 3) : bs));
    }
    const uint64_t before = cuda::debug::allocation_count();
    const size_t free_before = free_device_bytes();
    for (size_t t = 0; t < steps.size(); ++t) {
      const ForwardBatch b = w.batch(steps[t]);
      std::copy(steps[t].seq.begin(), steps[t].seq.end(),
                const_cast<int32_t*>(b.seq_lens_cpu.data_as<int32_t>()));
      backend->init_forward_metadata_out_graph(b, false);
      graphs[t % 2]->launch(w.stream());
    }
    CUDA_OK(cudaStreamSynchronize(w.stream()));
    EXPECT_EQ(cuda::debug::allocation_count(), before) << "a replay's out_graph allocated";
    EXPECT_EQ(free_device_bytes(), free_before) << "device memory changed during replays";
  }
  // The draft runner too.
  WorldSpec spec;
  spec.label = "draft";
  spec.topk = 2;
  spec.num_steps = 2;
  spec.max_context = 2048;
  spec.seed = 55;
  GraphWorld w(spec);
  auto draft = w.make_cuda_draft();
  draft->init_cuda_graph_state(spec.max_bs);
  const Step first = w.random_step(ForwardMode::kDecode, 8, 8);
  w.upload(first);
  const ForwardBatch b = w.batch(first);
  draft->init_forward_metadata_out_graph(b, true);
  Graph graph;
  const uint64_t before_capture = cuda::debug::allocation_count();
  capture(w, graph, [&] {
    draft->init_forward_metadata_in_graph(b);
    w.run_draft_steps(*draft, first, false);
  });
  graph.launch(w.stream());
  CUDA_OK(cudaStreamSynchronize(w.stream()));
  const size_t free_before = free_device_bytes();
  for (int t = 0; t < 10; ++t) {
    draft->init_forward_metadata_out_graph(b, false);
    graph.launch(w.stream());
  }
  CUDA_OK(cudaStreamSynchronize(w.stream()));
  EXPECT_EQ(cuda::debug::allocation_count(), before_capture) << "draft replays allocated";
  EXPECT_EQ(free_device_bytes(), free_before);
}

// ---- refusals ----------------------------------------------------------------------------------

TEST(CudaGraphsCapture, RefusalsAreClear) {
  REQUIRE_GPU();
  // The tensor-core path without graph buffers: its plan is not padded, so capture is refused.
  {
    GraphWorld w(decode_world("tensor, no graph state", "1", 61));
    auto backend = w.make_cuda_backend();
    const Step s = w.random_step(ForwardMode::kDecode, 4, 4);
    w.upload(s);
    const ForwardBatch b = w.batch(s);
    EXPECT_THROW(backend->init_forward_metadata_out_graph(b, /*in_capture=*/true), Error);
    backend->init_forward_metadata_out_graph(b, false);
    Graph graph;
    try {
      capture(w, graph, [&] {
        backend->init_forward_metadata_in_graph(b);
        w.run_layers(*backend, b, s, false);
      });
      ADD_FAILURE() << "capturing an unpadded tensor-core plan was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kNotSupported) << e.what();
    }
  }
  // A batch above max_bs is not on the graph pool: in_capture says so.
  {
    GraphWorld w(decode_world("above max_bs", "0", 62));
    auto backend = w.make_cuda_backend();
    backend->init_cuda_graph_state(4, 4);
    const Step s = w.random_step(ForwardMode::kDecode, 6, 6);
    w.upload(s);
    EXPECT_THROW(backend->init_forward_metadata_out_graph(w.batch(s), true), Error);
  }
  // Verify trees larger than init_cuda_graph_state planned for: a clear kOutOfResources, not a
  // write past the frozen buffers.
  {
    WorldSpec spec = verify_world("tree larger than planned", 63);
    spec.draft_token_num = 40;
    GraphWorld w(spec);
    auto backend = w.make_cuda_backend();
    backend->init_cuda_graph_state(spec.max_bs, int64_t(spec.max_bs) * 2);
    const Step s = w.random_step(ForwardMode::kTargetVerify, 8, 8);
    w.upload(s);
    try {
      backend->init_forward_metadata_out_graph(w.batch(s), true);
      ADD_FAILURE() << "a plan beyond the reserved capacity was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kOutOfResources) << e.what();
    }
  }
}

}  // namespace
}  // namespace kvattn::testing
