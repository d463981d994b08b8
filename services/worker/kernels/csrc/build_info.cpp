// The vector instruction sets this build of the kernels was compiled for, named as /proc/cpuinfo
// names them. Why: a build's -march target (kernels/build.py, SPINDLE_KERNEL_MARCH) may take fewer
// than the CPU has (x86-64-v3 on an AVX-512 host runs an AVX2-only CPU's code paths), so what the
// kernels do is decided by the build, not by the CPU's flags: the worker logs this at start-up and
// tests compare their expectations against it.

#include <torch/library.h>

#include <string>

namespace spindle {

std::string instruction_sets() {
  std::string sets;
  const auto add = [&sets](const char* name) { sets += sets.empty() ? name : std::string(" ") + name; };
#ifdef __AVX2__
  add("avx2");
#endif
#ifdef __FMA__
  add("fma");
#endif
#ifdef __F16C__
  add("f16c");
#endif
#ifdef __AVX512F__
  add("avx512f");
#endif
#ifdef __AVX512BW__
  add("avx512bw");
#endif
#ifdef __AVX512VL__
  add("avx512vl");
#endif
#ifdef __AVX512BF16__
  add("avx512_bf16");
#endif
#ifdef __AVX512VNNI__
  add("avx512_vnni");
#endif
#ifdef __AMX_BF16__
  add("amx_bf16");
#endif
#ifdef __ARM_NEON
  add("asimd");
#endif
#ifdef __ARM_FEATURE_BF16
  add("bf16");
#endif
  return sets;
}

}  // namespace spindle

TORCH_LIBRARY_FRAGMENT(spindle, m) { m.def("instruction_sets() -> str", &spindle::instruction_sets); }
