// Runs the CUDA kernels' per-element math (csrc/cuda/optimizer_math.cuh) on the host, for
// tests/test_cuda_math.py to compare with the CPU kernels.  Compiled by nvcc (the structs
// are host-and-device code); it launches nothing, so it needs no GPU.
//
//   cuda_math_check ALGO DIR key=value ...
//
// reads DIR/p.bin, DIR/g.bin and DIR/s0.bin, DIR/s1.bin, ... (float32, the same length),
// applies one step of ALGO (adam, sgd, adagrad, lion, lamb, lars) as the kernels do, and
// writes DIR/p.out, DIR/s0.out, ...  Scalars come as key=value; the keys dev_grad_scale,
// dev_found_inf, dev_lr and dev_step put that scalar in "device" memory (DeviceScalars),
// as a step with device scalars would.
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "cuda/optimizer_math.cuh"

using namespace fastopt;
using namespace fastopt::cuda;

namespace {

std::map<std::string, double> g_args;

double arg(const std::string& key, double fallback = 0.0) {
  auto it = g_args.find(key);
  return it == g_args.end() ? fallback : it->second;
}
bool flag(const std::string& key) { return arg(key) != 0.0; }

std::vector<float> read(const std::string& path) {
  std::vector<float> out;
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return out;
  float x;
  while (std::fread(&x, sizeof x, 1, f) == 1) out.push_back(x);
  std::fclose(f);
  return out;
}

void write(const std::string& path, const std::vector<float>& v) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f || std::fwrite(v.data(), sizeof(float), v.size(), f) != v.size()) std::exit(3);
  std::fclose(f);
}

// The device scalars: host floats standing in for GPU memory.
float g_dev[4];
DeviceScalars device_scalars() {
  DeviceScalars d;
  const char* keys[4] = {"dev_grad_scale", "dev_found_inf", "dev_lr", "dev_step"};
  const float** slots[4] = {&d.grad_scale, &d.found_inf, &d.lr, &d.step};
  for (int k = 0; k < 4; ++k) {
    if (g_args.count(keys[k])) {
      g_dev[k] = static_cast<float>(arg(keys[k]));
      *slots[k] = &g_dev[k];
    }
  }
  return d;
}

// One element-wise step over every element, as ElementwiseFunctor does for each chunk.
template <typename Math>
void elementwise(Math m, const DeviceScalars& d, std::vector<float>& p, const std::vector<float>& g,
                 std::vector<std::vector<float>>& s) {
  if (d.found_inf != nullptr && *d.found_inf != 0.0f) return;
  m.prepare(d);
  if constexpr (HasForTensor<Math>::value) m.for_tensor(static_cast<int64_t>(p.size()));  // one tensor
  float sv[4];
  for (size_t i = 0; i < p.size(); ++i) {
    for (size_t k = 0; k < s.size(); ++k) sv[k] = s[k][i];
    m(p[i], g[i], sv);
    for (size_t k = 0; k < s.size(); ++k) s[k][i] = sv[k];
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) return 2;
  const std::string algo = argv[1], dir = argv[2];
  for (int i = 3; i < argc; ++i) {
    const std::string kv = argv[i];
    const size_t eq = kv.find('=');
    g_args[kv.substr(0, eq)] = std::atof(kv.substr(eq + 1).c_str());
  }
  std::vector<float> p = read(dir + "/p.bin"), g = read(dir + "/g.bin");
  std::vector<std::vector<float>> s;
  for (int k = 0;; ++k) {
    std::vector<float> v = read(dir + "/s" + std::to_string(k) + ".bin");
    if (v.empty()) break;
    s.push_back(v);
  }
  const DeviceScalars d = device_scalars();
  const float lr = static_cast<float>(arg("lr")), wd = static_cast<float>(arg("weight_decay"));
  const float inv = static_cast<float>(arg("inv_grad_scale", 1.0));
  if (algo == "adam") {
    AdamArgs a{lr, static_cast<float>(arg("beta1")), static_cast<float>(arg("beta2")), static_cast<float>(arg("eps")),
               wd, static_cast<float>(arg("step_size")), static_cast<float>(arg("bias_correction2_sqrt")),
               static_cast<float>(1.0 / arg("bias_correction2_sqrt")), inv,
               flag("amsgrad"), flag("adamw"), flag("maximize"), arg("beta1"), arg("beta2"),
               static_cast<float>(1.0 - static_cast<double>(lr) * wd), false,  // the binding's default decay
               static_cast<Rounding>(static_cast<int>(arg("rounding", 0.0)))};
    const bool bc = flag("bias_correction");
    if (a.rounding == Rounding::kTorchCudaForeach)
      elementwise(adam_math<Rounding::kTorchCudaForeach>(a, bc), d, p, g, s);
    else if (a.rounding == Rounding::kTorchCudaFused)
      elementwise(adam_math<Rounding::kTorchCudaFused>(a, bc), d, p, g, s);
    else if (a.rounding == Rounding::kTorchCudaForLoop)
      elementwise(adam_math<Rounding::kTorchCudaForLoop>(a, bc), d, p, g, s);
    else
      elementwise(adam_math(a, bc), d, p, g, s);
  } else if (algo == "sgd") {
    const Rounding r = static_cast<Rounding>(static_cast<int>(arg("rounding", 0.0)));
    SgdArgs a{lr, static_cast<float>(arg("momentum")), sgd_one_minus_dampening(arg("dampening"), r), wd, inv,
              flag("nesterov"), flag("maximize"), flag("wd_after_momentum"), flag("first_step"), r};
    elementwise(sgd_math(a), d, p, g, s);
  } else if (algo == "adagrad") {
    AdagradArgs a{static_cast<float>(arg("clr")), wd, static_cast<float>(arg("eps")), inv, flag("maximize"), false,
                  static_cast<Rounding>(static_cast<int>(arg("rounding", 0.0))), arg("clr"), arg("weight_decay"),
                  arg("eps")};
    elementwise(adagrad_math(a, arg("lr"), arg("lr_decay")), d, p, g, s);
  } else if (algo == "lion") {
    LionArgs a{lr, static_cast<float>(arg("beta1")), static_cast<float>(arg("beta2")), wd, inv, flag("maximize")};
    elementwise(lion_math(a), d, p, g, s);
  } else if (algo == "lamb") {  // the two passes of lamb.cu over one tensor
    LambArgs a{lr, static_cast<float>(arg("beta1")), static_cast<float>(arg("beta2")), static_cast<float>(arg("beta3")),
               static_cast<float>(arg("eps")), wd, static_cast<float>(arg("bias_correction1")),
               static_cast<float>(arg("bias_correction2")), static_cast<float>(arg("grad_factor")),
               flag("adam_w_mode"), flag("use_trust_ratio"), flag("maximize"), arg("beta1"), arg("beta2")};
    LambClip clip;
    double grad_sum_squares = 0.0;
    if (g_args.count("max_grad_norm")) {  // the clipping divisor from a "device" sum of squares
      for (float x : g) grad_sum_squares += static_cast<double>(x) * x;
      clip.grad_sum_squares = &grad_sum_squares;
      clip.max_grad_norm = static_cast<float>(arg("max_grad_norm"));
      clip.inv_grad_scale = inv;
    }
    LambMath m = lamb_math(a, clip, flag("bias_correction"));
    m.prepare(d);
    double ps = 0.0, us = 0.0;
    for (size_t i = 0; i < p.size(); ++i) {
      const float u = m.moments(p[i], g[i], s[0][i], s[1][i]);
      ps += static_cast<double>(p[i]) * p[i];
      us += static_cast<double>(u) * u;
    }
    const float neg = lamb_tensor_step(m.lr, a.use_trust_ratio, ps, us);
    for (size_t i = 0; i < p.size(); ++i) p[i] = fmaf(neg, m.update(p[i], s[0][i], s[1][i]), p[i]);
  } else if (algo == "lars") {  // the two passes of lars.cu over one tensor
    LarsArgs a{lr, static_cast<float>(arg("momentum")), static_cast<float>(arg("eeta")), wd,
               static_cast<float>(arg("epsilon")), inv, flag("maximize")};
    double gs = 0.0, ps = 0.0;
    for (size_t i = 0; i < p.size(); ++i) {
      gs += static_cast<double>(g[i]) * g[i];
      ps += static_cast<double>(p[i]) * p[i];
    }
    LarsMath m = lars_math(a);
    m.prepare(d, gs, ps);
    for (size_t i = 0; i < p.size(); ++i) m(p[i], g[i], &s[0][i]);
  } else {
    return 2;
  }
  write(dir + "/p.out", p);
  for (size_t k = 0; k < s.size(); ++k) write(dir + "/s" + std::to_string(k) + ".out", s[k]);
  return 0;
}
