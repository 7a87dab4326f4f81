// kvattn.KvCacheConfig, kvattn.KvCache, kvattn.ReqToTokenPool, kvattn.SlotAllocator.
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>

#include "bindings.h"

namespace kvattn::python {

namespace {

std::vector<TensorView> layer_views(const std::vector<Array>& arrays, DType storage,
                                    const char* name) {
  std::vector<TensorView> views;
  views.reserve(arrays.size());
  for (size_t i = 0; i < arrays.size(); ++i) {
    const std::string label = std::string(name) + "[" + std::to_string(i) + "]";
    views.push_back(to_view(arrays[i], label.c_str(), storage));
  }
  return views;
}

}  // namespace

void bind_pools(nb::module_& m) {
  nb::class_<KvCacheConfig>(m, "KvCacheConfig", "Shape and storage of a KV pool.")
      .def(
          "__init__",
          [](KvCacheConfig* self, int num_layers, int64_t num_slots, int num_kv_heads, int head_dim,
             int v_head_dim, int page_size, nb::handle dtype, nb::handle device) {
            new (self) KvCacheConfig();
            self->num_layers = num_layers;
            self->num_slots = num_slots;
            self->num_kv_heads = num_kv_heads;
            self->head_dim = head_dim;
            self->v_head_dim = v_head_dim;
            self->page_size = page_size;
            self->dtype = dtype_arg(dtype);
            self->device = device_arg(device);
          },
          nb::kw_only(), nb::arg("num_layers") = 1, nb::arg("num_slots"), nb::arg("num_kv_heads"),
          nb::arg("head_dim"), nb::arg("v_head_dim") = 0, nb::arg("page_size") = 1,
          nb::arg("dtype") = "bf16", nb::arg("device") = "cpu")
      .def_rw("num_layers", &KvCacheConfig::num_layers)
      .def_rw("num_slots", &KvCacheConfig::num_slots, "slot 0 included; a multiple of page_size")
      .def_rw("num_kv_heads", &KvCacheConfig::num_kv_heads)
      .def_rw("head_dim", &KvCacheConfig::head_dim)
      .def_rw("v_head_dim", &KvCacheConfig::v_head_dim, "0 means head_dim")
      .def_rw("page_size", &KvCacheConfig::page_size)
      .def_prop_rw(
          "dtype", [](const KvCacheConfig& c) { return c.dtype; },
          [](KvCacheConfig& c, nb::handle d) { c.dtype = dtype_arg(d); })
      .def_prop_rw(
          "device", [](const KvCacheConfig& c) { return c.device.str(); },
          [](KvCacheConfig& c, nb::handle d) { c.device = device_arg(d); })
      .def_prop_ro("resolved_v_head_dim", &KvCacheConfig::resolved_v_head_dim)
      .def("validate", &KvCacheConfig::validate);

  nb::class_<PyKvCache>(m, "KvCache",
                        "The paged KV pool of all layers: K [num_slots, num_kv_heads, head_dim] "
                        "and V [num_slots, num_kv_heads, v_head_dim] per layer.")
      .def_static(
          "allocate",
          [](const KvCacheConfig& config) {
            PyKvCache result{KvCache::allocate(config), {}};
            return result;
          },
          nb::arg("config"), "Allocates every layer's K and V on config.device, zero-filled.")
      .def_static(
          "wrap",
          [](const KvCacheConfig& config, std::vector<Array> k_buffers,
             std::vector<Array> v_buffers) {
            const std::vector<TensorView> k = layer_views(k_buffers, config.dtype, "k_buffers");
            const std::vector<TensorView> v = layer_views(v_buffers, config.dtype, "v_buffers");
            PyKvCache result{KvCache::wrap(config, k, v), std::move(k_buffers)};
            result.wrapped.insert(result.wrapped.end(), v_buffers.begin(), v_buffers.end());
            return result;
          },
          nb::arg("config"), nb::arg("k_buffers"), nb::arg("v_buffers"),
          "Wraps engine-owned buffers, one K and one V array per layer, without copying. For "
          "bf16/fp16 storage a uint16 array, for fp8 a uint8 array may carry the raw bits.")
      .def_prop_ro("config", [](const PyKvCache& c) { return c.cache.config(); })
      .def_prop_ro("num_layers", [](const PyKvCache& c) { return c.cache.num_layers(); })
      .def_prop_ro("page_size", [](const PyKvCache& c) { return c.cache.page_size(); })
      .def_prop_ro("num_slots", [](const PyKvCache& c) { return c.cache.num_slots(); })
      .def_prop_ro("num_pages", [](const PyKvCache& c) { return c.cache.num_pages(); })
      .def(
          "k_buffer",
          [](nb::handle self, int layer_id, bool as_bits) {
            const PyKvCache& c = nb::cast<const PyKvCache&>(self);
            return view_to_array(c.cache.k_buffer(layer_id), self, as_bits);
          },
          nb::arg("layer_id"), nb::arg("as_bits") = false,
          "Layer K as a DLPack array over the pool's memory (no copy). as_bits exports bf16/fp16 "
          "as uint16 and fp8 as uint8, for NumPy.")
      .def(
          "v_buffer",
          [](nb::handle self, int layer_id, bool as_bits) {
            const PyKvCache& c = nb::cast<const PyKvCache&>(self);
            return view_to_array(c.cache.v_buffer(layer_id), self, as_bits);
          },
          nb::arg("layer_id"), nb::arg("as_bits") = false)
      .def(
          "set_scales",
          [](PyKvCache& c, int layer_id, float k_scale, float v_scale) {
            c.cache.set_scales(layer_id, k_scale, v_scale);
          },
          nb::arg("layer_id"), nb::arg("k_scale"), nb::arg("v_scale"))
      .def("k_scale", [](const PyKvCache& c, int layer_id) { return c.cache.k_scale(layer_id); })
      .def("v_scale", [](const PyKvCache& c, int layer_id) { return c.cache.v_scale(layer_id); });

  nb::class_<PyReqToTokenPool>(m, "ReqToTokenPool",
                               "req_to_token: int32 [max_reqs, max_context_len]; row r lists "
                               "the slot of each token of request r.")
      .def_static(
          "allocate",
          [](int max_reqs, int max_context_len, nb::handle device) {
            PyReqToTokenPool result{
                ReqToTokenPool::allocate(max_reqs, max_context_len, device_arg(device)), {}};
            return result;
          },
          nb::arg("max_reqs"), nb::arg("max_context_len"), nb::arg("device") = "cpu")
      .def_static(
          "wrap",
          [](Array table) {
            PyReqToTokenPool result{ReqToTokenPool::wrap(to_view(table, "req_to_token")), table};
            return result;
          },
          nb::arg("req_to_token"),
          "Wraps an engine-owned contiguous int32 [max_reqs, max_context_len] array.")
      .def_prop_ro("max_reqs", [](const PyReqToTokenPool& p) { return p.pool.max_reqs(); })
      .def_prop_ro("max_context_len",
                   [](const PyReqToTokenPool& p) { return p.pool.max_context_len(); })
      .def_prop_ro("device", [](const PyReqToTokenPool& p) { return p.pool.device().str(); })
      .def_prop_ro(
          "table",
          [](nb::handle self) {
            return view_to_array(nb::cast<const PyReqToTokenPool&>(self).pool.table(), self);
          },
          "The table as a DLPack array over the pool's memory (no copy).")
      .def(
          "write",
          [](PyReqToTokenPool& p, int req, int64_t start, nb::handle slots) {
            const std::vector<int32_t> values = int32_values(slots, "slots");
            p.pool.write(req, start, values);
          },
          nb::arg("req"), nb::arg("start"), nb::arg("slots"),
          "Writes slots into row req at positions [start, start + len(slots)).")
      .def(
          "read",
          [](const PyReqToTokenPool& p, int req, int64_t start, int64_t count) {
            return int32_numpy(p.pool.read(req, start, count));
          },
          nb::arg("req"), nb::arg("start"), nb::arg("count"));

  nb::class_<SlotAllocator>(m, "SlotAllocator",
                            "Hands out pages of a KV pool and takes them back; page 0 is never "
                            "handed out. Host-only, not thread-safe.")
      .def(nb::init<int64_t, int>(), nb::arg("num_slots"), nb::arg("page_size") = 1)
      .def_prop_ro("page_size", &SlotAllocator::page_size)
      .def_prop_ro("num_pages", &SlotAllocator::num_pages)
      .def_prop_ro("free_page_count", &SlotAllocator::free_page_count)
      .def_prop_ro("free_slot_count", &SlotAllocator::free_slot_count)
      .def(
          "allocate_pages",
          [](SlotAllocator& a, int64_t count) { return int32_numpy(a.allocate_pages(count)); },
          nb::arg("count"), "count page ids (int32 NumPy array); raises MemoryError when short.")
      .def(
          "allocate_tokens",
          [](SlotAllocator& a, int64_t current_len, int32_t last_slot, int64_t count) {
            return int32_numpy(a.allocate_tokens(current_len, last_slot, count));
          },
          nb::arg("current_len"), nb::arg("last_slot"), nb::arg("count"),
          "Slots for count more tokens of a request that holds current_len tokens, the last in "
          "last_slot: fills the last page first, then takes new pages.")
      .def(
          "free_pages",
          [](SlotAllocator& a, nb::handle pages) { a.free_pages(int32_values(pages, "pages")); },
          nb::arg("pages"))
      .def(
          "free_slots",
          [](SlotAllocator& a, nb::handle slots) { a.free_slots(int32_values(slots, "slots")); },
          nb::arg("slots"))
      .def("reset", &SlotAllocator::reset);
}

}  // namespace kvattn::python
