// CUDA graphs on the device (issue 6). A world of fixed engine buffers (q/k/v/out per layer,
// req_pool_indices, seq_lens, out_cache_loc, tree mask, positions) is captured once per
// batch-size bucket (init_forward_metadata_out_graph with in_capture, then in_graph and the
// layers inside the capture) and replayed for random batches of that bucket: other lengths
// (kv_len 1, split-KV lengths, padded entries), other tree masks and positions.
//
// Every step poisons what it must not read (issue 20): the KV pool holds finite K/V only in the
// slots the step's real requests read and do not write; every other slot (unowned pages,
// positions past a request's length, the slots the step saves into, the padding slot) holds NaN,
// and so does every output row before the step runs. After each replay the whole pool is checked
// byte for byte (the step's saves, rounded into the KV dtype, and nothing else), the real output
// rows must be finite, and the replay must equal an eager run of a fresh backend bit for bit; the
// first and last replay of each bucket are also compared with the float64 oracle
// (src/reference) within the scenario bar of the dtypes. Covered: DECODE on the CUDA-core and
// the tensor-core kernels (page 1 and 16, fp16, fp8, GQA group 8, fp32 io, a window model's two
// index sets), TARGET_VERIFY (window layers fold the tree mask on the device, fp32 io, fp8), the
// multi-step draft, nothing allocating during replay, and the refusals. Skips without a device.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "cuda_bench/bench_support.h"
#include "cuda/cuda_backend.h"
#include "cuda/cuda_test_support.h"
#include "kvattn/kvattn.h"
#include "reference/float_format.h"
#include "reference/reference.h"
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
  const char* draft_shared_prefix = nullptr;  ///< KVATTN_DRAFT_SHARED_PREFIX for its draft runners
  /// DECODE and TARGET_VERIFY batches carry no seq_lens_cpu: the backend plans them on the
  /// device (issue 15).
  bool device_lengths = false;
  /// EXTEND worlds: the query tokens of every step (the token bucket an engine captures).
  int extend_tokens = 0;
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
  std::vector<int32_t> q_lens;     ///< EXTEND [batch_size]: new tokens (prefix = seq - q)
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

    // The pool's contents live on the host: NaN, and per layer finite random K/V (fp8: value /
    // scale) drawn from a table of encoded values (a prime count, so rows do not repeat in step
    // with the head dims). upload() composes each step's image from the two.
    elem_ = dtype_size(spec.kv);
    slot_bytes_ = size_t(spec.num_kv_heads) * spec.head_dim * size_t(elem_);
    const size_t pool_bytes = size_t(kc.num_slots) * slot_bytes_;
    const int64_t pool_elems = int64_t(pool_bytes / size_t(elem_));
    // Element i of an image is table[(i + offset) % period]: filled a period at a time.
    auto fill_periodic = [&](std::vector<uint8_t>& image, const std::vector<uint8_t>& table,
                             int64_t offset) {
      const int64_t period = int64_t(table.size()) / elem_;
      image.resize(pool_bytes);
      for (int64_t i = 0; i < pool_elems;) {
        const int64_t from = (i + offset) % period;
        const int64_t run = std::min(period - from, pool_elems - i);
        std::memcpy(image.data() + i * elem_, table.data() + from * elem_, size_t(run * elem_));
        i += run;
      }
    };
    {
      std::vector<uint8_t> nan(size_t(4096) * elem_);
      for (int i = 0; i < 4096; ++i)
        encode_element(nan.data(), spec.kv, i, std::numeric_limits<double>::quiet_NaN());
      fill_periodic(nan_image_, nan, 0);
    }
    constexpr int kTable = 4099;
    std::normal_distribution<double> normal(0.0, 1.0);
    finite_.resize(kLayers);
    for (int l = 0; l < kLayers; ++l) {
      for (int which = 0; which < 2; ++which) {
        const double scale = !fp8 ? 1.0 : which == 0 ? cache_->k_scale(l) : cache_->v_scale(l);
        std::vector<uint8_t> table(size_t(kTable) * elem_);
        for (int i = 0; i < kTable; ++i)
          encode_element(table.data(), spec.kv, i, normal(rng_) / scale);
        fill_periodic(finite_[size_t(l)][size_t(which)], table, uniform(0, kTable - 1));
      }
      copy_bytes(cache_->k_buffer(l).data(), gpu, nan_image_.data(), Device::cpu(), pool_bytes);
      copy_bytes(cache_->v_buffer(l).data(), gpu, nan_image_.data(), Device::cpu(), pool_bytes);
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
    max_tokens_ = std::max<int64_t>(int64_t(spec.max_bs) * per_request, spec.extend_tokens);
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
    prefix_ = allocate(spec.max_bs * sizeof(int64_t));
    extend_ = allocate(spec.max_bs * sizeof(int64_t));
    prefix_host_.assign(size_t(spec.max_bs), 0);
    extend_host_.assign(size_t(spec.max_bs), 0);
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
    ScopedEnv shared("KVATTN_DRAFT_SHARED_PREFIX", spec_.draft_shared_prefix);
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
    if (mode == ForwardMode::kExtend || mode == ForwardMode::kMixed) {
      return random_extend_step(mode, batch_size, real);
    }
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

  /// An EXTEND-like step of the world's token bucket: `real` requests share its tokens (one with
  /// none, one with a single token, one long and the rest random, prefixes of 0 to long) and the
  /// padded entries' dummy request takes what is left (an engine pads the tokens of a bucket
  /// with such a request: the padding row, all slots 0).
  Step random_extend_step(ForwardMode mode, int batch_size, int real) {
    Step s;
    s.mode = mode;
    s.batch_size = batch_size;
    s.real = real;
    const int64_t tokens = spec_.extend_tokens;
    std::vector<int32_t> rows(size_t(spec_.max_bs));
    for (int r = 0; r < spec_.max_bs; ++r) rows[size_t(r)] = r;
    std::shuffle(rows.begin(), rows.end(), rng_);
    // The real requests' new tokens: all of the bucket without padding, else most of it.
    const int64_t real_share =
        real == batch_size ? tokens : tokens - uniform(1, int(tokens / 4) + 1);
    std::vector<int32_t> q(size_t(real), 0);
    int64_t left = real_share;
    if (real > 1) q[1] = 1, left -= 1;
    if (real > 2 && left > 0) {
      q[2] = int32_t(std::min<int64_t>(left, left / 2 + 1));  // a long one
      left -= q[2];
    }
    while (left > 0) {
      const int r = real > 1 ? uniform(std::min(2, real - 1), real - 1) : 0;
      const int32_t take = int32_t(std::min<int64_t>(left, uniform(1, 300)));
      q[size_t(r)] += take;
      left -= take;
    }
    if (real == 1) q[0] = int32_t(real_share);
    for (int r = 0; r < batch_size; ++r) {
      if (r < real) {
        const int32_t new_tokens = q[size_t(r)];
        const int room = spec_.max_context - new_tokens;
        const int prefix = r % 3 == 0 ? 0 : uniform(0, std::max(0, room));
        s.rows.push_back(rows[size_t(r)]);
        s.seq.push_back(prefix + new_tokens);
        s.q_lens.push_back(new_tokens);
      } else {
        const int32_t pad = r == real ? int32_t(tokens - real_share) : 0;
        s.rows.push_back(pad_row_);
        s.seq.push_back(pad);
        s.q_lens.push_back(pad);
      }
    }
    s.num_tokens = tokens;
    s.real_tokens = real_share;
    return s;
  }

  /// Writes a step into the fixed buffers: its batch, fresh q/k/v, NaN in every output row, and
  /// the pool image of the step (finite K/V only in the slots its real requests read and do not
  /// write, NaN everywhere else), which check_pool compares the pool with afterwards.
  void upload(const Step& s) {
    cuda_check(cudaStreamSynchronize(stream_), "sync");  // nothing of an earlier step in flight
    std::vector<uint8_t> live(static_cast<size_t>(cache_->num_slots()), 0);
    for (int r = 0; r < s.real; ++r) {
      const int64_t readable = !s.q_lens.empty() ? int64_t(s.seq[size_t(r)]) - s.q_lens[size_t(r)]
                               : s.mode == ForwardMode::kDecode && spec_.topk == 0
                                   ? int64_t(s.seq[size_t(r)]) - 1  // the last token is saved now
                                   : int64_t(s.seq[size_t(r)]);     // tree / draft tokens after it
      for (int64_t pos = 0; pos < readable; ++pos)
        live[size_t(table_[size_t(s.rows[size_t(r)]) * spec_.max_context + pos])] = 1;
    }
    before_.assign(kLayers, {});
    for (int l = 0; l < kLayers; ++l) {
      for (int which = 0; which < 2; ++which) {
        std::vector<uint8_t> image = nan_image_;
        const std::vector<uint8_t>& finite = finite_[size_t(l)][size_t(which)];
        for (size_t slot = 0; slot < live.size(); ++slot) {
          if (live[slot])
            std::memcpy(image.data() + slot * slot_bytes_, finite.data() + slot * slot_bytes_,
                        slot_bytes_);
        }
        const TensorView& buffer = which == 0 ? cache_->k_buffer(l) : cache_->v_buffer(l);
        copy_bytes(buffer.data(), Device::cuda(0), image.data(), Device::cpu(), image.size());
        before_[size_t(l)][size_t(which)] = std::move(image);
      }
    }
    for (size_t c = 0; c < out_.size(); ++c) {
      cuda_check(cudaMemsetAsync(out_[c].data(), 0xff, out_[c].bytes(), stream_), "poison out");
      cuda_check(cudaMemsetAsync(out_eager_[c].data(), 0xff, out_eager_[c].bytes(), stream_),
                 "poison out");
    }
    copy_bytes(rpi_.data(), Device::cuda(0), s.rows.data(), Device::cpu(),
               s.rows.size() * sizeof(int32_t));
    copy_bytes(seq_.data(), Device::cuda(0), s.seq.data(), Device::cpu(),
               s.seq.size() * sizeof(int32_t));
    std::copy(s.seq.begin(), s.seq.end(), seq_host_.begin());
    if (!s.q_lens.empty()) {
      for (int r = 0; r < s.batch_size; ++r) {
        extend_host_[size_t(r)] = s.q_lens[size_t(r)];
        prefix_host_[size_t(r)] = s.seq[size_t(r)] - s.q_lens[size_t(r)];
      }
      copy_bytes(prefix_.data(), Device::cuda(0), prefix_host_.data(), Device::cpu(),
                 size_t(s.batch_size) * sizeof(int64_t));
      copy_bytes(extend_.data(), Device::cuda(0), extend_host_.data(), Device::cpu(),
                 size_t(s.batch_size) * sizeof(int64_t));
    }
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
    const bool extend = !s.q_lens.empty();
    const bool planned_on_device = spec_.device_lengths;
    if (!planned_on_device) {
      b.seq_lens_cpu = TensorView(const_cast<int32_t*>(seq_host_.data()), DType::kInt32,
                                  Device::cpu(), {s.batch_size});
    }
    if (extend) {
      // int64 lengths (an engine's usual dtype), on the device; host copies when host-planned.
      b.extend_prefix_lens =
          TensorView(prefix_.data(), DType::kInt64, Device::cuda(0), {s.batch_size});
      b.extend_seq_lens =
          TensorView(extend_.data(), DType::kInt64, Device::cuda(0), {s.batch_size});
      if (!planned_on_device) {
        b.extend_prefix_lens_cpu = TensorView(const_cast<int64_t*>(prefix_host_.data()),
                                              DType::kInt64, Device::cpu(), {s.batch_size});
        b.extend_seq_lens_cpu = TensorView(const_cast<int64_t*>(extend_host_.data()), DType::kInt64,
                                           Device::cpu(), {s.batch_size});
      }
    }
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

  /// The pool after a step: [layer][0 = K, 1 = V] bytes, downloaded.
  using PoolBytes = std::vector<std::array<std::vector<uint8_t>, 2>>;

  /// Checks every byte of every layer's K and V after step `s` ran (graph replay or eager):
  /// what upload() wrote, except the step's saves, which must hold the new K/V rounded into the
  /// KV dtype (fp8: value / scale, one ulp allowed for a float-vs-double rounding tie), and the
  /// padding slot 0 when the step has padded entries (they all write there). Returns the pool.
  PoolBytes check_pool(const Step& s, const std::string& what) const {
    cuda_check(cudaStreamSynchronize(stream_), "sync");
    PoolBytes now(kLayers);
    for (int l = 0; l < kLayers; ++l) {
      for (int which = 0; which < 2; ++which) {
        const TensorView& buffer = which == 0 ? cache_->k_buffer(l) : cache_->v_buffer(l);
        now[size_t(l)][size_t(which)].resize(size_t(buffer.nbytes()));
        copy_bytes(now[size_t(l)][size_t(which)].data(), Device::cpu(), buffer.data(),
                   Device::cuda(0), size_t(buffer.nbytes()));
      }
    }
    const bool fp8 = is_fp8_dtype(spec_.kv);
    const int64_t row_elems = int64_t(spec_.num_kv_heads) * spec_.head_dim;
    int reported = 0;
    for (int l = 0; l < kLayers; ++l) {
      for (int which = 0; which < 2; ++which) {
        std::vector<uint8_t> expected = before_[size_t(l)][size_t(which)];
        std::vector<uint8_t> is_saved(static_cast<size_t>(cache_->num_slots()), 0);
        const double scale = !fp8 ? 1.0 : which == 0 ? cache_->k_scale(l) : cache_->v_scale(l);
        // Which calls saved into layer l: every layer's own forward, or every draft step into
        // the draft layer (1).
        for (int c = 0; c < int(q_.size()); ++c) {
          if (spec_.topk > 0 ? l != 1 : c != l) continue;
          const std::vector<int32_t> loc = cache_locations(s, c);
          const std::vector<uint8_t> rows =
              device_bytes((which == 0 ? k_ : v_)[size_t(c)].data(),
                           size_t(s.real_tokens * row_elems) * dtype_size(spec_.io));
          for (int64_t t = 0; t < s.real_tokens; ++t) {
            const int64_t slot = loc[size_t(t)];
            is_saved[size_t(slot)] = 1;
            for (int64_t e = 0; e < row_elems; ++e) {
              encode_element(expected.data(), spec_.kv, slot * row_elems + e,
                             decode_element(rows.data(), spec_.io, t * row_elems + e) / scale);
            }
          }
        }
        const bool padded = s.real < s.batch_size;
        const std::vector<uint8_t>& got = now[size_t(l)][size_t(which)];
        for (int64_t slot = padded ? 1 : 0; slot < cache_->num_slots() && reported < 3; ++slot) {
          const size_t at = size_t(slot) * slot_bytes_;
          if (std::memcmp(got.data() + at, expected.data() + at, slot_bytes_) == 0) continue;
          for (int64_t e = 0; e < row_elems; ++e) {
            const int64_t i = slot * row_elems + e;
            const double g = decode_element(got.data(), spec_.kv, i);
            const double x = decode_element(expected.data(), spec_.kv, i);
            if (std::memcmp(got.data() + i * elem_, expected.data() + i * elem_, size_t(elem_)) ==
                0)
              continue;
            const bool within_ulp = fp8 && is_saved[size_t(slot)] && std::isfinite(g) &&
                                    std::fabs(g - x) <=
                                        ulp_of(std::max(std::fabs(g), std::fabs(x)), spec_.kv);
            if (within_ulp) continue;
            ADD_FAILURE() << spec_.label << " " << what << ": KV pool layer " << l
                          << (which == 0 ? " K" : " V") << " slot " << slot << " element " << e
                          << (is_saved[size_t(slot)] ? " (saved by the step)" : " (not saved)")
                          << ": " << g << ", expected " << x;
            ++reported;
            break;
          }
        }
      }
    }
    return now;
  }

  /// The real output rows of call c (graph or eager outputs) must be finite: a NaN is an
  /// unwritten row or a read of a poisoned slot.
  void expect_finite_outputs(const Step& s, int c, bool eager, const std::string& what) const {
    const std::vector<uint8_t> bytes = output_bytes(c, s.real_tokens, eager);
    const int64_t count = int64_t(bytes.size()) / dtype_size(spec_.io);
    for (int64_t i = 0; i < count; ++i) {
      if (!std::isfinite(decode_element(bytes.data(), spec_.io, i))) {
        const int64_t row = int64_t(spec_.num_q_heads) * spec_.head_dim;
        ADD_FAILURE() << spec_.label << " " << what << ": call " << c << " out[token " << i / row
                      << ", element " << i % row << "] is not finite (unwritten, or NaN read from "
                      << "a slot the step must not read)";
        return;
      }
    }
  }

  /// Max relative error (per (token, head) row, against the row's max |reference|) of call c's
  /// graph output over the real rows, against the float64 oracle reading `pool` (the pool after
  /// the step, as check_pool returned it). Requests run on threads of their own.
  double oracle_error(const Step& s, int c, const PoolBytes& pool) const {
    const int l = spec_.topk > 0 ? 1 : c;
    const AttentionLayer lay = layer(l);
    const bool verify = s.mode == ForwardMode::kTargetVerify;
    const bool extend = !s.q_lens.empty();
    const int per_request = verify ? spec_.draft_token_num : spec_.topk > 0 ? spec_.topk : 1;
    // Each real request's first query row.
    std::vector<int64_t> first_row(size_t(s.real) + 1, 0);
    for (int r = 0; r < s.real; ++r) {
      first_row[size_t(r) + 1] =
          first_row[size_t(r)] + (extend ? s.q_lens[size_t(r)] : per_request);
    }
    const int64_t width = spec_.max_context;
    // The slots the real requests may read, renumbered densely (a float64 copy of the whole
    // pool would be large): compact[slot] is the oracle pool's slot.
    std::vector<int64_t> compact(static_cast<size_t>(cache_->num_slots()), -1);
    std::vector<int64_t> order;
    std::vector<int32_t> table(table_.size(), 0);
    for (int r = 0; r < s.real; ++r) {
      const int64_t row = s.rows[size_t(r)];
      const int64_t extent = int64_t(s.seq[size_t(r)]) +
                             (verify ? spec_.draft_token_num : spec_.num_steps * spec_.topk);
      for (int64_t pos = 0; pos < extent; ++pos) {
        const int64_t slot = table_[size_t(row * width + pos)];
        if (compact[size_t(slot)] < 0) {
          compact[size_t(slot)] = int64_t(order.size());
          order.push_back(slot);
        }
        table[size_t(row * width + pos)] = int32_t(compact[size_t(slot)]);
      }
    }
    const int hkv = spec_.num_kv_heads;
    const int dim = spec_.head_dim;
    RefKvPool ref_pool = RefKvPool::make(std::max<int64_t>(1, int64_t(order.size())), hkv, dim, dim);
    const bool fp8 = is_fp8_dtype(spec_.kv);
    const double k_scale = fp8 ? cache_->k_scale(l) : 1.0;
    const double v_scale = fp8 ? cache_->v_scale(l) : 1.0;
    const int64_t row_elems = int64_t(hkv) * dim;
    for (size_t i = 0; i < order.size(); ++i) {
      for (int64_t e = 0; e < row_elems; ++e) {
        const int64_t from = order[i] * row_elems + e;
        ref_pool.k[i * row_elems + e] =
            decode_element(pool[size_t(l)][0].data(), spec_.kv, from) * k_scale;
        ref_pool.v[i * row_elems + e] =
            decode_element(pool[size_t(l)][1].data(), spec_.kv, from) * v_scale;
      }
    }
    const int64_t q_row = int64_t(spec_.num_q_heads) * dim;
    const std::vector<uint8_t> q_bytes =
        device_bytes(q_[size_t(c)].data(), size_t(s.real_tokens * q_row) * dtype_size(spec_.io));
    const std::vector<uint8_t> got = output_bytes(c, s.real_tokens, false);

    // One oracle batch per real request (its mask and positions sliced out).
    std::vector<double> worst(static_cast<size_t>(s.real), 0.0);
    std::vector<std::thread> threads;
    int64_t mask_offset = 0;
    for (int r = 0; r < s.real; ++r) {
      RefBatch rb;
      rb.mode = s.mode;
      rb.req_pool_indices = {s.rows[size_t(r)]};
      rb.seq_lens = {s.seq[size_t(r)]};
      if (extend) {
        rb.extend_lens = {s.q_lens[size_t(r)]};
        rb.prefix_lens = {s.seq[size_t(r)] - s.q_lens[size_t(r)]};
      }
      rb.max_context_len = spec_.max_context;
      rb.req_to_token = table;
      if (verify) {
        const int n = spec_.draft_token_num;
        const int64_t mask_len = int64_t(n) * (s.seq[size_t(r)] + n);
        rb.draft_token_num = n;
        rb.custom_mask.assign(s.mask.begin() + mask_offset, s.mask.begin() + mask_offset + mask_len);
        mask_offset += mask_len;
        rb.positions.assign(s.positions.begin() + int64_t(r) * n,
                            s.positions.begin() + int64_t(r + 1) * n);
      }
      if (spec_.topk > 0) {
        rb.topk = spec_.topk;
        rb.draft_step = c;
      }
      threads.emplace_back([&, r, rb = std::move(rb)] {
        const int64_t first = first_row[size_t(r)];
        std::vector<double> q(size_t((first_row[size_t(r) + 1] - first) * q_row));
        for (size_t i = 0; i < q.size(); ++i)
          q[i] = decode_element(q_bytes.data(), spec_.io, first * q_row + int64_t(i));
        const RefOutput ref = reference_attention(lay, rb, ref_pool, q);
        for (int64_t t = 0; t < ref.num_tokens; ++t) {
          for (int h = 0; h < spec_.num_q_heads; ++h) {
            double ref_max = 0, diff_max = 0;
            for (int d = 0; d < dim; ++d) {
              const double want = ref.out[size_t((t * spec_.num_q_heads + h) * dim + d)];
              const double g =
                  decode_element(got.data(), spec_.io, (first + t) * q_row + int64_t(h) * dim + d);
              ref_max = std::max(ref_max, std::fabs(want));
              diff_max = std::isfinite(g) ? std::max(diff_max, std::fabs(g - want)) : INFINITY;
            }
            const double rel = ref_max > 0 ? diff_max / ref_max : diff_max > 0 ? INFINITY : 0.0;
            worst[size_t(r)] = std::max(worst[size_t(r)], rel);
          }
        }
      });
    }
    for (std::thread& t : threads) t.join();
    return *std::max_element(worst.begin(), worst.end());
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
  /// seq_lens[i] on the device only (the host copy keeps the step's).
  void set_seq_on_device(int64_t i, int32_t value) {
    copy_bytes(static_cast<int32_t*>(seq_.data()) + i, Device::cuda(0), &value, Device::cpu(),
               sizeof(value));
  }
  /// extend_prefix_lens[i] (which 0) or extend_seq_lens[i] (which 1) on the device only.
  void set_extend_on_device(int which, int64_t i, int64_t value) {
    copy_bytes(static_cast<int64_t*>((which == 0 ? prefix_ : extend_).data()) + i, Device::cuda(0),
               &value, Device::cpu(), sizeof(value));
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
  /// `bytes` bytes of device memory at `src`, after the stream's work.
  std::vector<uint8_t> device_bytes(const void* src, size_t bytes) const {
    cuda_check(cudaStreamSynchronize(stream_), "sync");
    std::vector<uint8_t> out(bytes);
    copy_bytes(out.data(), Device::cpu(), src, Device::cuda(0), bytes);
    return out;
  }

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
      if (!s.q_lens.empty()) {
        for (int64_t p = seq - s.q_lens[size_t(r)]; p < seq; ++p) loc.push_back(slot(r, p));
      } else if (s.mode == ForwardMode::kTargetVerify) {
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
  Buffer rpi_, seq_, mask_, positions_, prefix_, extend_;
  std::vector<int32_t> seq_host_;
  std::vector<int64_t> prefix_host_, extend_host_;
  int elem_ = 0;          ///< bytes of one KV element
  size_t slot_bytes_ = 0;  ///< bytes of one slot of one layer's K (V is as wide: v_dim = head_dim)
  std::vector<uint8_t> nan_image_;  ///< a whole K (or V) buffer of NaN
  std::vector<std::array<std::vector<uint8_t>, 2>> finite_;  ///< [layer][K, V] finite images
  std::vector<std::array<std::vector<uint8_t>, 2>> before_;  ///< [layer][K, V] the step's upload
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

// One replay on poisoned inputs (see upload), then its checks: the whole pool (the step's saves
// and nothing else), finite real output rows, with `oracle` every layer against the float64
// oracle within `tolerance`; then its eager twin on a fresh backend, which must match bit for
// bit. Returns whether every real row of every layer matched eager.
bool replay_and_compare(GraphWorld& w, AttentionBackend& graph_backend, const Graph& graph,
                        const Step& s, const char* what, bool oracle, double tolerance) {
  w.upload(s);
  const ForwardBatch b = w.batch(s);
  graph_backend.init_forward_metadata_out_graph(b, /*in_capture=*/false);
  graph.launch(w.stream());
  cuda_check(cudaStreamSynchronize(w.stream()), "replay");
  const std::string label = std::string(what) + " bucket " + std::to_string(s.batch_size) + " (" +
                            std::to_string(s.real) + " real)";
  const GraphWorld::PoolBytes pool = w.check_pool(s, label + " replay");
  for (int l = 0; l < kLayers; ++l) {
    w.expect_finite_outputs(s, l, /*eager=*/false, label + " replay");
    if (!oracle) continue;
    const double err = w.oracle_error(s, l, pool);
    EXPECT_LE(err, tolerance) << w.spec().label << " " << label << " layer " << l
                              << ": replay vs the float64 oracle";
    std::printf("  %-30s %-13s bucket %3d real %3d layer %d: oracle err %.2e (tol %.0e)\n",
                w.spec().label.c_str(), what, s.batch_size, s.real, l, err, tolerance);
  }
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
      ADD_FAILURE() << w.spec().label << " " << label << ", layer " << l
                    << ": replay differs from eager at byte " << first << " of " << g.size();
      same = false;
    }
  }
  return same;
}

// The whole protocol for one world and mode: per bucket, capture once, replay `steps` random
// batches (other lengths, masks, padding), each checked by replay_and_compare; the first and
// last replay of each bucket also against the float64 oracle.
void check_buckets(const WorldSpec& spec, ForwardMode mode, const std::vector<int>& buckets,
                   int steps) {
  GraphWorld w(spec);
  auto backend = w.make_cuda_backend();
  EXPECT_EQ(backend->cuda_graph_seq_len_fill_value(), 0);
  const int per_request = mode == ForwardMode::kTargetVerify ? spec.draft_token_num : 1;
  const bool extend = mode == ForwardMode::kExtend || mode == ForwardMode::kMixed;
  backend->init_cuda_graph_state(
      spec.max_bs, extend ? int64_t(spec.extend_tokens) : int64_t(spec.max_bs) * per_request);
  const double tolerance = tolerance_for(spec.io, spec.kv, BackendKind::kCuda, mode);
  for (int bs : buckets) {
    Graph graph;
    capture_bucket(w, *backend, w.random_step(mode, bs, bs), graph);
    for (int t = 0; t < steps; ++t) {
      // Full buckets and partly padded ones (an engine pads a batch up to its bucket).
      const int real = t % 2 == 0 ? bs : std::max(1, bs - 1 - t % std::max(1, bs - 1));
      const Step s = w.random_step(mode, bs, real);
      replay_and_compare(w, *backend, graph, s, forward_mode_name(mode),
                         /*oracle=*/t == 0 || t == steps - 1, tolerance);
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

// ---- DECODE planned on the device (no seq_lens_cpu; issue 15) -----------------------------------

WorldSpec verify_world(const char* label, uint64_t seed);  // (TARGET_VERIFY, below)

// Capture once per bucket, replay with new lengths: every replay bitwise equal to its eager twin
// (also planned on the device) and, first and last, within the oracle's tolerance.
TEST(CudaGraphsDevicePlan, DecodeReplayEqualsEagerOnBothKernels) {
  REQUIRE_GPU();
  std::vector<WorldSpec> worlds;
  for (const char* kernel : {"0", "1"}) {
    const bool tensor = kernel[0] == '1';
    WorldSpec plain =
        decode_world(tensor ? "device-plan tensor" : "device-plan cuda-core", kernel, 71);
    plain.device_lengths = true;
    worlds.push_back(plain);
    WorldSpec window = decode_world(
        tensor ? "device-plan window 300 page16 tensor" : "device-plan window 300 cuda-core",
        kernel, 72);
    window.device_lengths = true;
    window.window = 300;
    window.page_size = tensor ? 16 : 1;
    window.max_context = 2048;
    worlds.push_back(window);
  }
  WorldSpec fp8 = decode_world("device-plan fp8 e4m3 (auto)", nullptr, 73);
  fp8.device_lengths = true;
  fp8.kv = DType::kFloat8E4M3;
  fp8.max_context = 2048;
  worlds.push_back(fp8);
  WorldSpec hd64 = decode_world("device-plan head_dim 64 tensor", "1", 74);
  hd64.device_lengths = true;
  hd64.head_dim = 64;
  hd64.max_context = 2048;
  worlds.push_back(hd64);
  for (const WorldSpec& spec : worlds) {
    SCOPED_TRACE(spec.label);
    check_buckets(spec, ForwardMode::kDecode, {1, 3, 8}, 3);
  }
}

// After backend `host` ran step s eagerly into the eager outputs and `device` into the graph
// outputs (the same step, planned from host lengths and on the device): every layer's real rows
// equal bit for bit, and neither step refused.
void expect_host_and_device_steps_equal(const GraphWorld& w, const Step& s,
                                        const ForwardBatch& host_batch,
                                        const ForwardBatch& device_batch) {
  auto host = w.make_cuda_backend();
  host->init_forward_metadata(host_batch);
  w.run_layers(*host, host_batch, s, /*eager=*/true);
  auto device = w.make_cuda_backend();
  device->init_forward_metadata(device_batch);
  w.run_layers(*device, device_batch, s, /*eager=*/false);
  cuda_check(cudaStreamSynchronize(w.stream()), "steps");
  for (int l = 0; l < kLayers; ++l) {
    EXPECT_TRUE(w.output_bytes(l, s.real_tokens, true) == w.output_bytes(l, s.real_tokens, false))
        << w.spec().label << ": " << forward_mode_name(s.mode) << " window " << w.spec().window
        << " batch " << s.batch_size << " layer " << l
        << ": the device-planned step differs from the host-planned one";
  }
  EXPECT_NO_THROW(host->check_errors(true));
  EXPECT_NO_THROW(device->check_errors(true));
}

// The tensor-core plan built on the device is the host's, item for item: a step planned on the
// device computes the bits the same step planned from seq_lens_cpu computes (eager and eager),
// DECODE with and without a window, TARGET_VERIFY on the decode-shaped kernel.
TEST(CudaGraphsDevicePlan, TensorCoreStepEqualsTheHostPlannedStep) {
  REQUIRE_GPU();
  for (int variant = 0; variant < 3; ++variant) {
    const bool verify = variant == 2;
    WorldSpec spec = verify ? verify_world("device vs host plan, verify", 77)
                            : decode_world("device vs host plan, tensor", "1", 75);
    spec.window = variant == 1 ? 300 : -1;
    spec.max_context = 2048;
    const ForwardMode mode = verify ? ForwardMode::kTargetVerify : ForwardMode::kDecode;
    GraphWorld w(spec);
    for (int bs : {1, 5, 8}) {
      const Step s = w.random_step(mode, bs, bs);
      w.upload(s);
      ForwardBatch host = w.batch(s);
      ForwardBatch device = host;
      device.seq_lens_cpu = TensorView();
      expect_host_and_device_steps_equal(w, s, host, device);
    }
  }
}

// A graph captured for device-planned steps replayed after a host-planned out_graph (or the
// reverse) would run a stale plan: the step check refuses it, naming seq_lens_cpu.
TEST(CudaGraphsDevicePlan, ReplayOfTheOtherPlanSourceIsRefused) {
  REQUIRE_GPU();
  for (bool captured_on_device : {true, false}) {
    WorldSpec spec = decode_world("plan source", "1", 76);
    spec.max_context = 1024;
    GraphWorld w(spec);
    auto backend = w.make_cuda_backend();
    backend->init_cuda_graph_state(spec.max_bs, spec.max_bs);
    const int bs = 4;
    Step s = w.random_step(ForwardMode::kDecode, bs, bs);
    w.upload(s);
    ForwardBatch captured = w.batch(s);
    if (captured_on_device) captured.seq_lens_cpu = TensorView();
    backend->init_forward_metadata_out_graph(captured, /*in_capture=*/true);
    Graph graph;
    capture(w, graph, [&] {
      backend->init_forward_metadata_in_graph(captured);
      w.run_layers(*backend, captured, s, /*eager=*/false);
    });
    s = w.random_step(ForwardMode::kDecode, bs, bs);
    w.upload(s);
    ForwardBatch other = w.batch(s);
    if (!captured_on_device) other.seq_lens_cpu = TensorView();
    const auto pool_before = w.pool_bytes();
    backend->init_forward_metadata_out_graph(other, /*in_capture=*/false);
    graph.launch(w.stream());
    try {
      backend->check_errors(/*synchronize=*/true);
      ADD_FAILURE() << "the replay of the other plan source was not refused";
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), "seq_lens_cpu") << e.what();
      std::printf("  refused replay: %s\n", e.what());
    }
    EXPECT_TRUE(w.pool_bytes() == pool_before) << "the KV pool changed";
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

// TARGET_VERIFY planned on the device (no seq_lens_cpu): every replay bitwise equal to its eager
// twin (also planned on the device) and, first and last, within the oracle's tolerance; the
// decode-shaped kernel (6-token trees), the window fold, fp8 and the prefill family (40-token
// trees: two tiles a request).
TEST(CudaGraphsDevicePlan, VerifyReplayEqualsEager) {
  REQUIRE_GPU();
  std::vector<WorldSpec> worlds;
  worlds.push_back(verify_world("device-plan verify bf16", 81));
  WorldSpec window = verify_world("device-plan verify window 200", 82);
  window.window = 200;
  worlds.push_back(window);
  WorldSpec fp8 = verify_world("device-plan verify fp8 e5m2", 83);
  fp8.kv = DType::kFloat8E5M2;
  worlds.push_back(fp8);
  WorldSpec big_tree = verify_world("device-plan verify 40-token trees", 84);
  big_tree.draft_token_num = 40;
  worlds.push_back(big_tree);
  for (WorldSpec& spec : worlds) {
    spec.device_lengths = true;
    SCOPED_TRACE(spec.label);
    check_buckets(spec, ForwardMode::kTargetVerify, {1, 4, 8}, 2);
  }
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
  const bool verify = mode == ForwardMode::kTargetVerify;
  const bool extend = mode == ForwardMode::kExtend || mode == ForwardMode::kMixed;
  const int per_request = verify ? spec.draft_token_num : 1;
  backend->init_cuda_graph_state(
      spec.max_bs, extend ? int64_t(spec.extend_tokens) : int64_t(spec.max_bs) * per_request);
  const int bs = 4;
  Graph graph;
  capture_bucket(w, *backend, w.random_step(mode, bs, bs), graph);
  EXPECT_NO_THROW(backend->check_errors(true));
  const int64_t num_slots = w.cache().num_slots();
  // A world planned on the device also sees a seq_len past max_context_len (kArgSeqLens);
  // TARGET_VERIFY a tree mask shorter than its rows (kArgCustomMask); EXTEND a prefix longer
  // than its sequence (kArgExtendPrefixLens) and lengths whose new tokens are not the step's
  // (kArgExtendSeqLens).
  std::vector<int> kinds{0, 1, 2};
  if (spec.device_lengths) kinds.push_back(3);
  if (spec.device_lengths && verify) kinds.push_back(4);
  if (spec.device_lengths && extend) kinds.insert(kinds.end(), {5, 6});
  for (int kind : kinds) {
    const Step s = w.random_step(mode, bs, bs);
    w.upload(s);
    std::string argument;
    std::function<void()> undo = [] {};
    if (kind == 5) {
      w.set_extend_on_device(0, 1, s.seq[1] + 1);
      argument = "extend_prefix_lens[1]";
    } else if (kind == 6) {
      // Request 3 one token longer (seq and extend consistent): one token more than the step's.
      int r = 3;
      while (r > 0 && s.seq[size_t(r)] >= spec.max_context) --r;
      w.set_seq_on_device(r, s.seq[size_t(r)] + 1);
      w.set_extend_on_device(1, r, s.q_lens[size_t(r)] + 1);
      argument = "extend_seq_lens";
    } else if (kind == 3) {
      w.set_seq_on_device(2, int32_t(spec.max_context + 5));
      argument = "seq_lens[2]";
    } else if (kind == 4) {
      argument = "spec.custom_mask";  // the batch's mask view is cut short below
    } else if (kind == 0) {
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

    ForwardBatch b = w.batch(s);
    if (kind == 4) {
      const TensorView& m = b.spec.custom_mask;
      b.spec.custom_mask =
          TensorView(const_cast<void*>(m.data()), m.dtype(), m.device(), {m.size(0) - 1});
    }
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
                                   "the replay after a refused one", /*oracle=*/true,
                                   tolerance_for(spec.io, spec.kv, BackendKind::kCuda, mode)));
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

TEST(CudaGraphsBadInput, RefusedDevicePlannedDecodeReplayWritesNothing) {
  REQUIRE_GPU();
  for (const char* kernel : {"0", "1"}) {
    WorldSpec spec = decode_world(
        kernel[0] == '0' ? "bad device-plan cuda-core" : "bad device-plan tensor", kernel, 62);
    spec.max_context = 1024;
    spec.device_lengths = true;
    check_bad_replays(spec, ForwardMode::kDecode);
  }
}

TEST(CudaGraphsBadInput, RefusedVerifyReplayWritesNothing) {
  REQUIRE_GPU();
  WorldSpec spec = verify_world("bad verify", 62);
  spec.max_context = 1024;
  check_bad_replays(spec, ForwardMode::kTargetVerify);
}

TEST(CudaGraphsBadInput, RefusedDevicePlannedVerifyReplayWritesNothing) {
  REQUIRE_GPU();
  WorldSpec spec = verify_world("bad device-plan verify", 63);
  spec.max_context = 1024;
  spec.device_lengths = true;
  check_bad_replays(spec, ForwardMode::kTargetVerify);
}

// ---- EXTEND / MIXED planned on the device (no host lengths; issue 15)
// ----------------------------

WorldSpec extend_world(const char* label, uint64_t seed) {
  WorldSpec w;
  w.label = label;
  w.seed = seed;
  w.device_lengths = true;
  w.max_context = 2048;
  w.extend_tokens = 700;  // split among the bucket's requests differently at every step
  return w;
}

// Capture an EXTEND (or MIXED) step once per bucket of (batch size, tokens), replay it with other
// lengths, prefixes and splits of the tokens, partly padded: every replay bitwise equal to its
// eager twin (also planned on the device) and, first and last, within the oracle's tolerance.
TEST(CudaGraphsDevicePlan, ExtendReplayEqualsEager) {
  REQUIRE_GPU();
  std::vector<std::pair<WorldSpec, ForwardMode>> worlds;
  worlds.push_back({extend_world("device-plan extend", 81), ForwardMode::kExtend});
  WorldSpec window = extend_world("device-plan extend window 300 page16", 82);
  window.window = 300;
  window.page_size = 16;
  worlds.push_back({window, ForwardMode::kExtend});
  WorldSpec fp8 = extend_world("device-plan extend fp8 e4m3", 83);
  fp8.kv = DType::kFloat8E4M3;
  worlds.push_back({fp8, ForwardMode::kExtend});
  WorldSpec hd64 = extend_world("device-plan mixed head_dim 64 fp16", 84);
  hd64.head_dim = 64;
  hd64.io = hd64.kv = DType::kFloat16;
  worlds.push_back({hd64, ForwardMode::kMixed});
  WorldSpec fp32 = extend_world("device-plan extend fp32 io", 85);
  fp32.io = DType::kFloat32;
  fp32.kv = DType::kBFloat16;
  worlds.push_back({fp32, ForwardMode::kExtend});
  for (const auto& [spec, mode] : worlds) {
    SCOPED_TRACE(spec.label);
    check_buckets(spec, mode, {1, 3, 8}, 3);
  }
}

// The device's plan is the host's (the same tiles, split and merged the same way): an EXTEND
// step planned on the device computes the bits the same step planned from its host lengths
// computes (both eager, the paged path: every step here has a cached prefix and fewer new
// tokens than the ragged threshold).
TEST(CudaGraphsDevicePlan, ExtendStepEqualsTheHostPlannedStep) {
  REQUIRE_GPU();
  for (int window : {-1, 300}) {
    WorldSpec spec = extend_world("extend device vs host plan", 86);
    spec.window = window;
    GraphWorld w(spec);
    for (int bs : {3, 5, 8}) {
      const Step s = w.random_step(ForwardMode::kExtend, bs, bs);
      w.upload(s);
      const ForwardBatch device = w.batch(s);
      ForwardBatch host = device;
      std::vector<int64_t> seq(s.seq.begin(), s.seq.end()), prefix, extend;
      for (int r = 0; r < bs; ++r) {
        prefix.push_back(s.seq[size_t(r)] - s.q_lens[size_t(r)]);
        extend.push_back(s.q_lens[size_t(r)]);
      }
      host.seq_lens_cpu = TensorView(seq.data(), DType::kInt64, Device::cpu(), {bs});
      host.extend_prefix_lens_cpu = TensorView(prefix.data(), DType::kInt64, Device::cpu(), {bs});
      host.extend_seq_lens_cpu = TensorView(extend.data(), DType::kInt64, Device::cpu(), {bs});
      expect_host_and_device_steps_equal(w, s, host, device);
    }
  }
}

TEST(CudaGraphsBadInput, RefusedDevicePlannedExtendReplayWritesNothing) {
  REQUIRE_GPU();
  WorldSpec spec = extend_world("bad device-plan extend", 87);
  spec.max_context = 1024;
  check_bad_replays(spec, ForwardMode::kExtend);
}

// ---- multi-step draft --------------------------------------------------------------------------

// Per bucket, the draft steps captured once (in_graph and every step), replayed with other
// lengths, partly padded: the pool, finite rows, the oracle (first and last), bitwise equal to
// an eager draft of the same batch.
void check_draft_replays(const WorldSpec& spec) {
  GraphWorld w(spec);
  auto draft = w.make_cuda_draft();
  draft->init_cuda_graph_state(spec.max_bs);
  const double tolerance = tolerance_for(spec.io, spec.kv, BackendKind::kCuda, ForwardMode::kDecode);
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
      const std::string label = "bucket " + std::to_string(bs) + " (" + std::to_string(real) +
                                " real) replay";
      const GraphWorld::PoolBytes pool = w.check_pool(s, label);
      for (int step = 0; step < spec.num_steps; ++step) {
        w.expect_finite_outputs(s, step, /*eager=*/false, label);
        if (t == 0 || t == 2) {
          const double err = w.oracle_error(s, step, pool);
          EXPECT_LE(err, tolerance) << label << " draft step " << step << " vs the float64 oracle";
          std::printf("  draft bucket %d real %d step %d: oracle err %.2e (tol %.0e)\n", bs, real,
                      step, err, tolerance);
        }
      }
      auto eager = w.make_cuda_draft();
      eager->init_forward_metadata(b);
      w.run_draft_steps(*eager, s, /*eager=*/true);
      CUDA_OK(cudaStreamSynchronize(w.stream()));
      for (int step = 0; step < spec.num_steps; ++step) {
        EXPECT_TRUE(w.output_bytes(step, s.real_tokens, false) ==
                    w.output_bytes(step, s.real_tokens, true))
            << spec.label << " bucket " << bs << " (" << real << " real), draft step " << step
            << ": replay differs from eager";
      }
    }
  }
}

WorldSpec draft_world(const char* label, uint64_t seed) {
  WorldSpec spec;
  spec.label = label;
  spec.topk = 2;
  spec.num_steps = 3;
  spec.max_context = 2048;
  spec.seed = seed;
  return spec;
}

TEST(CudaGraphsDraft, MultiStepReplayEqualsEager) {
  REQUIRE_GPU();
  check_draft_replays(draft_world("draft topk 2 x 3 steps", 41));
}

// Issue 15: the draft batch without seq_lens_cpu, each step's KV ranges and plan built on the
// device inside the graph: the shared-prefix path (the decode-shaped kernel's tiles) and one
// decode entry a branch (KVATTN_DRAFT_SHARED_PREFIX=0, the CUDA-core plan).
TEST(CudaGraphsDevicePlan, MultiStepDraftReplayEqualsEager) {
  REQUIRE_GPU();
  for (const char* shared : {"1", "0"}) {
    WorldSpec spec = draft_world(shared[0] == '1' ? "device-plan draft, shared prefix"
                                                  : "device-plan draft, an entry a branch",
                                 42);
    spec.device_lengths = true;
    spec.draft_shared_prefix = shared;
    SCOPED_TRACE(spec.label);
    check_draft_replays(spec);
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
