"""Kernels called straight into libdnnl (oneDNN's C API) through ctypes."""
