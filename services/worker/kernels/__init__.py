"""Native CPU kernels in C++ (csrc/), built on the machine that runs them by `build`."""
