// The single registration unit of megatron_rl._C.
//
// Tensor ops: schemas declared once here (TORCH_LIBRARY), CPU kernels registered here, CUDA
// kernels registered next to their code in the .cu files, fake kernels and autograd registered
// from Python (megatron_rl/ops/_registry.py). Host helpers (planner, streaming buffer) are plain
// pybind11 on the same module.
// pybind11 with torch's Tensor casters, not <torch/extension.h>: that one also pulls the whole
// C++ frontend (torch/all.h: nn, optim, data), which this file never uses and which took half
// of its compile time.
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include "block_mask/block_mask.h"
#include "packing/packing.h"
#include "streaming/streaming.h"

namespace py = pybind11;

TORCH_LIBRARY(megatron_rl, m) {
  m.def("pack(Tensor src, Tensor src_starts, Tensor cu_seqlens, SymInt total) -> Tensor");
  m.def(
      "unpack(Tensor packed, Tensor dst_starts, Tensor cu_seqlens, SymInt num_rows, "
      "Scalar fill) -> Tensor");
  m.def("position_ids(Tensor cu_seqlens, SymInt total) -> Tensor");
  m.def(
      "block_diffusion_structure(Tensor seq_lens, Tensor prompt_lens, int block_size, "
      "bool response_origin, int tile, SymInt total) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "diffusion_mask_tokens(Tensor input_ids, Tensor cu_seqlens, Tensor prompt_lens, "
      "Tensor ratios, Tensor seeds, int block_size, bool response_origin, int mask_id, "
      "bool complement) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(megatron_rl, CPU, m) {
  m.impl("pack", &megatron_rl::pack_cpu);
  m.impl("unpack", &megatron_rl::unpack_cpu);
  m.impl("position_ids", &megatron_rl::position_ids_cpu);
  m.impl("block_diffusion_structure", &megatron_rl::block_diffusion_structure_cpu);
  m.impl("diffusion_mask_tokens", &megatron_rl::diffusion_mask_tokens_cpu);
}

namespace {

py::tuple batch_to_py(megatron_rl::StreamBatch&& b) {
  return py::make_tuple(b.sample_ids, b.finished, b.tokens, b.offsets);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megatron-rl kernels: torch ops under torch.ops.megatron_rl plus host helpers";
#ifdef MEGATRON_RL_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
  m.def("plan_microbatches", &megatron_rl::plan_microbatches, py::arg("lengths"),
        py::arg("max_tokens"), py::arg("num_ranks"), py::arg("seed") = 0,
        py::call_guard<py::gil_scoped_release>(),
        "Token-budget micro-batch plan: ranks -> micro-batches -> sample indices");

  using Buf = megatron_rl::TokenStreamBuffer;
  py::class_<Buf>(m, "TokenStreamBuffer")
      .def(py::init<int64_t, bool>(), py::arg("capacity_tokens"), py::arg("pin_memory"))
      .def("append", &Buf::append, py::arg("sample_id"), py::arg("tokens"),
           py::arg("finished") = false, py::arg("timeout_s") = -1.0,
           py::call_guard<py::gil_scoped_release>())
      .def("append", &Buf::append_list, py::arg("sample_id"), py::arg("tokens"),
           py::arg("finished") = false, py::arg("timeout_s") = -1.0,
           py::call_guard<py::gil_scoped_release>())
      .def(
          "take",
          [](Buf& self, int64_t max_samples, bool partial, double timeout_s) {
            megatron_rl::StreamBatch b;
            {
              py::gil_scoped_release release;
              b = self.take(max_samples, partial, timeout_s);
            }
            return batch_to_py(std::move(b));
          },
          py::arg("max_samples") = 0, py::arg("partial") = false, py::arg("timeout_s") = -1.0)
      .def("drain",
           [](Buf& self) {
             megatron_rl::StreamBatch b;
             {
               py::gil_scoped_release release;
               b = self.drain();
             }
             return batch_to_py(std::move(b));
           })
      .def("close", &Buf::close, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("closed", &Buf::closed)
      .def_property_readonly("buffered_tokens", &Buf::buffered_tokens)
      .def_property_readonly("capacity", &Buf::capacity);
}
