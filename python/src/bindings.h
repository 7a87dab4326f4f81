// The nanobind module kvattn._kvattn: the Python-side holders of the C++ objects and the
// DLPack <-> TensorView conversions they share.
//
// Every holder keeps alive the Python objects whose memory its C++ object points into (the
// arrays a ForwardBatch or a wrapped KvCache views, the pools a backend was made for), so a view
// can never outlive its memory while Python still references the holder.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <memory>
#include <optional>
#include <vector>

#include "kvattn/kvattn.h"

namespace kvattn::python {

namespace nb = nanobind;

/// Any array that crosses by DLPack or the buffer protocol: any dtype, any device, any shape.
using Array = nb::ndarray<>;

/// DLPack dtype codes this binding reads (DLPack 1.1 numbering).
enum DlpackCode : uint8_t {
  kDlInt = 0,
  kDlUInt = 1,
  kDlFloat = 2,
  kDlBfloat = 4,
  kDlBool = 6,
  kDlFloat8E4M3FN = 10,
  kDlFloat8E5M2 = 12,
};

/// DLPack device types this binding reads.
enum DlpackDevice : int {
  kDlCpu = 1,
  kDlCuda = 2,
  kDlCudaHost = 3,  ///< pinned host memory: addressable from the host
  kDlCudaManaged = 13,
};

/// A TensorView of `array`, zero-copy. `storage` names the dtype the caller expects where an
/// unsigned-integer array of the same width may stand for it (NumPy has no bf16 or fp8: a uint16
/// array carries bf16 bits, a uint8 array fp8 bits). Throws kvattn::Error (ValueError in Python)
/// naming `name` for an unsupported dtype, device or rank.
TensorView to_view(const Array& array, const char* name,
                   std::optional<DType> storage = std::nullopt);

/// to_view for an optional argument: an absent view for an invalid (None) array.
TensorView to_view_or_absent(const Array& array, const char* name,
                             std::optional<DType> storage = std::nullopt);

// ---- per-call array arguments ----------------------------------------------------------------
//
// The per-layer calls (forward, forward_step) take their arrays as plain Python objects. An
// object whose type publishes DLPack's C exchange API (type(x).__dlpack_c_exchange_api__,
// DLPack >= 1.3: torch >= 2.10 tensors) is read in C with no capsule, no Python call and no
// allocation; any other array goes through nanobind's DLPack / buffer-protocol import.

struct DlpackExchangeApi;  ///< DLPack's DLPackExchangeAPI (tensor_args.cpp declares its layout)

/// One array argument of one call: its view, plus what keeps that view valid while the call runs
/// (the caller's object does for the C exchange; `imported` for nanobind's import).
struct ArrayArg {
  TensorView view;
  nb::dlpack::dtype raw_dtype{};           ///< the DLPack dtype as the producer gave it
  const DlpackExchangeApi* api = nullptr;  ///< the C exchange API of its type, if any
  Array imported;
};

/// `object` as an ArrayArg (zero-copy). None gives an absent view when `optional`, else the
/// "is None" error; an object that is no array raises TypeError naming `name`.
ArrayArg array_arg(nb::handle object, const char* name, std::optional<DType> storage,
                   bool optional = false);

/// A new uninitialised contiguous [rows, width] array of the same library, dtype and device as
/// `like` (the object `like_arg` was read from), and its view in `out`: like.new_empty((rows,
/// width)) (for torch an ordinary caching-allocator tensor), or with `dlpack_alloc` (or where
/// there is no new_empty) that library's allocator through the C exchange API, with no Python
/// call: cheaper, but torch wraps such memory in a DLPack deleter (fixed-size storage, which
/// record_stream skips).
nb::object new_array_like(nb::handle like, const ArrayArg& like_arg, int64_t rows, int64_t width,
                          const char* name, std::optional<DType> storage, ArrayArg& out,
                          bool dlpack_alloc = false);

/// True when arrays of `object`'s type cross by the C exchange API, with its allocator.
bool has_exchange_api(nb::handle object);

/// A new [rows, width] array like `like_arg` from its library's allocator, for C++ loops that
/// time what an engine's C++ caller would do: returns an owning DLManagedTensorVersioned* (free
/// with free_managed) and its view in `view`. Throws where `like_arg` has no C exchange API.
void* allocate_managed_like(const ArrayArg& like_arg, int64_t rows, int64_t width, const char* name,
                            std::optional<DType> storage, TensorView& view);
void free_managed(void* managed);

/// An array over a TensorView's memory, owned by `owner` (the Python object that keeps the memory
/// alive). `as_bits` exports bf16/fp16 as uint16 and fp8 as uint8, for consumers without them.
nb::object view_to_array(const TensorView& view, nb::handle owner, bool as_bits = false);

/// Slot or page ids from a NumPy array, a list or any sequence of ints (throws naming `name`).
std::vector<int32_t> int32_values(nb::handle values, const char* name);

/// A NumPy int32 array that owns a copy of `values`.
nb::object int32_numpy(std::vector<int32_t> values);

/// A DType from a DType member or its name ("bf16", "fp8_e4m3", ...).
DType dtype_arg(nb::handle value);
/// A Device from a Device or a string: "cpu", "cuda", "cuda:1".
Device device_arg(nb::handle value);

// ---- holders ----------------------------------------------------------------------------------

/// kvattn.KvCache: the pool plus the engine-owned arrays it wraps.
struct PyKvCache {
  PyKvCache(KvCache c, std::vector<Array> w) : cache(std::move(c)), wrapped(std::move(w)) {}
  // KvCache owns move-only buffers (std::vector hides that from is_copy_constructible).
  PyKvCache(PyKvCache&&) = default;
  PyKvCache(const PyKvCache&) = delete;
  PyKvCache& operator=(const PyKvCache&) = delete;

  KvCache cache;
  std::vector<Array> wrapped;  ///< engine-owned K and V arrays (empty when allocated)
};

/// kvattn.ReqToTokenPool: the pool plus the engine-owned array it wraps.
struct PyReqToTokenPool {
  ReqToTokenPool pool;
  Array wrapped;
};

/// kvattn.BackendConfig: the C++ config plus the pools it names.
struct PyBackendConfig {
  BackendConfig config;
  nb::object kv_cache;           ///< a PyKvCache
  nb::object req_to_token_pool;  ///< a PyReqToTokenPool
};

/// The tensor fields of a ForwardBatch, by name; index into PyForwardBatch::arrays.
struct BatchTensorField {
  const char* name;
  TensorView& (*field)(ForwardBatch&);
};
inline constexpr int kNumBatchTensorFields = 15;
extern const BatchTensorField kBatchTensorFields[kNumBatchTensorFields];

/// kvattn.ForwardBatch: the C++ batch plus every array and pool its views point into.
struct PyForwardBatch {
  ForwardBatch batch;
  Array arrays[kNumBatchTensorFields];        ///< what the views point into
  nb::object objects[kNumBatchTensorFields];  ///< what the caller passed (returned by getters)
  nb::object kv_cache;
  nb::object req_to_token_pool;
};

/// kvattn.Backend: one AttentionBackend plus the pools it was made for.
struct PyBackend {
  std::unique_ptr<AttentionBackend> impl;
  BackendConfig config;
  nb::object kv_cache;
  nb::object req_to_token_pool;
};

/// kvattn.MultiStepDraftBackend.
struct PyDraftBackend {
  std::unique_ptr<MultiStepDraftBackend> impl;
  BackendConfig config;
  nb::object kv_cache;
  nb::object req_to_token_pool;
};

// ---- the parts of the module -------------------------------------------------------------------

void bind_basics(nb::module_& m);   ///< errors, enums, Device, AttentionLayer, helpers
void bind_pools(nb::module_& m);    ///< KvCacheConfig, KvCache, ReqToTokenPool, SlotAllocator
void bind_backend(nb::module_& m);  ///< ForwardBatch, BackendConfig, Backend, draft backend

}  // namespace kvattn::python
