// kvattn — the attention backend interface (SPEC §4) and the factory.
//
// An engine makes one backend per model and calls it once per step
// (init_forward_metadata) and once per layer (forward). All shapes below are in elements:
//   q    [num_tokens, num_q_heads, head_dim]   or [num_tokens, num_q_heads * head_dim]
//   k    [num_tokens, num_kv_heads, head_dim]  (absent when save_kv_cache is false)
//   v    [num_tokens, num_kv_heads, v_head_dim]
//   out  [num_tokens, num_q_heads, v_head_dim] or [num_tokens, num_q_heads * v_head_dim]
// q, k, v and out share one dtype (fp32, bf16 or fp16); the last dimension is contiguous.
//
// Log-sum-exp convention: wherever kvattn returns or merges an LSE, it is in natural log
// (base e) of the sum of exp(scaled logit), the scaled logit being the soft-capped q·k*scaling.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvattn/error.h"
#include "kvattn/forward_batch.h"
#include "kvattn/kv_cache.h"
#include "kvattn/tensor.h"

namespace kvattn {

enum class BackendKind : uint8_t { kCpu, kCuda };
const char* backend_kind_name(BackendKind kind);
/// "cpu" or "cuda"; throws on anything else.
BackendKind parse_backend_kind(const std::string& name);

/// Whether decode runs on tensor cores (the q heads of a kv head packed into MMA rows). kAuto
/// picks them for GQA groups of 4 where the decode-shaped kernel serves the head dims (head_dim
/// == v_head_dim in {64, 128}, fp8 KV included) and for every group larger than 4; the CUDA-core
/// kernel otherwise (bench/NOTES.md). The environment variable KVATTN_DECODE_TENSOR_CORES=0/1
/// overrides.
enum class TensorCoreDecode : uint8_t { kAuto, kOn, kOff };

/// What a backend is made for: the model's attention shape and the engine's pools.
struct BackendConfig {
  KvCache* kv_cache = nullptr;                     ///< required
  const ReqToTokenPool* req_to_token_pool = nullptr;  ///< required
  int num_q_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int v_head_dim = 0;        ///< 0 = head_dim
  DType q_dtype = DType::kBFloat16;
  /// The model's sliding window (-1 = none). When set, the backend keeps two index sets,
  /// window and full, and picks per layer by layer.sliding_window_size.
  int sliding_window_size = -1;
  bool is_encoder_decoder = false;  ///< keeps self and cross index sets; exclusive with a window
  /// EXTEND takes the ragged + paged-prefix path when the step has at least this many new
  /// tokens, more new tokens than cached prefix tokens, and no window / cross-attention (the
  /// reference uses 4096 and no prefix rule). A step with no cached prefix at all takes the
  /// ragged path at any size when the cache stores k/v in the q dtype (nothing to merge, and it
  /// reads exactly what the cache holds; a forward without k/v then attends paged).
  /// 0 forces the path for every EXTEND / MIXED step.
  int64_t ragged_extend_threshold = 4096;
  TensorCoreDecode decode_tensor_cores = TensorCoreDecode::kAuto;
  int num_threads = 0;  ///< CPU backend: worker threads; 0 = KVATTN_NUM_THREADS or all cores
  /// Batch-invariant output: a request's output is bitwise the same whatever other requests
  /// share its batch (and whatever the step's size), for RL rollouts and reproducible
  /// evaluations. The kernels' tiles and KV splits then depend on the request alone: fixed
  /// tile shapes, fixed split chunks (CPU) or no split (CUDA prefill kernels), one kernel family
  /// for every mode (CUDA: decode on the tensor-core path), no ragged EXTEND path. Costs speed
  /// (bench/NOTES.md, "Deterministic mode").
  bool deterministic = false;
  void* cuda_stream = nullptr;  ///< CUDA backend: the cudaStream_t kernels run on (null = default)
};

/// A step the backend refused after the calls that planned and ran it had returned: a bad index
/// that only the device could see (CUDA backend; see AttentionBackend::check_errors). Nothing of
/// the step was written: the KV pool is as it was before the step, and the step's outputs were
/// not computed (`out` and lse hold whatever they held before).
struct StepError {
  uint64_t step = 0;  ///< step_id() of the refused step
  ErrorKind kind = ErrorKind::kInvalidArgument;
  std::string argument;  ///< the first bad index, e.g. "out_cache_loc[17]" or "req_to_token[5][3]"
  std::string message;   ///< the full text: argument, step, value and the expected range
};

/// The backend interface. Methods throw kvattn::Error on bad input; a failed call leaves the KV
/// pool as it was.
///
/// Bad indices (SPEC §5) are refused as a whole step, never half: on the CPU backend the call
/// that meets them throws before anything is written; on the CUDA backend, where index tensors
/// live on the device and reading them on the host would cost a sync per step, the step's
/// device work validates them first (in init_forward_metadata_in_graph) and every kernel of the
/// step that writes (K/V saves, attention outputs) then does nothing. The engine learns of such
/// a step from check_errors() (or take_step_errors()), which it calls where it synchronises
/// anyway (e.g. after reading the sampled tokens); each refused step is reported exactly once,
/// with its step_id(), and a later step that is itself good is never failed by it. Both
/// backends report the same bad index with the same ErrorKind (kInvalidArgument) and the same
/// argument name.
class AttentionBackend {
 public:
  virtual ~AttentionBackend() = default;
  virtual BackendKind kind() const = 0;
  virtual Device device() const = 0;

  /// The number of the step the latest init_forward_metadata_out_graph began: 1 for the first
  /// call, one more for each later call (whether it succeeded or threw); 0 before any.
  virtual uint64_t step_id() const = 0;
  /// The steps refused on the device since the last call, oldest first; each is returned once.
  /// Does not wait: a step whose device work has not finished yet is reported by a later call
  /// (call it after a point where the engine has synchronised with the step, or pass
  /// synchronize = true to wait for the backend's stream first). Always empty on the CPU
  /// backend, which throws from the call itself.
  virtual std::vector<StepError> take_step_errors(bool synchronize = false) {
    (void)synchronize;
    return {};
  }
  /// take_step_errors(), thrown: kvattn::Error (kind, argument and step() of the oldest refused
  /// step; the message names every refused step it reports), or nothing when no step was
  /// refused. What an engine does on it: drop the refused step's results (sampled tokens,
  /// outputs), free or fix the requests named, and go on; the KV pool and the backend are as
  /// they were before that step.
  void check_errors(bool synchronize = false);
  /// CUDA backend: the cudaStream_t later calls run on (an engine switches streams, e.g. for
  /// graph capture on a side stream). Set it before init_forward_metadata of a step, not between
  /// a step's metadata and its forward calls. Ignored by the CPU backend.
  virtual void set_cuda_stream(void* stream) { (void)stream; }

  /// Once per step: builds index arrays, masks and the work plan. = out_graph + in_graph.
  void init_forward_metadata(const ForwardBatch& batch) {
    init_forward_metadata_out_graph(batch, /*in_capture=*/false);
    init_forward_metadata_in_graph(batch);
  }
  /// Host work with dynamic shapes; runs outside CUDA-graph capture.
  virtual void init_forward_metadata_out_graph(const ForwardBatch& batch, bool in_capture) = 0;
  /// Static-shape device work that may be recorded in a CUDA graph.
  virtual void init_forward_metadata_in_graph(const ForwardBatch& batch) = 0;

  /// Per layer: dispatches on batch.mode (IDLE -> nothing to write, DECODE -> forward_decode,
  /// anything else -> forward_extend). Saves k/v at batch.out_cache_loc first when
  /// save_kv_cache is true (cross-attention layers: at batch.encoder_out_cache_loc).
  void forward(const TensorView& q, const TensorView& k, const TensorView& v,
               const TensorView& out, const AttentionLayer& layer, const ForwardBatch& batch,
               bool save_kv_cache = true);
  virtual void forward_decode(const TensorView& q, const TensorView& k, const TensorView& v,
                              const TensorView& out, const AttentionLayer& layer,
                              const ForwardBatch& batch, bool save_kv_cache) = 0;
  virtual void forward_extend(const TensorView& q, const TensorView& k, const TensorView& v,
                              const TensorView& out, const AttentionLayer& layer,
                              const ForwardBatch& batch, bool save_kv_cache) = 0;

  // ---- CUDA graphs (no-ops on the CPU backend) ------------------------------------------
  /// Allocates every buffer a captured step touches, once. max_bs: the largest batch size
  /// (bucket) captured; max_num_tokens: the most query tokens such a step carries (max_bs for
  /// DECODE, max_bs * draft_token_num for TARGET_VERIFY, the token bucket for EXTEND-like
  /// steps). Batches of up to max_bs requests then run on these fixed buffers with launch sizes
  /// that depend on the batch size (and, EXTEND-like, its token count) alone, so a graph
  /// captured once for a bucket replays any later batch of that bucket, right after
  /// init_forward_metadata_out_graph for it. EXTEND, MIXED and DRAFT_EXTEND steps are captured
  /// when they carry no host lengths (no seq_lens_cpu / extend_*_cpu: planned on the device,
  /// the paged path); with host lengths they run eagerly and their capture is refused. Capturing
  /// a forward needs these buffers wherever the step runs on tensor cores (TARGET_VERIFY,
  /// EXTEND-like steps, the draft steps, and DECODE at GQA groups of 4 and more by default): a
  /// capture without them is refused with kNotSupported.
  virtual void init_cuda_graph_state(int max_bs, int64_t max_num_tokens) = 0;
  /// Seq-len value for padded batch entries.
  virtual int cuda_graph_seq_len_fill_value() const = 0;
  virtual void on_after_cuda_graph_warmup() {}

  // ---- speculative decoding ---------------------------------------------------------------
  /// {tree mask, positions} buffers to fill after draft; absent views where not needed.
  virtual std::array<TensorView, 2> verify_buffers_to_fill_after_draft() { return {}; }
  /// Redo the metadata that depends on those buffers once they are filled.
  virtual void update_verify_buffers_to_fill_after_draft(const ForwardBatch& batch,
                                                         int cuda_graph_bs);

  // ---- optional hooks the reference declares; a backend without one says so -------------
  virtual void init_forward_metadata_for_breakable_cuda_graph_capture(const ForwardBatch& batch);
  virtual void prepare_forward_metadata_for_breakable_cuda_graph_replay(const ForwardBatch& batch);
  /// Sparse-attention indexer metadata: none of kvattn's backends has one (returns false).
  virtual bool supports_indexer_metadata() const { return false; }
};

/// What the CPU backend runs on this machine (for an engine's logs and for benchmarks).
struct CpuBackendInfo {
  int num_threads = 0;       ///< workers of a backend made with num_threads = 0 (KVATTN_NUM_THREADS
                             ///< or the CPUs this process may run on)
  bool avx512_bf16 = false;  ///< whether the AVX-512 BF16 kernels run here (KVATTN_CPU_ISA honoured)
  bool amx_bf16 = false;     ///< whether prefill tiles run on AMX-BF16 here (KVATTN_CPU_ISA honoured)
};
CpuBackendInfo cpu_backend_info();

/// Makes a backend of `kind`. Throws kNotSupported for kCuda in a build without CUDA or on a
/// machine without a GPU, and kInvalidArgument for a bad config.
std::unique_ptr<AttentionBackend> make_backend(BackendKind kind, const BackendConfig& config);

/// Speculative multi-step draft (SPEC §3): `topk` branches per request, `num_steps` draft
/// decode steps. Draft token of step s, branch b of request r sits in req_to_token at
/// position seq_len_r + s * topk + b. Step s decodes batch_size * topk queries (request-major,
/// branch-minor); query (r, b) sees the prefix [0, seq_len_r) and its branch's draft tokens of
/// steps 0..s. init_forward_metadata builds the index sets of all steps in one go.
class MultiStepDraftBackend {
 public:
  MultiStepDraftBackend(BackendKind kind, const BackendConfig& config, int topk, int num_steps);
  ~MultiStepDraftBackend();
  int topk() const { return topk_; }
  int num_steps() const { return num_steps_; }
  /// `batch`: mode kDecode, batch_size requests, seq_lens = committed prefix lengths.
  /// = init_forward_metadata_out_graph + init_forward_metadata_in_graph.
  void init_forward_metadata(const ForwardBatch& batch);
  /// Host planning of every step (outside CUDA-graph capture; in_capture as in
  /// AttentionBackend). After init_cuda_graph_state, batches of up to max_bs requests use
  /// fixed buffers, so a graph captured for a batch size replays later batches of that size.
  void init_forward_metadata_out_graph(const ForwardBatch& batch, bool in_capture);
  /// The device work (one launch builds the index sets of all steps); may be recorded in a
  /// CUDA graph together with the forward_step calls.
  void init_forward_metadata_in_graph(const ForwardBatch& batch);
  /// One draft step: q/k/v/out have batch_size * topk rows; k/v are saved at
  /// `out_cache_loc` (batch_size * topk slots) when given.
  void forward_step(int step, const TensorView& q, const TensorView& k, const TensorView& v,
                    const TensorView& out, const AttentionLayer& layer,
                    const TensorView& out_cache_loc);
  /// As AttentionBackend::init_cuda_graph_state, for batches of up to max_bs requests.
  void init_cuda_graph_state(int max_bs);
  /// As AttentionBackend::set_cuda_stream.
  void set_cuda_stream(void* stream);
  /// As AttentionBackend: one step is one init_forward_metadata (all its draft steps). A bad
  /// out_cache_loc given to forward_step refuses that draft step and every later one of the
  /// step (earlier draft steps, which the engine ran with good slots, stay written).
  uint64_t step_id() const;
  std::vector<StepError> take_step_errors(bool synchronize = false);
  void check_errors(bool synchronize = false);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  int topk_;
  int num_steps_;
};

}  // namespace kvattn
