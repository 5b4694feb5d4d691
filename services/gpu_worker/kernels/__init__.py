"""C++ CPU kernels built with torch cpp_extension, and their loader."""
