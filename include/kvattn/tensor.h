// kvattn — a non-owning view of a tensor that the engine owns.
//
// The fields map one to one onto DLPack's DLTensor (data + byte_offset, device,
// ndim, dtype, shape, strides in elements), so a torch tensor, a NumPy array or
// any __dlpack__ object becomes a TensorView without a copy.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <iosfwd>
#include <string>

#include "kvattn/dtype.h"

namespace kvattn {

enum class DeviceType : uint8_t { kCPU, kCUDA };

/// Where memory lives: the host, or one CUDA device.
struct Device {
  DeviceType type = DeviceType::kCPU;
  int index = 0;

  static constexpr Device cpu() { return {DeviceType::kCPU, 0}; }
  static constexpr Device cuda(int index = 0) { return {DeviceType::kCUDA, index}; }
  bool is_cpu() const { return type == DeviceType::kCPU; }
  bool is_cuda() const { return type == DeviceType::kCUDA; }
  friend bool operator==(const Device& a, const Device& b) {
    return a.type == b.type && (a.type == DeviceType::kCPU || a.index == b.index);
  }
  std::string str() const;  ///< "cpu" or "cuda:0"
};

/// A strided view: data pointer, dtype, device, up to kMaxDims dimensions.
/// Strides are in elements, like DLPack and torch. A default view is "absent" (data == nullptr,
/// ndim == 0): optional arguments use it.
class TensorView {
 public:
  static constexpr int kMaxDims = 6;

  TensorView() = default;
  /// A contiguous (row-major) view of `shape`.
  TensorView(void* data, DType dtype, Device device, std::initializer_list<int64_t> shape);
  /// A view with explicit shape and strides (in elements), `ndim` of each.
  TensorView(void* data, DType dtype, Device device, int ndim, const int64_t* shape,
             const int64_t* strides);

  void* data() const { return data_; }
  template <typename T>
  T* data_as() const {
    return static_cast<T*>(data_);
  }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  int ndim() const { return ndim_; }
  int64_t size(int dim) const;    ///< negative dims count from the end
  int64_t stride(int dim) const;  ///< in elements; negative dims count from the end
  int64_t numel() const;
  int64_t nbytes() const { return numel() * dtype_size(dtype_); }
  bool defined() const { return data_ != nullptr || ndim_ > 0; }
  bool is_contiguous() const;
  /// Human-readable "[4, 32, 128] bf16 cuda:0" for messages.
  std::string describe() const;

  /// A view of rows [begin, end) of dimension 0.
  TensorView slice0(int64_t begin, int64_t end) const;
  /// The same memory seen with a new contiguous shape (the view must be contiguous).
  TensorView reshape(std::initializer_list<int64_t> shape) const;

 private:
  void* data_ = nullptr;
  DType dtype_ = DType::kFloat32;
  Device device_{};
  int ndim_ = 0;
  std::array<int64_t, kMaxDims> shape_{};
  std::array<int64_t, kMaxDims> strides_{};
};

/// Reads element i of a 1-D int32 or int64 host tensor as int64 (for validation and planning).
int64_t read_index(const TensorView& t, int64_t i);

/// Stream forms of Device::str() and TensorView::describe(), so error messages format them only
/// when a check fails.
std::ostream& operator<<(std::ostream& os, const Device& device);
std::ostream& operator<<(std::ostream& os, const TensorView& tensor);

}  // namespace kvattn
