// The kernels' side-by-side switches (SPINDLE_DISABLE_*), read as shared/switches.py reads the
// Python ones: on when set to anything but "" or "0". Callers read it once (a static) and keep it.
#pragma once

#include <cstdlib>

namespace spindle {

inline bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && v[0] != '\0' && !(v[0] == '0' && v[1] == '\0');
}

}  // namespace spindle
