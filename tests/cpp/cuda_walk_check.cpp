// Runs the CUDA element-wise kernels on the host: the real launch packing
// (launch_plan.h), the real launch items and dtype dispatch, and the real chunk walk
// (ElementwiseFunctor in chunk_walk.cuh) with Adam's math (or, given sgd_rounding=R,
// SGD's with momentum in rounding R: its math depends on the tensor), each launch executed block by
// block and thread by thread with emulated blockIdx/threadIdx/blockDim.  The threads of
// an element-wise block share nothing, so running them one after another is what the GPU
// computes.  Compiled by a host C++ compiler with CUDA's headers (no GPU, no nvcc), for
// tests/test_cuda_math.py to compare with the CPU kernels.
//
//   cuda_walk_check DIR PARAM GRAD COPY SIZE key=value ...
//
// PARAM, GRAD: f32|f16|bf16; COPY: none|f16|bf16; SIZE: 4k|32k (kernel-argument capacity).
// DIR/layout.txt holds one "numel offset" line per tensor: each tensor starts `offset`
// elements after the end of the previous one in the flat buffers DIR/p.bin, g.bin, s0.bin,
// s1.bin (float32) and c.bin (the copy), so alignment varies from tensor to tensor.  The
// updated buffers are written to DIR/*.out; the launches made are printed.
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

// The CUDA built-ins the chunk walk reads, as host variables.
uint3 threadIdx, blockIdx;
dim3 blockDim;

#include "common/sgd_rounding.h"
#include "cuda/chunk_walk.cuh"

using namespace fastopt;
using namespace fastopt::cuda;

namespace {

// A flat buffer whose first element is 64-byte aligned, as a CUDA allocation's is.
struct Buffer {
  std::vector<unsigned char> storage;
  unsigned char* base = nullptr;
  size_t size = 0, elem = 4;
  DType dtype = DType::kFloat32;
  unsigned char* at(int64_t element) { return base + element * elem; }
};

DType parse_dtype(const std::string& s, size_t* elem) {
  *elem = s == "f32" ? 4 : 2;
  return s == "f32" ? DType::kFloat32 : s == "f16" ? DType::kFloat16 : DType::kBFloat16;
}

Buffer read(const std::string& path, const std::string& dtype) {
  Buffer b;
  b.dtype = parse_dtype(dtype, &b.elem);
  std::vector<unsigned char> raw;
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) std::exit(4);
  unsigned char chunk[65536];
  size_t n;
  while ((n = std::fread(chunk, 1, sizeof chunk, f)) > 0) raw.insert(raw.end(), chunk, chunk + n);
  std::fclose(f);
  b.size = raw.size();
  b.storage.resize(raw.size() + 64);
  const uintptr_t addr = reinterpret_cast<uintptr_t>(b.storage.data());
  b.base = b.storage.data() + (64 - addr % 64) % 64;
  std::memcpy(b.base, raw.data(), raw.size());
  return b;
}

void write(const std::string& path, const Buffer& b) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f || std::fwrite(b.base, 1, b.size, f) != b.size) std::exit(3);
  std::fclose(f);
}

int g_launches = 0;

template <bool kBig>
struct EmulatedLaunch {
  template <int D, typename F>
  void operator()(const std::vector<LaunchItem<D>>& items, const F& f) const {
    multi_tensor_apply<D, kBig>(items, [&](const TensorList<D, kBig>& tl, int blocks) {
      ++g_launches;
      blockDim = dim3(kBlockSize, 1, 1);
      for (int b = 0; b < blocks; ++b) {
        blockIdx.x = b;
        for (unsigned t = 0; t < static_cast<unsigned>(kBlockSize); ++t) {
          threadIdx.x = t;
          f(tl);
        }
      }
    });
  }
};

}  // namespace

int main(int argc, char** argv) {
  if (argc < 6) return 2;
  const std::string dir = argv[1], pdt = argv[2], gdt = argv[3], cdt = argv[4], size = argv[5];
  std::map<std::string, double> args;
  for (int i = 6; i < argc; ++i) {
    const std::string kv = argv[i];
    const size_t eq = kv.find('=');
    args[kv.substr(0, eq)] = std::atof(kv.substr(eq + 1).c_str());
  }
  std::vector<std::pair<int64_t, int64_t>> layout;  // numel, offset
  FILE* lf = std::fopen((dir + "/layout.txt").c_str(), "r");
  long long numel, offset;
  while (lf && std::fscanf(lf, "%lld %lld", &numel, &offset) == 2) layout.emplace_back(numel, offset);
  if (lf) std::fclose(lf);

  Buffer p = read(dir + "/p.bin", pdt), g = read(dir + "/g.bin", gdt);
  Buffer s0 = read(dir + "/s0.bin", "f32"), s1 = read(dir + "/s1.bin", "f32");
  const bool copy = cdt != "none";
  Buffer c = copy ? read(dir + "/c.bin", cdt) : Buffer{};
  Slots slots;
  int64_t pos = 0;
  for (auto [n, off] : layout) {
    pos += off;
    TensorSlot s;
    s.numel = n;
    s.param = p.at(pos);
    s.param_dtype = p.dtype;
    s.grad = g.at(pos);
    s.grad_dtype = g.dtype;
    s.state[0] = reinterpret_cast<float*>(s0.at(pos));
    s.state[1] = reinterpret_cast<float*>(s1.at(pos));
    if (copy) {
      s.copy = c.at(pos);
      s.copy_dtype = c.dtype;
    }
    slots.push_back(s);
    pos += n;
  }
  auto a = [&](const char* k) { return static_cast<float>(args[k]); };
  const AdamArgs adam{a("lr"), a("beta1"), a("beta2"), a("eps"), a("weight_decay"), a("step_size"),
                      a("bias_correction2_sqrt"), static_cast<float>(1.0 / args["bias_correction2_sqrt"]),
                      a("inv_grad_scale"), false, args["adamw"] != 0.0, false,
                      args["beta1"], args["beta2"],
                      static_cast<float>(1.0 - static_cast<double>(a("lr")) * a("weight_decay")), false};
  const DeviceScalars d;
  auto launch_all = [&](auto states, const auto& math) {
    if (size == "32k")
      elementwise_launches<decltype(states)::value>(slots, math, d, EmulatedLaunch<true>{});
    else
      elementwise_launches<decltype(states)::value>(slots, math, d, EmulatedLaunch<false>{});
  };
  if (args.count("sgd_rounding")) {  // the momentum buffer in s0; s1 untouched
    const Rounding r = static_cast<Rounding>(static_cast<int>(args["sgd_rounding"]));
    const SgdArgs sgd{a("lr"), a("momentum"), sgd_one_minus_dampening(args["dampening"], r), a("weight_decay"),
                      a("inv_grad_scale"), false, args["maximize"] != 0.0, false, false, r};
    launch_all(std::integral_constant<int, 1>{}, sgd_math(sgd));
  } else {
    launch_all(std::integral_constant<int, 2>{}, adam_math(adam, true));
  }
  write(dir + "/p.out", p);
  write(dir + "/s0.out", s0);
  write(dir + "/s1.out", s1);
  if (copy) write(dir + "/c.out", c);
  std::printf("launches %d\n", g_launches);
  return 0;
}
